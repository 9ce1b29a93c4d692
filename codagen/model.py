"""The typed spec model: frozen dataclasses and closed sets. Nothing after the loader sees a raw dict."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Location:
    file: str
    line: int  # 1-based
    col: int  # 1-based

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"


class Width(enum.Enum):
    """Column space of a tile value, relative to the GEMM's N: pairwise steps halve or double it."""

    HALF = "N/2"
    FULL = "N"
    DOUBLE = "2*N"

    @property
    def half(self) -> "Width | None":
        return {Width.FULL: Width.HALF, Width.DOUBLE: Width.FULL}.get(self)

    @property
    def double(self) -> "Width | None":
        return {Width.HALF: Width.FULL, Width.FULL: Width.DOUBLE}.get(self)


class Dim(enum.Enum):
    """A tensor dimension, symbolic in the GEMM sizes and the tile shape."""

    M = "M"
    K = "K"
    N_HALF = "N/2"
    N = "N"
    N_DOUBLE = "2*N"
    TILES_M = "tiles(M)"
    TILES_N = "tiles(N)"
    GROUPS_N = "groups(N)"  # N / column_group: one per column group of a kernel that declares column_group
    GROUPS_K = "groups(K)"  # K / gemm.scales.group: one per group of K (the K-group scales of FP8 operands)
    BLOCKS_N = "blocks(N)"  # N / gemm.scales.group rounded up: one per block of b's rows (a weight's block scales)

    @classmethod
    def for_width(cls, width: Width) -> "Dim":
        return {Width.HALF: cls.N_HALF, Width.FULL: cls.N, Width.DOUBLE: cls.N_DOUBLE}[width]

    @property
    def width(self) -> Width | None:
        return {Dim.N_HALF: Width.HALF, Dim.N: Width.FULL, Dim.N_DOUBLE: Width.DOUBLE}.get(self)


class DType(enum.Enum):
    T = "T"  # the kernel's floating type: the dtype of the GEMM's `a` (or of the first tile input)
    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    # FP8: outputs written from `quantize` values, and the GEMM's operands (docs/fp8.md)
    FLOAT8_E4M3FN = "float8_e4m3fn"
    FLOAT8_E5M2 = "float8_e5m2"
    INDEX = "index"  # int32 or int64


class Kind(enum.Enum):
    """Broadcast pattern of an epilogue value (CUTLASS EVT's operand kinds)."""

    TILE = "tile"  # one value per (row, column) of the tile
    ROW = "row"  # one per row: shape [M]
    COL = "col"  # one per column: shape [N*w]
    GROUP = "group"  # one per row and column group (column_group columns of width N): shape [M, groups(N)]
    SCALAR = "scalar"


@dataclass(frozen=True)
class ValueType:
    kind: Kind
    width: Width | None = None  # TILE and COL only

    def __str__(self) -> str:
        if self.kind is Kind.TILE:
            return f"tile [M, {self.width.value}]"
        if self.kind is Kind.COL:
            return f"column vector [{self.width.value}]"
        if self.kind is Kind.ROW:
            return "row vector [M]"
        if self.kind is Kind.GROUP:
            return "group value [M, groups(N)]"
        return "scalar"


class InputRole(enum.Enum):
    GEMM_A = "gemm_a"  # [M, K]
    GEMM_B = "gemm_b"  # [N, K] or [K, N]
    TENSOR = "tensor"  # loaded in the epilogue: tile, row, column or 0-d
    HOST_SCALAR = "host_scalar"  # a Python float passed by value
    GEMM_SCALE = "gemm_scale"  # a K-group scale of an FP8 operand (gemm.scales), read by the mainloop


@dataclass(frozen=True)
class Input:
    name: str
    dims: tuple[Dim, ...]
    dtype: DType
    role: InputRole
    loc: Location

    @property
    def type(self) -> ValueType | None:
        """The value type of the loaded input, or None for GEMM operands."""
        if self.role is InputRole.HOST_SCALAR or self.dims == ():
            return ValueType(Kind.SCALAR)
        return dims_type(self.dims)


@dataclass(frozen=True)
class Output:
    name: str
    dims: tuple[Dim, ...]
    dtype: DType
    inplace: bool  # passed in by the caller and updated (`accumulate`), not allocated
    loc: Location


class BLayout(enum.Enum):
    NK = "nk"  # b is [N, K]: acc = a @ b^T (nn.Linear weights)
    KN = "kn"  # b is [K, N]: acc = a @ b


@dataclass(frozen=True)
class GemmScales:
    """K-group (block-wise) scales of FP8 operands, applied by the mainloop at each K step (docs/fp8.md): `a` [M,
    groups(K)], one per row and group of K; `b` [blocks(N), groups(K)], one per group x group block of b [N, K].
    Either may be None (that operand's scales, per tensor or per row, are the epilogue's), not both."""

    a: str | None
    b: str | None
    group: int  # columns of K per scale (and rows of b per block): 128 in DeepSeek-V3's recipe
    loc: Location

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n in (self.a, self.b) if n)


@dataclass(frozen=True)
class Gemm:
    a: str
    b: str
    b_layout: BLayout
    loc: Location
    scales: GemmScales | None = None


@dataclass(frozen=True)
class Literal:
    value: float


@dataclass(frozen=True)
class Step:
    """One epilogue step. `args` maps the op's argument names to value names, literals or enum strings;
    `out` names the value it defines, `target` the output it writes (at most one of the two)."""

    op: str
    args: dict = field(hash=False)
    out: str | None
    target: str | None
    loc: Location
    arg_locs: dict = field(hash=False, compare=False, default_factory=dict)


@dataclass(frozen=True)
class Kernel:
    name: str
    doc: str
    gemm: Gemm | None
    inputs: tuple[Input, ...]
    outputs: tuple[Output, ...]
    steps: tuple[Step, ...]
    source: str  # the spec's path as given, relative where possible
    sha256: str
    loc: Location
    # the width of the column groups (heads) that group_reduce reduces over and groups(N) counts; None: none.
    # Every epilogue column slice (Config.epilogue_n) must hold whole groups. "N": one group, the whole row,
    # which one column slice must then span.
    column_group: int | str | None = None
    column_group_loc: Location | None = None

    @property
    def whole_rows(self) -> bool:
        """Whether group_reduce reduces whole rows (column_group N): its result is then a row vector."""
        return self.column_group == "N"

    def input(self, name: str) -> Input | None:
        return next((i for i in self.inputs if i.name == name), None)

    def output(self, name: str) -> Output | None:
        return next((o for o in self.outputs if o.name == name), None)

    @property
    def fp8_gemm(self) -> bool:
        """Whether the GEMM's operands are FP8 (declared so; the kernel then has no type T)."""
        a = self.input(self.gemm.a) if self.gemm else None
        return a is not None and a.dtype in (DType.FLOAT8_E4M3FN, DType.FLOAT8_E5M2)

    @property
    def k_group(self) -> int | None:
        """The K group of the GEMM's K-group scales (gemm.scales), or None where it has none."""
        return self.gemm.scales.group if self.gemm and self.gemm.scales else None

    @property
    def t_input(self) -> str | None:
        """The input whose dtype is the kernel's type T at a launch: the GEMM's `a`, else the first T matrix;
        none where the GEMM's operands are FP8 (every other tensor then declares its dtype)."""
        if self.gemm:
            return None if self.fp8_gemm else self.gemm.a
        return next((i.name for i in self.inputs
                     if i.dtype is DType.T and i.type is not None and i.type.kind is Kind.TILE), None)

    @property
    def tile_dependent(self) -> bool:
        """Whether an output's shape depends on the tile shape (partial reductions)."""
        return any(d in (Dim.TILES_M, Dim.TILES_N) for o in self.outputs for d in o.dims)


ACC = "acc"  # the GEMM accumulator, a reserved value name


def dims_type(dims: tuple[Dim, ...]) -> ValueType | None:
    """The value type that a tensor of these dims holds in the epilogue, or None."""
    if dims == (Dim.M, Dim.GROUPS_N):
        return ValueType(Kind.GROUP)
    if len(dims) == 2 and dims[0] is Dim.M and dims[1].width:
        return ValueType(Kind.TILE, dims[1].width)
    if dims == (Dim.M,):
        return ValueType(Kind.ROW)
    if len(dims) == 1 and dims[0].width:
        return ValueType(Kind.COL, dims[0].width)
    if dims == ():
        return ValueType(Kind.SCALAR)
    return None


def type_dims(t: ValueType) -> tuple[Dim, ...]:
    if t.kind is Kind.TILE:
        return (Dim.M, Dim.for_width(t.width))
    if t.kind is Kind.ROW:
        return (Dim.M,)
    if t.kind is Kind.GROUP:
        return (Dim.M, Dim.GROUPS_N)
    if t.kind is Kind.COL:
        return (Dim.for_width(t.width),)
    return ()
