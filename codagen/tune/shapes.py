"""The shapes to tune a kernel at: literal MxNxK, or a preset's, which the block specs give. A block spec
says which kernel each step calls with which values, and the values' dims are in the block's int attrs
(dim, ffn_dim, ...); a preset (codagen/presets.py) gives the attrs and, by its model family, which blocks run,
the token counts give M, and steps in row chunks (backward_row_chunks, forward_with_grads) run their kernels on
at most that many rows."""
from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

from .. import dims
from ..api import Checked
from ..blockmodel import Accumulator, Block, BlockDim, Call, CheckedBlock
from ..model import BLayout, Dim, DType, InputRole, Kernel
from ..presets import PRESETS, LlamaShape
from ..runtime.tables import shape_key
from . import TuneError

TOKENS = (8192, 32768)  # the token counts (M) that presets are tuned at by default


@dataclass(frozen=True)
class Shape:
    m: int
    n: int
    k: int  # 0: no GEMM
    a_km: bool = False  # the GEMM's a is M-contiguous (a [K, M] tensor's transpose), as the block passes it

    @property
    def key(self) -> str:
        """Its key in a tuning table."""
        return shape_key(self.m, self.n, self.k)

    def __str__(self) -> str:
        return f"{self.m}x{self.n}x{self.k}" if self.k else f"{self.m}x{self.n}"


@dataclass(frozen=True)
class Use:
    """A kernel at one shape, and the block step that runs it so."""

    kernel: str
    shape: Shape
    where: str  # e.g. "post_attention forward: y1 @ w_down^T"


def block_uses(specs, model: LlamaShape, tokens=TOKENS, *, family_only: bool = False, attrs=None) -> list[Use]:
    """Every kernel at every shape where the blocks among `specs` (api.load's result) run it for `model`, in
    block and step order, each with the first step that gives it: with family_only, only the blocks that
    `model`'s family runs (LlamaShape.runs_block: what tuning and the benchmark take), else every block (a
    Llama preset then gives every kernel its dims). A GEMM kernel that no block calls (a plain GEMM) gets every
    GEMM shape of the others: its mainloop alone at the shapes that matter. A shape counts once per kernel.
    `attrs` (parse_attrs) override the model's values and the specs' defaults, e.g. chunk_rows."""
    kernels = {c.kernel.name: c.kernel for c in specs if isinstance(c, Checked)}
    uses: dict[tuple[str, str], Use] = {}
    blocks = (c for c in specs if isinstance(c, CheckedBlock) and (model.runs_block(c.block.name) or not family_only))
    for cb in sorted(blocks, key=lambda c: c.block.name):
        values = _attr_values(cb.block, model, attrs or {})
        for pass_name, calls, chunk in cb.passes():
            chunk_rows = None if chunk is None else values[chunk.value] if chunk.is_name else chunk.value
            for call in (c for c in calls if c.kernel):
                kernel = kernels[call.op]
                where = f"{cb.block.name} {pass_name}: {_step_text(kernel, call)}"
                for t in tokens:
                    rows = min(t, chunk_rows) if chunk_rows else t
                    shape = _call_shape(kernel, call, cb, values, rows)
                    uses.setdefault((kernel.name, shape.key), Use(kernel.name, shape, where))
            for call, accumulator in _accumulated(calls):
                where = f"{cb.block.name} {pass_name}: {_matmul_text(call)} summed over chunks"
                for t in tokens:
                    rows = min(t, chunk_rows) if chunk_rows else t
                    shape = _matmul_shape(call, cb, values, rows)
                    uses.setdefault((accumulator.kernel, shape.key), Use(accumulator.kernel, shape, where))
    called = {name for cb in specs if isinstance(cb, CheckedBlock) for _, calls, _ in cb.passes()
              for call in calls for name in call.kernels}
    gemm_uses = [u for u in uses.values() if kernels[u.kernel].gemm]
    for kernel in sorted(kernels.values(), key=lambda k: k.name):
        if kernel.gemm and kernel.name not in called:
            for u in gemm_uses:
                uses.setdefault((kernel.name, u.shape.key), Use(kernel.name, u.shape, f"the GEMM of {u.where}"))
    return list(uses.values())


def _attr_values(block: Block, model: LlamaShape, attrs: dict) -> dict:
    """The block's attrs as `attrs` or else the model gives them (by name), else their defaults; required attrs
    the model lacks stay out, and are reported if a dimension needs them."""
    given = {**model.attrs(), **attrs}
    return {a.name: given.get(a.name, a.default) for a in block.attrs if a.name in given or a.default is not None}


def _size(d: BlockDim, attrs: dict, rows: int, block: Block) -> Fraction:
    if d.symbol is None:
        return d.coef
    if d.symbol == "M":
        return d.coef * rows
    if d.symbol not in attrs:
        raise TuneError(f"block '{block.name}' ({block.source}) has a dimension in its attr '{d.symbol}', which "
                        f"model presets do not give; they give {', '.join(_DIMENSIONS)}, qkv_dim, attn_dim "
                        "(codagen/presets.py)")
    return d.coef * attrs[d.symbol]


_DIMENSIONS = [f for f in LlamaShape.__dataclass_fields__ if f != "family"]


def _call_shape(kernel: Kernel, call: Call, cb: CheckedBlock, attrs: dict, rows: int) -> Shape:
    """M, N and K of one call of `kernel`, from the dims of the values it is given."""
    sizes: dict[str, Fraction] = {}
    for arg in call.args:
        inp = kernel.input(arg.param)
        if inp is None or inp.role is InputRole.HOST_SCALAR or not arg.is_name:
            continue
        for kd, bd in zip(inp.dims, cb.values[arg.value].dims):
            size = _size(bd, attrs, rows, cb.block)
            if kd in (Dim.M, Dim.K):
                sizes.setdefault(kd.value, size)
            elif kd.width is not None:
                sizes.setdefault("N", dims.base_size(kd.value, size))
    return Shape(int(sizes["M"]), int(sizes["N"]), int(sizes["K"]) if kernel.gemm else 0)


def _accumulated(calls) -> list[tuple[Call, Accumulator]]:
    """The matmul steps that name a kernel to accumulate with (matmul.accumulate), and that kernel."""
    return [(c, a.value) for c in calls for a in c.args if isinstance(a.value, Accumulator)]


def _matmul_operands(call: Call) -> tuple[str, str, str]:
    args = {a.param: a.value for a in call.args}
    return args["a"], args["b"], args.get("transpose", "none")


def _matmul_shape(call: Call, cb: CheckedBlock, attrs: dict, rows: int) -> Shape:
    """M, N and K of a matmul step: a [M, K] @ b [K, N], either transposed as the step says."""
    a, b, transpose = _matmul_operands(call)
    ad = [_size(d, attrs, rows, cb.block) for d in cb.values[a].dims]
    bd = [_size(d, attrs, rows, cb.block) for d in cb.values[b].dims]
    ad, bd = ad[::-1] if transpose == "a" else ad, bd[::-1] if transpose == "b" else bd
    return Shape(int(ad[0]), int(bd[1]), int(ad[1]), a_km=transpose == "a")


def _matmul_text(call: Call) -> str:
    a, b, transpose = _matmul_operands(call)
    return f"{a}{'^T' if transpose == 'a' else ''} @ {b}{'^T' if transpose == 'b' else ''}"


def _step_text(kernel: Kernel, call: Call) -> str:
    """A call as a reader recognizes it: its GEMM (y1 @ w_down^T), else the kernel and its tensors."""
    names = {a.param: a.value for a in call.args}
    if kernel.gemm:
        nk = "^T" if kernel.gemm.b_layout is BLayout.NK else ""
        return f"{names[kernel.gemm.a]} @ {names[kernel.gemm.b]}{nk}"
    tensors = [str(a.value) for a in call.args
               if a.is_name and kernel.input(a.param).role is not InputRole.HOST_SCALAR]
    return f"{kernel.name}({', '.join(tensors)})"


def preset_shapes(specs, preset: str, kernel: Kernel, tokens=TOKENS, attrs=None) -> list[Shape]:
    """The shapes of block_uses for `kernel` at a preset: none where only blocks of other model families call
    it (tuning all of specs/ at a Llama preset leaves Gemma-2's kernels alone)."""
    model = PRESETS[preset]
    shapes = [u.shape for u in block_uses(specs, model, tokens, family_only=True, attrs=attrs)
              if u.kernel == kernel.name]
    if not shapes and _called_by_other_families(specs, model, kernel):
        return []
    if not shapes:
        blocks = [c.block.name for c in specs if isinstance(c, CheckedBlock)]
        why = (f"no block among the specs given ({', '.join(blocks)}) calls it" if blocks else
               "the specs given hold no block spec (specs/blocks/) to take shapes from")
        raise TuneError(f"kernel '{kernel.name}' ({kernel.source}) has no shapes at preset {preset}: {why}; pass "
                        "the block specs along, or literal shapes (--shapes MxNxK)")
    return shapes


def _called_by_other_families(specs, model: LlamaShape, kernel: Kernel) -> bool:
    return any(kernel.name in call.kernels
               for cb in specs if isinstance(cb, CheckedBlock) and not model.runs_block(cb.block.name)
               for _, calls, _ in cb.passes() for call in calls)


# ASCII digits: \d and int() take '²' and other scripts' digits too. Ten at most: no dimension has more
_LITERAL = re.compile(r"([0-9]{1,10})x([0-9]{1,10})(?:x([0-9]{1,10}))?")
_POSITIVE = re.compile(r"[0-9]{1,10}")


# The most bytes the operands of one tuned shape may take: 128 GiB, more than any GPU codagen tunes on holds
# beside the run's other buffers (an H200 has 141 GB). The run on a GPU bounds them by its memory too. A larger
# shape is a typo or a unit mistake (10 digits a dimension pass the parser): refused as it enters, not an
# allocation failure in the middle of a run.
MAX_SHAPE_BYTES = 2**37
_MIN_TILE = 16  # the smallest tile of any configuration: tiles(M) and tiles(N) are at most M/16 and N/16
_BYTES = {DType.T: 2, DType.FLOAT32: 4, DType.FLOAT16: 2, DType.BFLOAT16: 2, DType.FLOAT8_E4M3FN: 1,
          DType.FLOAT8_E5M2: 1, DType.INDEX: 8}  # T: bf16, as tuned


def operand_elements(kernel: Kernel, shape: Shape) -> dict[str, tuple[int, int]]:
    """Each input and output of `kernel` at `shape`: (elements, bytes), tile counts at their largest, T as the
    bf16 that codagen tune times."""
    m, n, k = shape.m, shape.n, shape.k
    group = kernel.column_group if isinstance(kernel.column_group, int) else n
    sizes = {"M": m, "N": n, "K": k}
    size = {d: dims.size(d.value, sizes, (_MIN_TILE, _MIN_TILE), max(group, 1)) for d in Dim}
    size[Dim.GROUPS_N] = max(size[Dim.GROUPS_N], 1)
    counts = {}
    for decl in (*kernel.inputs, *kernel.outputs):
        count = 1
        for d in decl.dims:
            count *= size[d]
        counts[decl.name] = (count, count * _BYTES[decl.dtype])
    return counts


def check_shape(shape: Shape, kernel: Kernel, given: str, memory: int | None = None) -> None:
    """Refuse a shape `kernel` cannot run or the tuner cannot allocate, naming the argument it came from
    (`given`, e.g. "--shapes '8192x100x64'"), the kernel and the value: an N that is no multiple of the kernel's
    column_group (its tiles hold whole column groups); a K that is no multiple of the K group of its K-group scales;
    operands of more than MAX_SHAPE_BYTES bytes together, or than `memory` (the GPU's) where given."""
    group = kernel.column_group
    if isinstance(group, int) and shape.n % group:
        raise TuneError(f"{given}: N = {shape.n} (shape {shape}) is no multiple of kernel '{kernel.name}''s "
                        f"column_group {group} ({kernel.source}): its tiles hold whole column groups")
    if kernel.k_group and shape.k % kernel.k_group:
        raise TuneError(f"{given}: K = {shape.k} (shape {shape}) is no multiple of kernel '{kernel.name}''s K group "
                        f"{kernel.k_group} (gemm.scales, {kernel.source}): its scales are of whole groups of K")
    operands = operand_elements(kernel, shape)
    total = sum(b for _, b in operands.values())
    bound, what = min((MAX_SHAPE_BYTES, f"{MAX_SHAPE_BYTES >> 30} GiB"),
                      (memory or MAX_SHAPE_BYTES, f"the GPU's {(memory or 0) / 2**30:.1f} GiB"))
    if total > bound:
        name, (count, _) = max(operands.items(), key=lambda item: item[1][1])
        raise TuneError(f"{given}: shape {shape} makes kernel '{kernel.name}''s operands {total / 2**30:.1f} GiB "
                        f"in bf16 ('{name}' alone {count} elements), over {what}: no run can allocate them")


def parse_shapes(text: str, kernel: Kernel, specs=(), tokens=TOKENS, attrs=None, memory: int | None = None
                 ) -> list[Shape]:
    """`--shapes`: comma-separated presets and literal MxNxK (MxN for kernels without a GEMM); a literal
    applies to every kernel (K is dropped for those without a GEMM), a preset to the kernels its family's
    blocks call, with `attrs` (parse_attrs) for their attrs. A shape counts once. Each shape is checked
    (check_shape): sizes 0, N no multiple of the kernel's column_group and operands too large for MAX_SHAPE_BYTES
    (or `memory`, the GPU's) are refused."""
    shapes: dict[str, Shape] = {}
    for item in (s.strip() for s in text.split(",")):
        if item in PRESETS:
            found = preset_shapes(specs, item, kernel, tokens, attrs)
            given = f"--shapes {item!r} (at --tokens {','.join(map(str, tokens))})"
        elif (match := _LITERAL.fullmatch(item)) is not None:
            m, n, k = (int(g or 0) for g in match.groups())
            if m < 1 or n < 1 or (kernel.gemm and k < 1):
                raise TuneError(f"--shapes {item!r}: M, N and K must be positive (kernel '{kernel.name}' has "
                                f"{'a' if kernel.gemm else 'no'} GEMM)")
            found = [Shape(m, n, k if kernel.gemm else 0)]
            given = f"--shapes {item!r}"
        else:
            raise TuneError(f"--shapes: {item!r} is neither a preset ({', '.join(PRESETS)}) nor MxNxK, "
                            "e.g. 8192x2048x2048")
        for s in found:
            check_shape(s, kernel, given, memory)
            shapes.setdefault(s.key, s)
    return list(shapes.values())


def parse_attrs(text: str, specs) -> dict[str, int]:
    """`--attrs`: comma-separated NAME=VALUE, each an int attr of a block among `specs` and a positive int,
    e.g. chunk_rows=1024 to tune the LM heads' kernels at chunks of that many rows."""
    known = sorted({a.name for cb in specs if isinstance(cb, CheckedBlock) for a in cb.block.attrs if a.kind == "int"})
    attrs = {}
    for item in (s.strip() for s in text.split(",")):
        name, _, value = item.partition("=")
        if name not in known:
            raise TuneError(f"--attrs: {name!r} is no int attr of the block specs given"
                            f"{' (' + ', '.join(known) + ')' if known else ''}")
        if not _POSITIVE.fullmatch(value) or int(value) < 1:  # str.isdigit takes '²', which int() refuses
            raise TuneError(f"--attrs: {item!r}: expected {name}=N with N a positive integer")
        attrs[name] = int(value)
    return attrs


def parse_tokens(text: str) -> tuple[int, ...]:
    items = [t.strip() for t in text.split(",")]
    tokens = tuple(int(t) for t in items) if all(_POSITIVE.fullmatch(t) for t in items) else ()
    if not tokens or min(tokens) < 1:
        raise TuneError(f"--tokens {text!r}: expected positive integers separated by commas, e.g. 8192,32768")
    return tokens
