"""The typed block model: a block spec as loaded (Block), and as checked (CheckedBlock: each step resolved
against its callee, every value typed, passes over row chunks laid out). blockspec.py builds the first,
blockcheck.py the second; emit/block.py prints the second."""
from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction

from .model import Location

IN_PLACE = "in_place"  # the key of a kernel call that writes outputs over values the call reads
SUMS = ("float32", "same")  # what gradients summed over row chunks are summed in: fp32, or their own dtype


@dataclass(frozen=True)
class BlockDim:
    """A block dimension: coef * symbol, the symbol an int attr, 'M' (tokens) or a tile count; or a constant.
    `rounded_up`: coef * symbol rounded up, a count of blocks (blocks(dim), coef 1/group: docs/fp8.md)."""

    coef: Fraction
    symbol: str | None
    rounded_up: bool = False

    def expr(self, times: str = "*", divide: str = "/") -> str:
        """As written in specs (2*ffn_dim, qkv_dim/2), or as Python with times=" * ", divide=" // "; a count
        rounded up as cdiv(dim, 128), or in Python -(-dim // 128)."""
        if self.symbol is None:
            return str(self.coef)
        num, den = self.coef.numerator, self.coef.denominator
        if self.rounded_up:
            whole = BlockDim(Fraction(num), self.symbol).expr(times, divide)
            return f"cdiv({whole}, {den})" if divide == "/" else f"-(-{whole}{divide}{den})"
        return (f"{num}{times}" if num != 1 else "") + self.symbol + (f"{divide}{den}" if den != 1 else "")

    def __str__(self) -> str:
        return self.expr()

    def scaled(self, f: Fraction) -> "BlockDim":
        if self.rounded_up:
            raise ValueError(f"{self} is rounded up: not a scale of {self.symbol}")
        return BlockDim(self.coef * f, self.symbol)


TOKENS = BlockDim(Fraction(1), "M")


@dataclass(frozen=True)
class Attr:
    name: str
    kind: str  # "int", "float", "choice"
    default: object
    choices: tuple[str, ...]
    loc: Location


@dataclass(frozen=True)
class BlockTensor:
    """A parameter, input or output of a block."""

    name: str
    dims: tuple[BlockDim, ...]
    dtype: str  # "T" or a dtype of model.DType ("float32", "bfloat16", "float8_e4m3fn", "index", ...)
    grad: bool
    alias: str | None  # an output that is an input passed through (its gradient flows back to that input)
    loc: Location


@dataclass(frozen=True)
class BlockStep:
    op: str  # a kernel name or a finish op
    args: dict  # argument (a callee input or output) -> value name, attr name or literal
    loc: Location
    arg_locs: dict = field(default_factory=dict, compare=False)
    in_place: dict = field(default_factory=dict)  # kernel output -> the value (an input of the call) it overwrites


@dataclass(frozen=True)
class GradForwardSpec:
    """`forward_with_grads`: the forward to run when gradients are wanted, in chunks of rows, which also
    makes the gradients of the block's one differentiable output, a scalar, as if that output's gradient were 1
    or `grad_scale` (`before` and `after` run on all rows, `chunk` on each chunk)."""

    rows: str | int  # rows per chunk: an int attr or a number
    sums: str | None  # 'float32', 'same' or a choice attr between them; None: float32
    grad_scale: str | None  # a [] value of `before`: the output gradient the gradients are made for; None: 1
    before: tuple[BlockStep, ...]
    chunk: tuple[BlockStep, ...]
    after: tuple[BlockStep, ...]
    loc: Location


@dataclass(frozen=True)
class Block:
    name: str
    doc: str
    attrs: tuple[Attr, ...]
    params: tuple[BlockTensor, ...]
    inputs: tuple[BlockTensor, ...]
    outputs: tuple[BlockTensor, ...]
    forward: tuple[BlockStep, ...]
    save: tuple[tuple[str, Location], ...]
    backward: tuple[BlockStep, ...]
    backward_row_chunks: str | int | None  # backward runs on chunks of rows of this many (an attr or a number)
    grad_forward: GradForwardSpec | None
    source: str
    sha256: str
    loc: Location
    group: int | None = None  # the FP8 scaling group that groups(dim) and blocks(dim) count

    def attr(self, name: str) -> Attr | None:
        return next((a for a in self.attrs if a.name == name), None)


@dataclass(frozen=True)
class Value:
    """The type of a block value."""

    dims: tuple[BlockDim, ...]
    dtype: str


@dataclass(frozen=True)
class Partial:
    """The type of a partial-reduction buffer: the float32 [rows, tiles(...)] that a kernel's
    `reduce: {op: ...}` writes, one value of the reduction `op` (sum, sumsq, max, logsumexp) per row and tile.
    Only a finish step that combines `op`'s partials may finish it (codagen/finish_steps: `combines`)."""

    op: str
    dims: tuple[BlockDim, ...]
    source: str = field(default="", compare=False)  # where it was made, for messages: "kernel 'k', output 'o'"

    @property
    def dtype(self) -> str:
        return "float32"


@dataclass(frozen=True)
class Arg:
    """One argument of a resolved step: the callee's parameter and what is passed, either a name in scope
    (a block value or an attr) or a literal."""

    param: str
    value: object
    is_name: bool


@dataclass(frozen=True)
class Accumulator:
    """matmul.accumulate: a kernel spec that adds a GEMM to a total, new = total + a @ b, which a weight gradient
    summed over row chunks calls with its output written over the total."""

    kernel: str
    inputs: tuple[tuple[str, str], ...]  # (input, what it gets: 'a', 'b', 'b.T' (b as [N, K]) or 'total')
    output: str  # its one output, written over the total


@dataclass(frozen=True)
class Call:
    """A resolved step: `op` applied to `args` (in the callee's order; optional ones the spec left out are
    absent), defining `outs` (block value names in the callee's output order; '_' discards)."""

    op: str
    kernel: bool
    args: tuple[Arg, ...]
    outs: tuple[str, ...]
    loc: Location
    in_place: tuple[tuple[str, str], ...] = ()  # (kernel output, value): the output is written over the value

    @property
    def kernels(self) -> tuple[str, ...]:
        """The kernels this step runs: its own, or the one its GEMM accumulates with (matmul.accumulate)."""
        return (self.op,) if self.kernel else tuple(a.value.kernel for a in self.args
                                                      if isinstance(a.value, Accumulator))


@dataclass(frozen=True)
class RowChunks:
    """Steps run over chunks of rows, so that at most one chunk's intermediate values exist at a time."""

    rows: Arg  # rows per chunk: an int attr or a number
    sliced: tuple[str, ...]  # values with the token dimension from before the loop, sliced per chunk
    concatenated: tuple[str, ...]  # what the loop makes with the token dimension for later: one piece per chunk
    summed: tuple[str, ...]  # the other gradients (parameters'): summed over chunks
    summed_by_gemm: tuple[str, ...]  # of `summed`, made by a plain GEMM no step reads: the GEMM accumulates
    dropped: tuple[str, ...]  # what a chunk makes, deleted before the next chunk makes its own
    sums: Arg  # what `summed` is summed in: 'float32', 'same' (the gradient's dtype) or a choice attr


@dataclass(frozen=True)
class GradForward:
    """The checked forward_with_grads: its calls and its loop over row chunks. It saves the gradients it makes
    (CheckedBlock.grads); the backward scales them by the output's gradient."""

    before: tuple[Call, ...]
    chunk: tuple[Call, ...]
    after: tuple[Call, ...]
    chunks: RowChunks
    output: str  # the differentiable output, a scalar: its gradient scales the saved gradients
    grad_scale: str | None  # the output gradient they were made for (a saved [] value); None: 1


@dataclass(frozen=True)
class CheckedBlock:
    block: Block
    forward: tuple[Call, ...]
    backward: tuple[Call, ...]
    values: dict  # name -> Value or Partial, forward and backward
    saved: tuple[str, ...]  # what the forward saves for the backward: the spec's save list, then the parameters
    grads: tuple[str, ...]  # what backward returns, in forward-argument order ('' for None)
    chunks: RowChunks | None  # set when the spec gives backward_row_chunks
    grad_forward: GradForward | None  # set when the spec gives forward_with_grads

    def passes(self) -> tuple[tuple[str, tuple[Call, ...], Arg | None], ...]:
        """(name, calls, rows per chunk or None) of every pass that runs kernels: the forward, and either the
        backward or the forward with gradients (its steps on all rows, then those on each chunk)."""
        if self.grad_forward is not None:
            g = self.grad_forward
            return (("forward", self.forward, None), ("forward with gradients", g.before + g.after, None),
                    ("forward with gradients", g.chunk, g.chunks.rows))
        return (("forward", self.forward, None),
                ("backward", self.backward, self.chunks.rows if self.chunks else None))
