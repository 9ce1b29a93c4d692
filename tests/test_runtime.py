"""Runtime helpers that generated launchers rely on, and what importing the runtime and generated code pulls
in (each in a fresh interpreter: imports are process-wide)."""
import os
import subprocess
import sys

import pytest
import torch

from codagen import runtime
from conftest import DEVICE, REPO


def python(code: str) -> subprocess.CompletedProcess:
    """`code` in a fresh Python at the repository root, with TRITON_INTERPRET unset as a user would have it."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)


def test_the_runtime_does_not_import_the_generator():
    result = python("import sys, codagen.runtime\n"
                    "print(sorted(m for m in ('jinja2', 'yaml', 'click', 'codagen.api', 'codagen.emit') "
                    "if m in sys.modules))")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "[]\n"


def test_generated_code_imports_only_torch_triton_and_the_runtime():
    """Blocks and kernels (Triton and Gluon) at run time: none of the generator (YAML loader, templates, CLI), and
    of codagen only the runtime and the standard-library modules it shares with `build --check` (tile configurations,
    the tuning tables' reader, quoting, the meaning of dims)."""
    shared = ('codagen.tileconfig', 'codagen.tablefile', 'codagen.quoting', 'codagen.dims')
    result = python("import sys, generated.blocks, generated.kernels, generated.kernels.gluon\n"
                    "print(sorted(m for m in sys.modules"
                    " if m.split('.')[0] in ('jinja2', 'yaml', 'click', 'markupsafe')"
                    " or (m.split('.')[0] == 'codagen' and m != 'codagen' and not m.startswith('codagen.runtime')"
                    f" and m not in {shared})))")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "[]\n"


# A generated kernel, launched after each of these imports: the API, the blocks, the kernels themselves.
FIRST_IMPORTS = ["import codagen; codagen.load", "import generated.blocks", "import generated.kernels.matmul"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the interpreter switch of a machine without CUDA")
@pytest.mark.parametrize("first", FIRST_IMPORTS)
def test_generated_code_works_whatever_is_imported_first(first):
    result = python(f"{first}\n"
                    "import torch\n"
                    "from generated.kernels import matmul\n"
                    "a, b = torch.randn(37, 29, dtype=torch.float64), torch.randn(50, 29, dtype=torch.float64)\n"
                    "out = matmul.matmul(a.float(), b.float())\n"
                    "print(f'{((out.double() - a @ b.T).norm() / (a @ b.T).norm()).item():.1e}')\n")
    assert result.returncode == 0, result.stderr
    assert float(result.stdout) < 1e-5


# Triton imported before any codagen module (by the user, or by torch._inductor): triton.language's own
# @triton.jit helpers (tl.max, ...) were made compiled-mode and must still work under the interpreter.
TRITON_FIRST = ["import triton", "import triton.language as tl"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the interpreter switch of a machine without CUDA")
@pytest.mark.parametrize("first", TRITON_FIRST)
def test_generated_kernels_work_after_triton_was_imported(first):
    result = python(f"{first}\n"
                    "import torch\n"
                    "from generated.kernels import out_proj_residual_norm\n"
                    "g = torch.Generator().manual_seed(0)\n"
                    "y, w, x = (torch.randn(s, generator=g, dtype=torch.float64)\n"
                    "           for s in ((37, 29), (50, 29), (37, 50)))\n"
                    "wn = torch.randn(50, generator=g, dtype=torch.float64)\n"
                    "x_out, h, ss = torch.ops.codagen.out_proj_residual_norm(y.float(), w.float(), x.float(),\n"
                    "                                                         wn.float())\n"
                    "want = x + y @ w.T\n"
                    "from codagen.runtime import finish\n"
                    "part = torch.randn(37, 5, generator=g, dtype=torch.float64)\n"
                    "lse = finish.logsumexp_tiles(x=part.float())  # tl.max: a @triton.jit helper of triton\n"
                    "errors = [(got.double() - ref).abs().max() / ref.abs().max() for got, ref in\n"
                    "          ((x_out, want), (h, want * wn), (ss.sum(1), (want * want).sum(1)),\n"
                    "           (lse, part.logsumexp(1)))]\n"
                    "print(f'{max(errors).item():.1e}')\n")
    assert result.returncode == 0, result.stderr
    assert float(result.stdout) < 1e-5


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
    assert list(runtime.row_chunks(0, 16)) == [slice(0, 0)]  # no rows: one empty chunk, so gradients come out


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
    same = runtime.ChunkSum("same")  # in the parts' own dtype: each 2**-9 is rounded away, and no part changes
    for part in parts:
        same.add(part)
    assert same.result().dtype == torch.bfloat16 and same.result()[0].item() == 1.0 and parts[0][0].item() == 1.0
    with pytest.raises(ValueError, match="'float32' or 'same'"):
        runtime.ChunkSum("bfloat16")


def test_chunk_sum_of_products_matches_one_product():
    g = torch.Generator().manual_seed(7)
    a, b = torch.randn(3 * 37, 20, generator=g), torch.randn(3 * 37, 13, generator=g)
    total = runtime.ChunkSum()
    for rows in runtime.row_chunks(a.shape[0], 37):
        total.add_matmul(a[rows], b[rows], "a")  # a^T @ b over row chunks: a weight gradient
    want = a.double().T @ b.double()
    assert torch.allclose(total.result().double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("in_place", [True, False])
def test_chunk_sum_accumulates_through_the_kernel_it_is_given(in_place):
    """Parts after the first go through `accumulate`, whose result is the total, written over the old one or
    (an op under torch.compile or autograd) a new tensor; with an fp32 sum the kernel is not used."""
    g = torch.Generator().manual_seed(11)
    a, b = torch.randn(3 * 37, 20, generator=g), torch.randn(3 * 37, 13, generator=g)
    calls = []

    def accumulate(a, b, total):
        calls.append(a.shape)
        return total.add_(a @ b) if in_place else total + a @ b
    same, fp32 = runtime.ChunkSum("same"), runtime.ChunkSum()
    for rows in runtime.row_chunks(a.shape[0], 37):
        same.add_matmul(a[rows], b[rows], "a", accumulate=accumulate)
        fp32.add_matmul(a[rows], b[rows], "a", accumulate=accumulate)
    want = a.double().T @ b.double()
    for total in (same, fp32):
        torch.testing.assert_close(total.result().double(), want, rtol=1e-5, atol=1e-5)
    assert calls == [(20, 37)] * 2


@pytest.mark.parametrize("rows,tiles", [(37, 1500), (700, 3), (5, 1002), (130, 16)])
def test_finish_reductions_over_tiles_match_float64(rows, tiles):
    """sum_tiles, rstd and logsumexp_tiles over fresh partials, in steps of up to 1024 tiles and 64 rows
    (ragged in both), and over a transposed view (a column's partials, as a weight gradient's are)."""
    from codagen.runtime import finish

    x = torch.randn(rows, tiles, device=DEVICE) * 3
    for part in (x, x.T.contiguous().T):
        wide = part.double()
        torch.testing.assert_close(finish.sum_tiles(part, divide_by=7), wide.sum(1) / 7, rtol=1e-5, atol=1e-5,
                                   check_dtype=False)
        torch.testing.assert_close(finish.logsumexp_tiles(part), wide.logsumexp(1), rtol=1e-6, atol=1e-6,
                                   check_dtype=False)
        torch.testing.assert_close(finish.rstd(part.abs(), size=tiles, eps=1e-6),
                                   (wide.abs().sum(1) / tiles + 1e-6).rsqrt(), rtol=1e-5, atol=0, check_dtype=False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_scale_in_place_rounds_once(dtype):
    """finish.scale_ (the backward's scaling of gradients made in the forward) on fresh values of a ragged size,
    NaN and infinities among them, in place: on a GPU the fp32 product with the fp32 factor, rounded once
    (torch's mul_ by a [] tensor would round the factor to bf16 or fp16 first); Triton's interpreter rounds bf16
    and fp16 toward zero, so on the CPU within one unit in the last place of the float64 product."""
    from codagen.runtime import finish

    x = torch.randn(4099 * 3 + 7, device=DEVICE).mul(100).to(dtype)
    x[::997] = float("nan")
    x[1::1009], x[2::1013] = float("inf"), float("-inf")
    factor = torch.rand((), device=DEVICE) * 3 + 0.1
    exact = x.double() * factor.double()
    want = (x.float() * factor).to(dtype)
    assert finish.scale_(x, factor) is x
    if DEVICE.type == "cuda":
        torch.testing.assert_close(x, want, rtol=0, atol=0, equal_nan=True)
    else:
        ulp = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 2.0**-23}[dtype]
        torch.testing.assert_close(x.double(), exact, rtol=ulp, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("batch,seq,q_heads,kv_heads,head_dim", [(2, 37, 4, 2, 64), (1, 5, 3, 1, 80), (3, 9, 2, 2, 16)])
def test_split_heads_is_pytorch_s_views_with_one_kernel_backward(batch, seq, q_heads, kv_heads, head_dim, dtype):
    check_split_heads(batch, seq, q_heads, kv_heads, head_dim, dtype, DEVICE)
    from codagen.runtime.heads import split_heads

    with pytest.raises(ValueError, match=r"split_heads: qkv \(2, 37, 12\) is not"):
        split_heads(torch.zeros(2, 37, 12, device=DEVICE), 4, 2, 64)


def check_split_heads(batch, seq, q_heads, kv_heads, head_dim, dtype, device):
    """split_heads gives the views that split, view and transpose give, and the same gradient bit for bit (a copy),
    also for upstream gradients in other strides (k's below) and where only some of q, k, v are used."""
    from codagen.runtime.heads import split_heads

    width = (q_heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(batch, seq, width, device=device, dtype=dtype, requires_grad=True)
    ref = qkv.detach().clone().requires_grad_()
    ours = split_heads(qkv, q_heads, kv_heads, head_dim)
    theirs = [t.view(batch, seq, -1, head_dim).transpose(1, 2)
              for t in ref.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)]
    for a, b in zip(ours, theirs):
        assert a.shape == b.shape and a.stride() == b.stride()
        assert a.data_ptr() - qkv.data_ptr() == b.data_ptr() - ref.data_ptr()
    grads = [torch.randn(t.shape, device=device, dtype=dtype) for t in theirs]
    grads[1] = grads[1].transpose(2, 3).contiguous().transpose(2, 3)
    for used in ((0, 1, 2), (0, 2), (1,)):
        got, = torch.autograd.grad([ours[i] for i in used], qkv, [grads[i] for i in used])
        want, = torch.autograd.grad([theirs[i] for i in used], ref, [grads[i] for i in used])
        assert torch.equal(got, want)
    with torch.no_grad():
        assert split_heads(qkv, q_heads, kv_heads, head_dim)[0].grad_fn is None


def test_tl_stages_fit_shared_memory_in_the_launch_dtype(monkeypatch):
    """A bf16-tuned tile (two 128x64 operand tiles, 4 of 5 stages in flight: 128 KiB) takes 256 KiB in fp32, more
    than an H200 program's 227 KiB: the tl launch keeps as many stages as fit (an fp32 launch given a bf16 table's
    entry failed with Triton's OutOfResources)."""
    monkeypatch.setattr(runtime, "_shared_bytes", lambda device: 232448)
    gpu = torch.device("cuda")
    config = runtime.Config(128, 128, 64, num_stages=5)
    assert runtime.fitting_stages(config, torch.bfloat16, gpu) == 5
    assert runtime.fitting_stages(config, torch.float32, gpu) == 4
    assert runtime.fitting_stages(runtime.Config(256, 256, 128, num_stages=4), torch.float32, gpu) == 2
    assert runtime.fitting_stages(config, torch.float32, torch.device("cpu")) == 5
