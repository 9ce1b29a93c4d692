#!/usr/bin/env bash
# One call on the GPU machine: the GPU tests, then benchmark patterns, each step under its own time limit, logs
# and reports into $OUT (default benchmarks/results/run). Liger-Kernel comes from the wheel in .whl/ (README).
#
#   benchmarks/gpu_run.sh tests SECONDS                      # pytest -m gpu over tests/
#   benchmarks/gpu_run.sh bench SECONDS TAG [bench.py args]  # benchmarks/bench.py ... --out $OUT --tag TAG
#   benchmarks/gpu_run.sh tune SECONDS [codagen tune args]   # codagen tune specs/ ...; the tables to $OUT/tuning.tar
#                                   # (its log to $OUT/tune-N.log, N counting the call's tunes) and to the machine's
#                                   # $TMPDIR, where `restore` finds them
#   benchmarks/gpu_run.sh restore 0                          # the tables of the machine's last tune over generated/
#                                   # (a next call while the machine is warm: the checkout it gets has this one's)
#   benchmarks/gpu_run.sh profile SECONDS KERNEL SHAPE [launch_kernel.py args]
#                                   # Nsight Compute (ncu, or $NCU) on one launch: $OUT/ncu-KERNEL-SHAPE.*
#   benchmarks/gpu_run.sh clocks SECONDS KERNEL SHAPE...     # clocks.py beside cuBLAS: $OUT/clocks-KERNEL.md
#   benchmarks/gpu_run.sh train SECONDS [train_speed.py args] # training speed: $OUT/<gpu>-train-speed.*, its log
#                                   # to $OUT/train-speed-N.log (N counting the call's runs)
#   benchmarks/gpu_run.sh fsdp SECONDS [fsdp_speed.py args]   # FSDP2 training speed on every GPU of the machine:
#                                   # $OUT/<gpu>-fsdp-<GPUs>.*, its log to $OUT/fsdp-<GPUs>.log
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/run}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=.:${PYTHONPATH:-}
what=$1 limit=$2
shift 2
case $what in
  tests)
    { nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
      python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
      timeout "$limit" python3 -m pytest -m gpu -v -rfE -p no:cacheprovider tests/ "$@"
      echo "pytest exit: $?"; } > "$OUT/gpu-tests.log" 2>&1
    # the log is committed: this machine's paths (the checkout, python's prefix, temporary files) by role
    prefix=$(python3 -c "import sys; print(sys.prefix)")
    sed -i -e "s#$PWD#.#g" -e "s#$prefix#<python>#g" -e "s#${TMPDIR:-/tmp}/#<tmp>/#g" "$OUT/gpu-tests.log"
    tail -n 25 "$OUT/gpu-tests.log" ;;
  bench)
    tag=$1
    shift
    timeout "$limit" python3 benchmarks/bench.py --out "$OUT" --tag "$tag" "$@" > "$OUT/bench-$tag.log" 2>&1
    echo "bench exit: $?"
    tail -n 30 "$OUT/bench-$tag.log" ;;
  tune)  # --budget stops it cleanly before the limit: the shapes finished are written
    n=1
    while [ -e "$OUT/tune-$n.log" ]; do n=$((n + 1)); done
    python3 -m codagen tune specs/ --budget "$((limit - 20))" "$@" > "$OUT/tune-$n.log" 2>&1
    echo "tune exit: $?"
    tar -cf "$OUT/tuning.tar" generated/tuning
    cp "$OUT/tuning.tar" "${TMPDIR:-/tmp}/codagen-tuning.tar"
    tail -n 20 "$OUT/tune-$n.log" ;;
  restore)
    if [ -f "${TMPDIR:-/tmp}/codagen-tuning.tar" ]; then
      tar -xf "${TMPDIR:-/tmp}/codagen-tuning.tar" && echo "restored the tables of this machine's last tune"
    else
      echo "no tune ran on this machine: the checkout's tables stay"
    fi ;;
  profile)  # the second launch (the first compiles): speed of light, warp stalls, memory, per-instruction stalls
    kernel=$1 shape=$2
    shift 2
    report="$OUT/ncu-$kernel-$shape"
    ncu=${NCU:-ncu}  # Nsight Compute: NCU names it where it is not on the PATH
    timeout "$limit" "$ncu" --clock-control none --kernel-name "regex:^${kernel}_(gluon_)?kernel\$" --launch-skip 1 \
      --launch-count 1 --import-source no --section SpeedOfLight --section WarpStateStats \
      --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section SchedulerStats \
      --section LaunchStats --section Occupancy --section SourceCounters -f -o "$report" \
      python3 benchmarks/launch_kernel.py --kernel "$kernel" --shape "$shape" "$@" > "$report.log" 2>&1
    echo "ncu exit: $?"
    "$ncu" -i "$report.ncu-rep" --print-details all > "$report.txt" 2>&1
    "$ncu" -i "$report.ncu-rep" --page source --csv --print-source sass > "$report.csv" 2>&1
    tail -n 5 "$report.log"; grep -E "Duration|Throughput|Registers|Stall" "$report.txt" | head -n 30 ;;
  clocks)  # calls back to back: each call's time, the GPU's waits, SM clock, power and clock event reasons
    kernel=$1
    shift
    timeout "$limit" python3 benchmarks/clocks.py --kernel "$kernel" $(printf -- '--shape %s ' "$@") --seconds 2 \
      > "$OUT/clocks-$kernel.md" 2>&1
    echo "clocks exit: $?"
    cat "$OUT/clocks-$kernel.md" ;;
  train)  # the report is rewritten after every case: a run that the limit cuts off keeps the cases it finished
    n=1
    while [ -e "$OUT/train-speed-$n.log" ]; do n=$((n + 1)); done
    timeout "$limit" python3 benchmarks/train_speed.py --out "$OUT" "$@" > "$OUT/train-speed-$n.log" 2>&1
    echo "train_speed exit: $?"
    # the variants' one-line results and any error (the log also holds the libraries' warnings)
    grep -E -e '^[a-z0-9]+-[0-9]+x[0-9]+-(bf16|amp) ' -e '^wrote ' -e 'Error' "$OUT/train-speed-$n.log" | tail -n 40 ;;
  fsdp)  # one torchrun over the machine's GPUs; each variant's row as a JSON line
    n=$(nvidia-smi -L | wc -l)
    timeout "$limit" python3 -m torch.distributed.run --nproc-per-node "$n" benchmarks/fsdp_speed.py --out "$OUT" "$@" \
      > "$OUT/fsdp-$n.log" 2>&1
    echo "fsdp_speed exit: $?"
    grep -e '^{' -e 'Error' "$OUT/fsdp-$n.log" | tail -n 20 ;;
esac
