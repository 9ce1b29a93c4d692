"""codagen.hf under FSDP2 per-layer wrapping: tests/hf_fsdp2_worker.py in 2 CPU processes over gloo
(torch.distributed.run) runs a patched tiny transformers causal LM of each family (Llama, Qwen2, Mistral, Qwen3,
Gemma-2) with fully_shard on each decoder layer and on the root, and compares loss and every gradient with the same
model unwrapped in one process, without and with gradient checkpointing. Each layer's forward reads its own
(gathered) parameters, and the next norm's weight, which the layer's last epilogue applies, is gathered whole by the
decoder loop (codagen.hf._next_norm_weight). And
tests/hf_fsdp2_lora_worker.py: a PEFT LoRA model patched and wrapped alike, three AdamW steps on its adapters against
the unpatched PEFT model in one process. And tests/hf_fsdp2_head_worker.py: a patched sequence classifier wrapped
alike, three AdamW steps on padded batches against the same model in one process."""
from __future__ import annotations

import json
import sys

import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
if not torch.distributed.is_available():
    pytest.skip("torch.distributed is not built", allow_module_level=True)

from test_distributed import REPO, _free_port, _run  # noqa: E402

WORKER = REPO / "tests" / "hf_fsdp2_worker.py"
LORA_WORKER = REPO / "tests" / "hf_fsdp2_lora_worker.py"
HEAD_WORKER = REPO / "tests" / "hf_fsdp2_head_worker.py"
FP8_WORKER = REPO / "tests" / "hf_fsdp2_fp8_worker.py"
TOL = 1e-5


def run_worker(worker, out):
    """Run a worker in 2 CPU processes (torch.distributed.run, gloo); its JSON result, which rank 0 wrote to out."""
    for _attempt in range(3):  # the free port may be taken between _free_port and torchrun's bind
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
               "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), str(worker), str(out)]
        code, log = _run(cmd)
        if code == 0 or "address already in use" not in log.lower():
            break
    assert code == 0, f"{' '.join(cmd)} failed ({code}):\n{log[-6000:]}"
    return json.loads(out.read_text())


def test_fsdp2_per_layer_fully_shard_matches_one_process(tmp_path):
    result = run_worker(WORKER, tmp_path / "fsdp2.json")
    assert result["world"] == 2
    assert [(r["family"], r["checkpointing"]) for r in result["runs"]] == [
        (f, c) for f in ("llama", "qwen2", "mistral", "qwen3", "gemma2") for c in (False, True)]
    for run in result["runs"]:
        assert run["params"], run
        assert abs(run["loss"] - run["ref_loss"]) <= TOL * abs(run["ref_loss"]), run
        assert run["max_rel_grad"] < TOL, run
        # 3 layers per forward; with checkpointing each layer's call runs again in the backward
        assert run["layer_calls"] == (6 if run["checkpointing"] else 3), run


def test_fsdp2_lora_training_matches_unpatched_peft_in_one_process(tmp_path):
    """A PEFT LoRA model (Llama, Qwen2, Mistral; adapters on every projection) patched by codagen, fully_shard on each
    layer and the root: three AdamW steps on the adapters, with and without gradient checkpointing, give the losses,
    the adapters' gradients and then their weights of the unpatched PEFT model trained in one process on the whole
    batches; the frozen base weights get no gradient."""
    pytest.importorskip("peft")
    result = run_worker(LORA_WORKER, tmp_path / "fsdp2_lora.json")
    assert result["world"] == 2
    assert [(r["family"], r["checkpointing"]) for r in result["runs"]] == [
        (f, c) for f in ("llama", "qwen2", "mistral") for c in (False, True)]
    for run in result["runs"]:
        assert run["trainable"] == 3 * 7 * 2, run  # lora_A and lora_B of 7 projections in each of 3 layers
        for loss, ref_loss in zip(run["losses"], run["ref_losses"], strict=True):
            assert abs(loss - ref_loss) <= TOL * abs(ref_loss), run
        assert run["ref_losses"][0] != run["ref_losses"][-1], run  # the steps trained
        assert run["max_rel_grad"] < TOL and run["max_rel_weight"] < TOL, run
        assert run["frozen_grads"] == [], run
        # 3 layers, 3 steps; with checkpointing each layer's call runs again in the backward
        assert run["layer_calls"] == (18 if run["checkpointing"] else 9), run


def test_fsdp2_sequence_classifier_trains_as_in_one_process(tmp_path):
    """A patched sequence classifier of each family, fully_shard on each layer and on the root (the score head's
    group): three AdamW steps on padded batches (Llama's with and without gradient checkpointing, Gemma-2's with) give
    the losses, every gradient and then every weight of the same model trained in one process on the whole batches."""
    result = run_worker(HEAD_WORKER, tmp_path / "fsdp2_head.json")
    assert result["world"] == 2
    assert [(r["family"], r["checkpointing"]) for r in result["runs"]] == [
        ("llama", False), ("llama", True), ("qwen2", False), ("mistral", False), ("qwen3", False), ("gemma2", True)]
    for run in result["runs"]:
        assert run["params"], run
        for loss, ref_loss in zip(run["losses"], run["ref_losses"], strict=True):
            assert abs(loss - ref_loss) <= TOL * abs(ref_loss), run
        assert run["ref_losses"][0] != run["ref_losses"][-1], run  # the steps trained
        assert run["max_rel_grad"] < TOL and run["max_rel_weight"] < TOL, run
        # 3 layers, 3 steps; with checkpointing each layer's call runs again in the backward
        assert run["layer_calls"] == (18 if run["checkpointing"] else 9), run


def test_fsdp2_fp8_model_quantizes_each_step_s_gathered_weights(tmp_path):
    """A Llama patched with fp8=True (fp32 master weights, bf16 autocast), fully_shard on each layer and the root:
    every FP8 weight copy a forward reads is the quantization of the weight FSDP2 has just gathered (none stale),
    made once per step and layer weight (9 a step; with checkpointing again in the recomputation, where FSDP2 gathers
    again), and three SGD steps give the losses of the same model in one process within FP8's and bf16's error (the
    first step's loss within fp32's, its gradients within the order in which bf16 gradients are summed)."""
    result = run_worker(FP8_WORKER, tmp_path / "fsdp2_fp8.json")
    assert result["world"] == 2
    assert [r["checkpointing"] for r in result["runs"]] == [False, True]
    for run in result["runs"]:
        assert run["stale"] == 0, run
        assert run["ref_quantized"] == 27 and run["quantized"] >= 27, run
        assert run["checkpointing"] or run["quantized"] == 27, run
        assert abs(run["losses"][0] - run["ref_losses"][0]) <= 1e-6 * abs(run["ref_losses"][0]), run
        assert run["max_rel_grads"][0] < 1e-2, run
        for loss, ref_loss in zip(run["losses"], run["ref_losses"], strict=True):
            assert abs(loss - ref_loss) <= 1e-2 * abs(ref_loss), run
        assert run["ref_losses"][0] != run["ref_losses"][-1], run  # the steps trained
        assert run["layer_calls"] == (18 if run["checkpointing"] else 9), run


def test_layer_output_is_the_block_s_output_and_not_a_view(monkeypatch):
    """What removes FSDP2's warning (a wrapped module that returns a view: an in-place op on it would drop the
    pre-backward hook) costs no copy: the layer's [batch, seq, dim] output is the PostAttention block's [M, dim]
    output's own storage, as a tensor that is not a view (the block saves none of its outputs)."""
    from codagen.hf import apply_codagen
    from test_hf import tiny_llama

    model = apply_codagen(tiny_llama())
    blocks = model.model.codagen_patch.api.blocks
    made = []
    apply = blocks.PostAttentionFunction.apply
    monkeypatch.setattr(blocks.PostAttentionFunction, "apply", lambda *a: made.append(apply(*a)) or made[-1])
    returned = []
    for layer in model.model.layers:
        layer.register_forward_hook(lambda module, args, out: returned.append(out[0]))
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(2))
    model(input_ids=ids, labels=ids).loss.backward()
    assert len(returned) == len(made) == 2
    for out, (x, _, _) in zip(returned, made):
        assert out._base is None and not out._is_view()
        assert out.shape == (2, 12, 64) and out.data_ptr() == x.data_ptr()
