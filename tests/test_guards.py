"""What generated launchers refuse instead of computing a silently wrong answer, or failing deep inside Triton:
outputs that share memory with other arguments, non-tensors where tensors go (and the reverse), invalid
configs, backward through a kernel op; and launches from several threads at once."""
from __future__ import annotations

import itertools
import threading

import pytest
import torch

from codagen import api, runtime
from codagen.runtime import Config
from codagen.runtime.checks import Aliasing, Decl, _rows
from codagen.validate import in_place_inputs
from conftest import DEVICE, draw_args
from generated.kernels import matmul, out_proj_residual_norm as k1

M, N, K = 37, 48, 48  # K = N: a GEMM operand could be passed as an output
CONFIG = Config(16, 16, 16, 2, 4, 1)  # 3 x 3 tiles


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def k1_reference(y, w_o, x, wn):
    x_new = x.double() + y.double() @ w_o.double().T
    return x_new, x_new * wn.double()


def k1_inputs(seed=0):
    return [randn(*s, seed=seed + i).float().to(DEVICE) for i, s in enumerate(((M, K), (N, K), (M, N), (N,)))]


def rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


# -- outputs that share memory ----------------------------------------------------------------------------

def test_an_output_overlapping_an_input_one_row_down_is_refused():
    y, w_o, _, wn = k1_inputs()
    buf = randn(M + 1, N).float().to(DEVICE)
    with pytest.raises(ValueError, match="out_proj_residual_norm: output 'x_out' overlaps input 'x' in memory"):
        k1.launch(y, w_o, buf[:M], wn, x_out=buf[1:], h=torch.empty(M, N, device=DEVICE),
                  ss=torch.empty(M, 3, device=DEVICE), config=CONFIG)


@pytest.mark.parametrize("operand", ["y", "w_o"])
def test_an_output_that_is_a_gemm_operand_is_refused(operand):
    y, w_o, x, wn = k1_inputs()
    x_out = y if operand == "y" else w_o[:M]  # the mainloop of other tiles would read what this one wrote
    with pytest.raises(ValueError, match=f"output 'x_out' overlaps input '{operand}'"):
        k1.launch(y, w_o, x, wn, x_out=x_out, h=torch.empty(M, N, device=DEVICE),
                  ss=torch.empty(M, 3, device=DEVICE), config=CONFIG)
    with pytest.raises(ValueError, match="matmul: output 'out_tile' overlaps input 'a'"):
        matmul.launch(y, w_o, out_tile=y, config=CONFIG)


def test_one_buffer_as_two_outputs_is_refused():
    y, w_o, x, wn = k1_inputs()
    out = torch.empty(M, N, device=DEVICE)
    with pytest.raises(ValueError, match="output 'x_out' overlaps output 'h'"):
        k1.launch(y, w_o, x, wn, x_out=out, h=out, ss=torch.empty(M, 3, device=DEVICE), config=CONFIG)


def test_an_output_may_be_the_input_it_updates_in_place():
    """x_out is x: each element of x is read by the program that overwrites it, before it does."""
    y, w_o, x, wn = k1_inputs()
    want_x, want_h = k1_reference(y, w_o, x, wn)
    h = torch.empty(M, N, device=DEVICE)
    k1.launch(y, w_o, x, wn, x_out=x, h=h, ss=torch.empty(M, 3, device=DEVICE), config=CONFIG)
    assert rel(x, want_x) < 1e-5 and rel(h, want_h) < 1e-5


def test_in_place_means_the_very_same_view():
    y, w_o, _, wn = k1_inputs()
    buf = randn(M, 2 * N).float().to(DEVICE)
    x = buf[:, :N]
    with pytest.raises(ValueError, match="pass it as 'x_out' itself"):  # x's columns, one further right
        k1.launch(y, w_o, x, wn, x_out=buf[:, 1:N + 1], h=torch.empty(M, N, device=DEVICE),
                  ss=torch.empty(M, 3, device=DEVICE), config=CONFIG)


@pytest.mark.parametrize("halves", ["rows", "columns"])
def test_disjoint_parts_of_one_buffer_are_fine(halves):
    y, w_o, x, wn = k1_inputs()
    want_x, want_h = k1_reference(y, w_o, x, wn)
    buf = torch.full((2 * M, N) if halves == "rows" else (M, 2 * N), float("nan"), device=DEVICE)
    x_out, h = (buf[:M], buf[M:]) if halves == "rows" else (buf[:, :N], buf[:, N:])
    k1.launch(y, w_o, x, wn, x_out=x_out, h=h, ss=torch.empty(M, 3, device=DEVICE), config=CONFIG)
    assert rel(x_out, want_x) < 1e-5 and rel(h, want_h) < 1e-5


def test_addresses_checked_once_are_rechecked_when_they_change():
    """The launch plan is kept per signature (shapes, strides, dtypes), which says nothing about where the
    tensors are: a launch of the same signature on overlapping memory is still refused."""
    y, w_o, x, wn = k1_inputs()
    h, ss = torch.empty(M, N, device=DEVICE), torch.empty(M, 3, device=DEVICE)
    for _ in range(2):
        k1.launch(y, w_o, x, wn, x_out=torch.empty(M, N, device=DEVICE), h=h, ss=ss, config=CONFIG)
    with pytest.raises(ValueError, match="output 'x_out' overlaps output 'h'"):
        k1.launch(y, w_o, x, wn, x_out=h, h=h, ss=ss, config=CONFIG)


def _bytes(t: torch.Tensor) -> set[int]:
    """Every byte address of a tensor's elements: the brute-force truth for the overlap check."""
    item = t.element_size()
    offsets = {sum(i * s for i, s in zip(index, t.stride())) for index in itertools.product(*map(range, t.shape))}
    return {t.data_ptr() + o * item + b for o in offsets for b in range(item)}


def test_the_overlap_check_agrees_with_brute_force():
    """Random views of one buffer (row and column slices, transposes, vectors, strided vectors): refused
    exactly when they share a byte, for layouts the check resolves; never let through when they do."""
    g = torch.Generator().manual_seed(3)
    buf = torch.zeros(4096)
    decls = (Decl("a", ("M", "N"), "float32"), Decl("b", ("M", "N"), "float32", output=True))

    def view():
        r = lambda n: int(torch.randint(0, n, (), generator=g))  # noqa: E731
        start, kind = r(200), r(4)
        if kind == 3:  # a strided vector
            return buf[start::1 + r(5)][:1 + r(40)]
        rows, cols, stride = 1 + r(9), 1 + r(6), 12 + r(2)
        t = buf[start:start + rows * stride].view(rows, stride)[:, :cols]
        return t.t() if kind == 1 else t[:, 0] if kind == 2 else t

    refused = interleaved = 0
    for _ in range(600):
        a, b = view(), view()
        shared = bool(_bytes(a) & _bytes(b))
        try:
            Aliasing("k", decls, (a, b)).check((a, b))
            ok = True
        except ValueError:
            ok, refused = False, refused + 1
        assert not (ok and shared)
        # refused without sharing a byte only where their rows are laid out apart: told apart there is
        # not tried
        spans = [_rows(t) for t in (a, b)]
        assert ok or shared or (spans[0][1] > 1 and spans[1][1] > 1 and spans[0][2] != spans[1][2])
        lows, highs = [t.data_ptr() for t in (a, b)], [max(_bytes(t)) for t in (a, b)]
        interleaved += ok and max(lows) <= min(highs)  # spans intersect, but no element is shared
    assert refused > 50 and interleaved > 50


def test_outputs_may_update_in_place_only_inputs_read_before_they_are_written(tmp_path):
    spec = tmp_path / "store_then_read.yaml"
    spec.write_text("kernel: store_then_read\ndoc: Stores acc, then reads x.\ngemm: {a: a, b: b, b_layout: nk}\n"
                    "inputs: {a: [M, K], b: [N, K], x: [M, N], v: [N]}\noutputs: {y: [M, N], z: [M, N], w: [N]}\n"
                    "epilogue:\n  - store: {x: acc, to: y}\n  - add: {x: acc, y: x, out: s}\n"
                    "  - store: {x: s, to: z}\n  - add: {x: v, y: v, out: vv}\n  - store: {x: vv, to: w}\n")
    (checked,) = api.load([spec])
    assert in_place_inputs(checked.kernel) == {"y": (), "z": ("x",), "w": ()}  # v: read by every row of tiles
    assert {d.name: d.in_place_of for d in k1.DECLS if d.output} == {"x_out": ("x",), "h": ("x",), "ss": ()}
    assert not any(d.in_place_of for d in matmul.DECLS)


# -- arguments of the wrong kind ----------------------------------------------------------------------------

def test_a_non_tensor_argument_is_named():
    y, w_o, x, wn = k1_inputs()
    out = dict(x_out=torch.empty(M, N, device=DEVICE), h=torch.empty(M, N, device=DEVICE),
               ss=torch.empty(M, 3, device=DEVICE))
    with pytest.raises(ValueError, match="out_proj_residual_norm: 'wn' must be a torch.Tensor, got float"):
        k1.launch(y, w_o, x, 1.0, **out, config=CONFIG)
    with pytest.raises(ValueError, match="'x' must be a torch.Tensor, got list"):
        k1.out_proj_residual_norm(y, w_o, x.tolist(), wn)


def test_a_host_scalar_must_be_a_number(test_kernels):
    t_scale = test_kernels("t_scale")
    args = draw_args(t_scale, {"M": 19, "N": 22, "K": 13}, torch.float32, CONFIG)
    for bad, what in ((torch.tensor(2.0), "a tensor"), ("2.0", "str"), (None, "NoneType")):
        with pytest.raises(TypeError, match=f"t_scale: 'alpha' is a host scalar and must be a Python number, "
                                            f"got {what}"):
            t_scale.launch(**{**args.kwargs, "alpha": bad}, config=CONFIG)


@pytest.mark.parametrize("bad, message", [
    (dict(block_n=24), "block_n must be a power of two from 16 to 512"),
    (dict(block_m=8), "block_m must be a power of two"),
    (dict(block_k=1024), "block_k must be a power of two"),
    (dict(block_m=64.0), "block_m must be an int"),
    (dict(num_warps=3), "num_warps must be a power of two from 1 to 32"),
    (dict(num_stages=0), "group_m and num_stages must be at least 1"),
    (dict(group_m=0), "group_m and num_stages must be at least 1"),
    (dict(epilogue_split=3), "epilogue_split must be 1, 2, 4 or 8"),
    (dict(persistent=1), "persistent must be True or False"),
    (dict(flatten=True), "flatten pipelines a persistent program's loop over tiles"),
    (dict(warp_specialize=True, persistent=True), "warp_specialize needs persistent=True and tma=True"),
    (dict(warp_specialize=True, persistent=True, tma=True, flatten=True), "warp_specialize needs .* flatten=False"),
])
def test_invalid_configs_are_refused_when_made(bad, message):
    with pytest.raises(ValueError, match=f"Config: {message}"):
        Config(**bad)


def test_a_config_that_is_not_a_config_is_named():
    a, b = randn(M, K).float().to(DEVICE), randn(N, K).float().to(DEVICE)
    with pytest.raises(TypeError, match=r"config must be a codagen.runtime.Config \(TlConfig\), a config of another "
                                        r"backend \(HopperConfig\) or None, got dict"):
        matmul.launch(a, b, out_tile=torch.empty(M, N, device=DEVICE), config={"block_m": 64})


# -- no backward through kernels ----------------------------------------------------------------------------

@pytest.mark.parametrize("call", ["op", "function"])
def test_a_kernel_call_that_autograd_would_record_points_to_the_blocks(call):
    """Through torch.ops.codagen.matmul, and through the eager function (which would otherwise return a
    result with no gradient, so that a loss built on it would silently miss that part): refused at the call."""
    a = randn(M, K).float().to(DEVICE).requires_grad_()
    b = randn(N, K).float().to(DEVICE)
    with pytest.raises(RuntimeError, match=r"torch.ops.codagen.matmul has no backward: kernel ops are not "
                                           r"differentiable. The differentiable API is the block modules of "
                                           r"generated.blocks"):
        torch.ops.codagen.matmul(a, b) if call == "op" else matmul.matmul(a, b)
    with torch.no_grad():
        out = torch.ops.codagen.matmul(a, b) if call == "op" else matmul.matmul(a, b)
    assert not out.requires_grad and rel(out, a.detach().double() @ b.double().T) < 1e-5


# -- threads ------------------------------------------------------------------------------------------------

def test_launches_from_two_threads_at_once_are_right():
    errors, results = [], []

    def work(seed):
        a, b = randn(70, 40, seed=seed).float().to(DEVICE), randn(90, 40, seed=seed + 1).float().to(DEVICE)
        try:
            for _ in range(3):
                results.append(rel(matmul.matmul(a, b), a.double() @ b.double().T))
        except Exception as e:  # noqa: BLE001 - reported below, with the thread's own error
            errors.append(e)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in (1, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 6 and max(results) < 1e-5
