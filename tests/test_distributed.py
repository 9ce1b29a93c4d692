"""Data-parallel training on the CPU: examples/train_llama.py in 2 processes over gloo (torch.distributed.run), as DDP
and as FSDP2, against one process on the same global batch. The losses must agree at every step and the final
weights must agree: each rank's mean loss over its half of the batch, with gradients averaged over ranks, is the
one-process loss. Kernels run through Triton's interpreter, so the model is the tiny preset and 3 steps."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import quickened

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "train_llama.py"
STEPS = 3
# lr 1e-2 moves every weight by about half its size per step, so a wrong gradient anywhere changes the later losses
COMMON = ["--preset", "tiny", "--steps", str(STEPS), "--global-batch", "4", "--seq", "16", "--lr", "1e-2",
          "--seed", "3", "--device", "cpu", "--dtype", "float32", "--no-progress"]
TIMEOUT_S = 300


def _env() -> dict:
    env = dict(os.environ)
    env.update(TRITON_INTERPRET="1", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    # gloo binds to the address the host name resolves to; in a container without a network that may be
    # unreachable, so keep it on the loopback interface
    if "GLOO_SOCKET_IFNAME" not in env and Path("/sys/class/net/lo").exists():
        env["GLOO_SOCKET_IFNAME"] = "lo"
    return quickened(env)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd: list[str]) -> tuple[int, str]:
    """Run in a new session, so that a hung run is killed with every worker torchrun started."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return -1, out + f"\n(killed after {TIMEOUT_S} s)"
    return proc.returncode, out


def train(tmp_path: Path, name: str, nproc: int, *args: str) -> tuple[list[dict], dict, dict[str, torch.Tensor]]:
    """Run the script; return its step records, its summary and its final weights."""
    log, save = tmp_path / f"{name}.jsonl", tmp_path / f"{name}.pt"
    script_args = [str(SCRIPT), *COMMON, *args, "--log-file", str(log), "--save", str(save)]
    for _attempt in range(3):  # the free port may be taken between _free_port and torchrun's bind
        if nproc == 1:
            cmd = [sys.executable, *script_args]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
                   "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), *script_args]
        code, out = _run(cmd)
        if code == 0 or "address already in use" not in out.lower():
            break
    assert code == 0, f"{' '.join(cmd)} failed ({code}):\n{out[-6000:]}"
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    steps = [r for r in lines if "step" in r]
    (summary,) = [r["summary"] for r in lines if "summary" in r]
    assert [r["step"] for r in steps] == list(range(STEPS))
    return steps, summary, torch.load(save)


_ONE_PROCESS: dict[str, tuple] = {}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """model -> the one-process run (run once per module)."""
    def get(model: str):
        if model not in _ONE_PROCESS:
            path = tmp_path_factory.mktemp(f"single_{model}")
            _ONE_PROCESS[model] = train(path, f"single_{model}", 1, "--mode", "single", "--model", model)
        return _ONE_PROCESS[model]
    yield get
    _ONE_PROCESS.clear()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def assert_same_training(run, reference):
    steps, summary, weights = run
    ref_steps, _, ref_weights = reference
    losses, ref_losses = [r["loss"] for r in steps], [r["loss"] for r in ref_steps]
    for step, (loss, ref) in enumerate(zip(losses, ref_losses)):
        assert abs(loss - ref) <= 1e-5 * abs(ref), (step, losses, ref_losses)
    assert len(set(ref_losses)) == len(ref_losses), f"training did not change the loss: {ref_losses}"
    assert weights.keys() == ref_weights.keys()
    for name, w in ref_weights.items():
        assert rel(weights[name], w) < 1e-4, name


@pytest.mark.parametrize("model", ["codagen", "plain"])
def test_ddp_two_processes_train_like_one(tmp_path, one_process, model):
    run = train(tmp_path, "ddp", 2, "--mode", "ddp", "--model", model)
    assert run[1]["world"] == 2 and run[1]["mode"] == "ddp"
    assert_same_training(run, one_process(model))


def test_fsdp2_two_processes_train_like_one(tmp_path, one_process):
    """reshard_after_forward (the stress case): every block's weights are freed after its forward and gathered
    again for its backward, LmHeadLoss's included (--check asserts it is sharded between the two). --check also
    asserts that each block sees plain tensors, not DTensors, in its forward: per rank and step NormStats, 2 x
    (PreAttention, PostAttention) and LmHeadLoss."""
    run = train(tmp_path, "fsdp2", 2, "--mode", "fsdp2", "--check", "--reshard-after-forward", "true")
    assert run[1]["world"] == 2 and run[1]["reshard_after_forward"] is True
    assert run[1]["checked_block_calls"] == STEPS * 6
    assert_same_training(run, one_process("codagen"))


def test_fsdp2_plain_model_two_processes_train_like_one(tmp_path, one_process):
    """The reference model as the GPU measurement shards it: one FSDP group per layer's submodules."""
    run = train(tmp_path, "fsdp2_plain", 2, "--mode", "fsdp2", "--model", "plain")
    assert_same_training(run, one_process("plain"))


def test_plain_model_starts_from_the_same_weights(one_process):
    """--model plain (Hugging Face layout) starts from the weights the codagen model gets through codagen.convert,
    so the two train alike (to fp32 rounding, kernels against PyTorch ops)."""
    losses = [r["loss"] for r in one_process("plain")[0]]
    ref_losses = [r["loss"] for r in one_process("codagen")[0]]
    for step, (loss, ref) in enumerate(zip(losses, ref_losses)):
        assert abs(loss - ref) <= 1e-4 * abs(ref), (step, losses, ref_losses)
