"""Runtime helpers that generated launchers rely on."""
import pytest
import torch

from codagen import runtime


def test_tensors_without_storage_are_refused():
    """A sharded FSDP2 parameter outside its module has no storage of its own; kernels must not see it."""
    runtime.check_storage("k", {"x": torch.randn(3, 4)})
    with pytest.raises(ValueError, match="'w' has no storage of its own"):
        runtime.check_storage("k", {"x": torch.randn(3, 4), "w": torch.empty(3, 4, device="meta")})


def test_launch_plans_depend_on_the_argument_types():
    plain = torch.randn(2, 3)
    param = torch.nn.Parameter(plain.clone())
    assert runtime.signature((plain,), None) != runtime.signature((param,), None)
    assert runtime.signature((plain,), None) == runtime.signature((torch.randn(2, 3),), None)


def test_row_chunks_cover_every_row_once():
    chunks = list(runtime.row_chunks(37, 16))
    assert [(c.start, c.stop) for c in chunks] == [(0, 16), (16, 32), (32, 37)]


def test_chunk_gradients_are_summed_in_fp32():
    parts = [torch.full((4,), 1.0, dtype=torch.bfloat16)] + [torch.full((4,), 2.0**-9, dtype=torch.bfloat16)] * 4
    # in bf16, 1 + 2**-9 rounds back to 1 four times over; in fp32 the four add up to 2**-7
    total = runtime.ChunkSum()
    for part in parts:
        total.add(part)
    assert total.result().dtype == torch.bfloat16 and total.result().float()[0].item() == 1.0 + 2.0**-7
    one = runtime.ChunkSum()
    one.add(parts[0])
    assert one.result() is parts[0]


def test_chunk_sum_of_products_matches_one_product():
    g = torch.Generator().manual_seed(7)
    a, b = torch.randn(3 * 37, 20, generator=g), torch.randn(3 * 37, 13, generator=g)
    total = runtime.ChunkSum()
    for rows in runtime.row_chunks(a.shape[0], 37):
        total.add_matmul(a[rows], b[rows], "a")  # a^T @ b over row chunks: a weight gradient
    want = a.double().T @ b.double()
    assert torch.allclose(total.result().double(), want, rtol=1e-5, atol=1e-5)
