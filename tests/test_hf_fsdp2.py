"""codagen.hf under FSDP2 per-layer wrapping: tests/hf_fsdp2_worker.py in 2 CPU processes over gloo
(torch.distributed.run) runs a patched tiny transformers Llama with fully_shard on each decoder layer and on the root,
and compares loss and every gradient with the same model unwrapped in one process, without and with gradient
checkpointing. Each layer's forward reads its own (gathered) parameters, and the next norm's weight, which the
layer's last epilogue applies, is gathered whole by the decoder loop (codagen.hf._next_norm_weight)."""
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
TOL = 1e-5


def test_fsdp2_per_layer_fully_shard_matches_one_process(tmp_path):
    out = tmp_path / "fsdp2.json"
    for _attempt in range(3):  # the free port may be taken between _free_port and torchrun's bind
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
               "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), str(WORKER), str(out)]
        code, log = _run(cmd)
        if code == 0 or "address already in use" not in log.lower():
            break
    assert code == 0, f"{' '.join(cmd)} failed ({code}):\n{log[-6000:]}"
    result = json.loads(out.read_text())
    assert result["world"] == 2
    assert [r["checkpointing"] for r in result["runs"]] == [False, True]
    for run in result["runs"]:
        assert run["params"], run
        assert abs(run["loss"] - run["ref_loss"]) <= TOL * abs(run["ref_loss"]), run
        assert run["max_rel_grad"] < TOL, run
        # 3 layers per forward; with checkpointing each layer's call runs again in the backward
        assert run["layer_calls"] == (6 if run["checkpointing"] else 3), run


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
