"""A checked kernel -> the source of its generated module: the @triton.jit kernel, the launcher and the
torch.library op. The template is the module's text; this file computes what varies, in spec order, and the
launch's arguments come from the view both backends read (launch.py)."""
from __future__ import annotations

from ..fingerprint import fingerprint
from ..model import BLayout, InputRole, Kernel, Kind, ValueType, Width
from .epilogue import emit_epilogue
from .launch import LaunchSignature
from .templates import render


def render_kernel(k: Kernel, types: dict[str, ValueType], regenerate: str, others: bool = False) -> str:
    """The tl kernel's module; `others`: other backends lower the kernel too, and the launcher runs the kernel
    of the backend its config names (runtime.backends.launch)."""
    sig = LaunchSignature(k)
    # the GEMM's operands and K-group scales are the mainloop's; the epilogue reads the other tensors
    operands = (k.gemm.a, k.gemm.b, *(k.gemm.scales.names if k.gemm.scales else ())) if k.gemm else ()
    epilogue_tensors = [t for t in sig.tensors if t.name not in operands]
    epilogue_pointers = [f"_{t.name}_ptr" for t in epilogue_tensors]
    if k.gemm and any(s.op == "cast" and s.args["dtype"] == "T" for s in k.steps):
        epilogue_pointers.insert(0, f"_{k.gemm.a}_ptr")  # only its element type: what `cast` to T rounds to
    return render(
        "kernel.py.j2",
        k=k,
        sig=sig,
        gemm=k.gemm,
        scales=k.gemm.scales if k.gemm else None,
        nk=k.gemm is not None and k.gemm.b_layout is BLayout.NK,
        fp8_note=fp8_note(k),
        fp8_gemm_at=str(k.gemm.loc) if k.fp8_gemm else None,
        pointers=[f"_{n}_ptr" for n in sig.names],
        epilogue_tensors=epilogue_tensors,
        epilogue_pointers=epilogue_pointers,
        epilogue=emit_epilogue(k, types),
        others=others,
        even_n=any(t.width is Width.HALF for t in types.values()),
        regenerate=regenerate,
        fingerprint=fingerprint(k),
        tune_at_launch=tunes_at_launch(k),
        default_split=gpu_default_split(k),
    )


def fp8_note(k: Kernel) -> str:
    """What the module's docstring says of FP8 GEMM operands: their dtypes, and their K-group scales."""
    if not k.fp8_gemm:
        return ""
    a, b = (k.input(n).dtype.value for n in (k.gemm.a, k.gemm.b))
    note = f" from FP8 operands ({a})" if a == b else f" from FP8 operands ({a} by {b})"
    scales = k.gemm.scales
    if scales:
        note += (f", each K step's product times its K-group scales ({', '.join(scales.names)}: one per "
                 f"{scales.group} columns of K)")
    return note


def gpu_default_split(k: Kernel) -> int:
    """The epilogue split of the kernel's configuration on a GPU without a tuning table for it (the runtime's
    GPU_DEFAULT, 128x128 tiles over 8 warps): 4 where the epilogue loads a tile of pairs (2*N wide), which on
    the whole tile spills 1.8-2.0 KB per thread and on quarters none (swiglu_dgrad, swiglu_bias_dgrad,
    geglu_dgrad compiled for sm_90, benchmarks/results/sm90-spills.md); else the whole tile."""
    pairs = any(i.type is not None and i.type.kind is Kind.TILE and i.type.width is Width.DOUBLE for i in k.inputs)
    return 4 if k.gemm is not None and pairs else 1


def tunes_at_launch(k: Kernel) -> bool:
    """Whether the launcher may time candidate configs on the caller's own arguments (an untuned shape, once
    per process): each trial launch must overwrite every output (an inplace accumulation would be applied
    once per trial) and be repeatable from the tensors alone (host scalars are not among them)."""
    return not any(o.inplace for o in k.outputs) and not any(i.role is InputRole.HOST_SCALAR for i in k.inputs)
