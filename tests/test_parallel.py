"""codagen.parallel and data parallelism over several processes: tests/parallel_worker.py run by torch.distributed.run
in 2 or 4 CPU processes over gloo (kernels through Triton's interpreter), on data drawn from a fresh seed (shown in
every failure). What each case compares is in the worker's docstring."""
from __future__ import annotations

import fcntl
import json
import os
import random
import re
import sys

import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available():
    pytest.skip("torch.distributed is not built", allow_module_level=True)

from test_distributed import REPO, _free_port, _run  # noqa: E402

from codagen.parallel import layer_shards, vocab_parallel_lm_head_loss, vocab_range  # noqa: E402

WORKER = REPO / "tests" / "parallel_worker.py"
# fp32 kernels (the launchers take fp16, bf16 and fp32) against float64 PyTorch, and against the same kernels in
# one process: fp32 rounding only, about 2e-7 at these sizes
TOL_F64 = 1e-6
# the variants add fp32 roundings (softcap's tanh, z-loss's square of the logsumexp): up to 7.1e-7 over six seeds,
# past 1e-6 at some
TOL_F64_VARIANTS = 3e-6
TOL = 1e-5  # whole models, fp32, against the same model in one process


def torchrun(nproc: int, *script_args: str) -> None:
    for _attempt in range(3):  # the free port may be taken between _free_port and torchrun's bind
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
               "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), *script_args]
        code, log = _run(cmd)
        if code == 0 or "address already in use" not in log.lower():
            break
    assert code == 0, f"{' '.join(cmd)} failed ({code}):\n{log[-6000:]}"


# The worker's cases by world size: one torchrun each runs them all (a start costs more than most cases), once per
# pytest run, for every pytest-xdist worker.
BATCHES = {2: ("vocab_parallel", "vocab_parallel_variants", "llama_vocab_parallel", "tensor_parallel", "ddp_codagen",
               "ddp_hf", "hf_tensor_parallel_llama", "hf_tensor_parallel_llama_tied",
               "hf_tensor_parallel_llama_checkpointing", "hf_tensor_parallel_llama_biases", "hf_tensor_parallel_qwen2",
               "hf_tensor_parallel_mistral", "hf_tensor_parallel_qwen3", "hf_tensor_parallel_gemma2",
               "hf_tensor_parallel_autocast_llama", "hf_tensor_parallel_autocast_gemma2",
               "hf_tensor_parallel_bf16_llama", "hf_tensor_parallel_refusals"),
           4: ("vocab_parallel", "tensor_parallel", "hf_tensor_parallel_llama_tied", "hf_tensor_parallel_gemma2",
               "hf_tensor_parallel_autocast_llama", "hf_tensor_parallel_2d", "hf_tensor_parallel_2d_fsdp2")}


@pytest.fixture(scope="session")
def run_worker(tmp_path_factory):
    """run_worker(case, nproc): what the worker's case measured at that world size, its seed added. The first call
    at a world size, in any pytest-xdist worker, runs every case of its batch; the others wait for it and read."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # this run's folder, above each xdist worker's own

    def run(case: str, nproc: int) -> dict:
        out = shared / f"gloo{nproc}"
        with open(shared / f"gloo{nproc}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (out / "batch.json").exists():
                out.mkdir(exist_ok=True)
                seed = random.SystemRandom().randrange(2**31)
                try:
                    torchrun(nproc, str(WORKER), ",".join(BATCHES[nproc]), str(out), str(seed))
                    failure = None
                except AssertionError as e:  # every case of the batch reports it
                    failure = str(e)
                (out / "batch.json").write_text(json.dumps(dict(seed=seed, failure=failure)))
        batch = json.loads((out / "batch.json").read_text())
        assert batch["failure"] is None, batch["failure"]
        result = json.loads((out / f"{case}.json").read_text())
        assert "error" not in result, f"seed {batch['seed']}:\n{result.get('error')}"
        assert result["world"] == nproc
        result["seed"] = batch["seed"]
        return result

    return run


@pytest.mark.parametrize("nproc", [2, 4])
def test_vocab_parallel_cross_entropy_matches_f_cross_entropy(run_worker, nproc):
    result = run_worker("vocab_parallel", nproc)
    assert [c["reduction"] for c in result["cases"]] == ["mean", "sum"]
    for case in result["cases"]:
        assert case["ignored"] > 0 and case["slices_with_target"] == nproc, (result["seed"], case)
        assert case["same_loss_on_every_rank"], (result["seed"], case)
        for key in ("loss", "x", "wn", "w_vocab"):
            assert case[f"{key}_vs_f64"] < TOL_F64, (result["seed"], key, case)
            assert case[f"{key}_vs_block"] < TOL_F64, (result["seed"], key, case)


def test_vocab_parallel_cross_entropy_variants(run_worker):
    """z-loss, label smoothing, softcapping, token weights (mean and sum), reduction "none" (plain and z-loss), and
    Gemma-2's head (its final norm's 1 + w scale, softcapped logits), over the vocabulary split across the ranks:
    against F.cross_entropy in float64 and the single-process block (but z-loss with "none", which no block
    declares). At 2 processes: the variants combine their ranks' partials as the plain loss does, which
    test_vocab_parallel_cross_entropy_matches_f_cross_entropy checks at 4 too."""
    result = run_worker("vocab_parallel_variants", 2)
    assert [(c["variant"], c["reduction"]) for c in result["cases"]] == [
        ("z_loss", "mean"), ("z_loss", "sum"), ("smoothing", "mean"), ("smoothing", "sum"), ("softcap", "mean"),
        ("token_weights", "mean"), ("token_weights", "sum"), ("plain", "none"), ("z_loss", "none"), ("gemma2", "mean")]
    for case in result["cases"]:
        assert case["same_loss_on_every_rank"], (result["seed"], case)
        compared = [k for k in case if k.endswith(("_vs_f64", "_vs_block"))]
        # no single-process block declares z-loss with "none": against float64 alone
        assert len(compared) == (4 if case["variant"] == "z_loss" and case["reduction"] == "none" else 8), case
        for key in compared:
            assert case[key] < TOL_F64_VARIANTS, (result["seed"], key, case)


def test_llama_with_a_vocab_parallel_head_matches_one_process(run_worker):
    result = run_worker("llama_vocab_parallel", 2)
    assert abs(result["loss"] - result["ref_loss"]) <= TOL * abs(result["ref_loss"]), result
    assert result["max_rel_grad"] < TOL, result


@pytest.mark.parametrize("nproc", [2, 4])
def test_tensor_parallel_llama_matches_one_process(run_worker, nproc):
    result = run_worker("tensor_parallel", nproc)
    assert result["same_params"], result
    assert abs(result["loss"] - result["ref_loss"]) <= TOL * abs(result["ref_loss"]), result
    assert result["max_rel_grad"] < TOL, result


# every case at 2 processes; at 4, the two whose sharding differs most (4 processes share 2 cores in CI): Llama with
# its embedding tied to the head, and Gemma-2, whose layers all-reduce before their post-norms
@pytest.mark.parametrize("case, nproc", [("llama", 2), ("llama_tied", 2), ("llama_tied", 4), ("llama_checkpointing", 2),
                                         ("llama_biases", 2), ("qwen2", 2), ("mistral", 2), ("qwen3", 2),
                                         ("gemma2", 2), ("gemma2", 4)])
def test_hf_tensor_parallel_matches_unpatched_transformers(run_worker, case, nproc):
    """codagen.parallel.apply_tensor_parallel over a transformers causal LM (tied embeddings: one vocab-parallel
    parameter; gradient checkpointing; Llama's mlp_bias and attention_bias: the biases of every projection, the
    row-parallel ones added once; Qwen2: a qkv bias; Mistral: a sliding window; Qwen3: QK-norm, its own block before
    attention): three AdamW steps, the losses
    and every gradient against the unpatched model in one process, and the whole weights gathered (full_state_dict)
    after them; the gradients of a loss of the gathered logits; the logits in evaluation and greedy generate()."""
    pytest.importorskip("transformers")
    result = run_worker(f"hf_tensor_parallel_{case}", nproc)
    assert result["embed_is_head"] == result["tied"] == (case in ("llama_tied", "gemma2")), result
    for i, step in enumerate(result["steps"]):
        assert abs(step["loss"] - step["ref_loss"]) <= TOL * abs(step["ref_loss"]), (result["seed"], result)
        # after the first AdamW step the two models' weights differ by their rounding (~5e-8), which the next
        # gradients can amplify: Gemma-2 at 4 processes, seed 1713879383, 1.1e-5 at the third step (2e-6 typical)
        assert step["max_rel_grad"] < (TOL if i == 0 else 4 * TOL), (result["seed"], result)
    assert result["max_rel_param"] < TOL, (result["seed"], result)
    full = result["full_state"]
    assert full["same_keys"] and full["same_shapes"] and full["max_rel"] < TOL, (result["seed"], result)
    assert result["same_logits_shape"] and result["logits"] < TOL, (result["seed"], result)
    assert result["logits_grad"] < TOL, (result["seed"], result)
    assert result["same_generate"], (result["seed"], result)


@pytest.mark.parametrize("case, nproc", [("autocast_llama", 2), ("autocast_gemma2", 2), ("autocast_llama", 4),
                                         ("bf16_llama", 2)])
def test_hf_tensor_parallel_in_bf16(run_worker, case, nproc):
    """apply_tensor_parallel under torch.autocast (bf16, fp32 weights; Llama with every projection's bias), and over
    bf16 weights: against the codagen.hf-patched model in one process alike, to bf16's precision (the same kernels;
    the ranks' partial products rounded to bf16 before their sum), and against the unpatched transformers model
    alike no further than twice the one-process patched model is, give or take one bf16 rounding (2^-8); the
    gradients come back in the weights' dtype."""
    pytest.importorskip("transformers")
    r = run_worker(f"hf_tensor_parallel_{case}", nproc)
    bf16 = 2.0**-8

    def rel(a, b):
        return abs(a - b) / abs(b)

    assert r["grads_dtype"] == (["torch.bfloat16"] if case.startswith("bf16") else ["torch.float32"]), r
    assert rel(r["loss"], r["patched_loss"]) < bf16 and r["grads_vs_patched"] < 0.1, r
    assert rel(r["loss"], r["ref_loss"]) <= 2 * rel(r["patched_loss"], r["ref_loss"]) + bf16, r
    assert r["grads_vs_ref"] <= 2 * r["patched_grads_vs_ref"] + bf16, r


@pytest.mark.parametrize("case", ["hf_tensor_parallel_2d", "hf_tensor_parallel_2d_fsdp2"])
def test_tensor_parallel_within_pairs_and_data_parallel_across_them(run_worker, case):
    """A 2 x 2 DeviceMesh: apply_tensor_parallel over its "tp" dimension, DistributedDataParallel or FSDP2 (fully_shard
    on each decoder layer and the root) over its "dp" one, against the unpatched transformers Llama on the whole batch
    in one process."""
    pytest.importorskip("transformers")
    result = run_worker(case, 4)
    assert abs(result["loss"] - result["ref_loss"]) <= TOL * abs(result["ref_loss"]), result
    assert result["max_rel_grad"] < TOL, result


def test_hf_tensor_parallel_refusals(run_worker):
    """What apply_tensor_parallel refuses, by name, before it changes the model."""
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    refusals = run_worker("hf_tensor_parallel_refusals", 2)["refusals"]
    expected = {"kv_heads": r"config.num_key_value_heads = 1 is not divisible by the world size 2",
                "family": r"Qwen2ForCausalLM is not supported: its layers have no tensor-parallel form yet",
                "peft": r"PEFT \(LoRA\) model", "classifier": r"got LlamaForSequenceClassification",
                "twice": r"already tensor-parallel", "fp8": r"patched with apply_codagen\(fp8=True\) is not supported"}
    for name, pattern in expected.items():
        assert refusals[name] is not None, name
        assert re.search(pattern, refusals[name]["message"]), refusals[name]
        assert refusals[name]["unpatched"] or name in ("twice", "fp8"), refusals[name]  # those patched before


@pytest.mark.parametrize("kind", ["codagen", "hf"])
def test_ddp_matches_one_process(run_worker, kind):
    """DDP over codagen's Llama assembly, and over a codagen.hf-patched transformers Llama."""
    if kind == "hf":
        pytest.importorskip("transformers")
    result = run_worker(f"ddp_{kind}", 2)
    assert abs(result["loss"] - result["ref_loss"]) <= TOL * abs(result["ref_loss"]), result
    assert result["max_rel_grad"] < TOL, result


def test_train_fsdp_example_runs(tmp_path):
    """examples/train_fsdp.py on the CPU: 2 gloo processes, FSDP2 per layer, activation checkpointing, 2 steps."""
    pytest.importorskip("transformers")
    log = tmp_path / "fsdp.jsonl"
    torchrun(2, str(REPO / "examples" / "train_fsdp.py"), "--steps", "2", "--seq", "16", "--vocab", "128",
             "--log-file", str(log))
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    assert all(0 < r["loss"] < 10 for r in records), records  # ln(128) = 4.85 at the start


def test_fsdp_speed_benchmark_runs_and_codagen_trains_as_hf(tmp_path):
    """benchmarks/fsdp_speed.py on the CPU: 2 gloo processes, a tiny Llama under FSDP2 per layer, Hugging Face's
    and codagen's variants from the same weights on the same tokens: both rows timed, the same final loss (fp32),
    and the report written."""
    pytest.importorskip("transformers")
    torchrun(2, str(REPO / "benchmarks" / "fsdp_speed.py"), "--tiny", "--layers", "2", "--seq", "32", "--warmup", "1",
             "--steps", "2", "--variants", "hf,codagen", "--out", str(tmp_path))
    report = json.loads((tmp_path / "cpu-fsdp-2.json").read_text())
    hf, ours = report["rows"]
    assert (hf["variant"], ours["variant"], hf["world"]) == ("hf", "codagen", 2)
    for row in (hf, ours):
        assert row["error"] is None and row["tokens_per_s_per_gpu"] > 0 and row["peak_mib"] is None, row
    assert abs(ours["loss_final"] - hf["loss_final"]) <= TOL * hf["loss_final"], (hf, ours)
    assert "| codagen |" in (tmp_path / "cpu-fsdp-2.md").read_text()


def test_train_tensor_parallel_example_runs(tmp_path):
    """examples/train_tensor_parallel.py on the CPU: 2 gloo processes, tied embeddings, 2 steps."""
    pytest.importorskip("transformers")
    log = tmp_path / "tp.jsonl"
    torchrun(2, str(REPO / "examples" / "train_tensor_parallel.py"), "--steps", "2", "--seq", "16", "--vocab", "128",
             "--tie", "--log-file", str(log))
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    assert all(0 < r["loss"] < 10 for r in records), records  # ln(128) = 4.85 at the start


def test_vocab_range_covers_the_vocabulary_once():
    for vocab, world in ((45, 2), (45, 4), (8, 4), (5, 5)):
        ranges = [vocab_range(vocab, r, world) for r in range(world)]
        assert ranges[0][0] == 0 and ranges[-1][1] == vocab
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        assert max(b - a for a, b in ranges) - min(b - a for a, b in ranges) <= 1


def test_refusals():
    with pytest.raises(ValueError, match="cannot be split over 4 ranks"):
        vocab_range(3, 0, 4)
    x, wn, w = torch.randn(3, 8), torch.rand(8) + 0.5, torch.randn(5, 8)
    from codagen.presets import PRESETS

    with pytest.raises(NotImplementedError, match=r"n_kv_heads \(2\) divisible by 4"):
        layer_shards(PRESETS["tiny"], 0, 4)
    with pytest.raises(NotImplementedError, match="z_loss and smoothing together are not implemented"):
        vocab_parallel_lm_head_loss(x, torch.randint(0, 5, (3,)), wn, w, 0, 5, 1e-5, z_loss=1e-4, smoothing=0.1)
    with pytest.raises(NotImplementedError, match="softcap and token_weights together are not implemented"):
        vocab_parallel_lm_head_loss(x, torch.randint(0, 5, (3,)), wn, w, 0, 5, 1e-5, softcap=30.0,
                                    token_weights=torch.ones(3))
    with pytest.raises(ValueError, match="reduction must be 'mean', 'sum' or 'none', got 'max'"):
        vocab_parallel_lm_head_loss(x, torch.randint(0, 5, (3,)), wn, w, 0, 5, 1e-5, reduction="max")
