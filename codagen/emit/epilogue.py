"""Epilogue steps -> Triton source lines, one emitter per primitive (a table, not an if-chain).

Every value in the epilogue is fp32 in registers. Inputs are loaded, masked, at their first use; the column
indices and masks of each width (N/2, N, 2*N) are declared once, before the first step that needs them."""
from __future__ import annotations

from ..model import DType, InputRole, Kernel, Kind, Literal, Step, ValueType, Width
from .. import ops

COLS = {Width.HALF: "cols_half", Width.FULL: "cols", Width.DOUBLE: "cols_double"}
BLOCK = {Width.HALF: "BLOCK_N // 2", Width.FULL: "BLOCK_N", Width.DOUBLE: "2 * BLOCK_N"}
SIZE = {Width.HALF: "N // 2", Width.FULL: "N", Width.DOUBLE: "2 * N"}
UNARY = {
    "silu": "tile.silu({x})", "sigmoid": "tl.sigmoid({x})", "gelu_tanh": "tile.gelu_tanh({x})",
    "tanh": "tile.tanh({x})", "relu": "tl.maximum({x}, 0.0)", "exp": "tl.exp({x})", "log": "tl.log({x})",
    "square": "{x} * {x}", "rsqrt": "tl.rsqrt({x})", "neg": "-{x}", "abs": "tl.abs({x})",
}
BINARY = {"add": "{x} + {y}", "sub": "{x} - {y}", "mul": "{x} * {y}", "div": "{x} / {y}",
          "maximum": "tl.maximum({x}, {y})", "minimum": "tl.minimum({x}, {y})"}
REDUCE_CODE = {"sum": 0, "sumsq": 1, "max": 2, "logsumexp": 3}
TL_DTYPES = {"float32": "tl.float32", "float16": "tl.float16", "bfloat16": "tl.bfloat16"}


def col_mask(w: Width) -> str:
    return {Width.HALF: "col_mask_half", Width.FULL: "col_mask", Width.DOUBLE: "col_mask_double"}[w]


def tile_mask(w: Width) -> str:
    return {Width.HALF: "tile_mask_half", Width.FULL: "tile_mask", Width.DOUBLE: "tile_mask_double"}[w]


class EpilogueEmitter:
    def __init__(self, kernel: Kernel, types: dict[str, ValueType]):
        self.k = kernel
        self.types = types
        self.lines: list[str] = []
        self.loaded: set[str] = set()
        self.widths: set[Width] = set()
        self.tile_masks: set[Width] = set()

    # -- declarations -------------------------------------------------------------------------------------
    def _need_width(self, w: Width, tile: bool = False) -> None:
        if w not in self.widths:
            self.widths.add(w)
            if w is not Width.FULL:
                self.lines.append(f"{COLS[w]} = pid_n * ({BLOCK[w]}) + tl.arange(0, {BLOCK[w]})")
            self.lines.append(f"{col_mask(w)} = {COLS[w]} < {SIZE[w]}")
        if tile and w not in self.tile_masks:
            self.tile_masks.add(w)
            self.lines.append(f"{tile_mask(w)} = row_mask[:, None] & {col_mask(w)}[None, :]")

    def _load(self, name: str) -> None:
        """Load an input at its first use, as fp32 (index inputs keep their integer type)."""
        inp = self.k.input(name)
        if inp is None or name in self.loaded or inp.role is InputRole.HOST_SCALAR:
            return
        self.loaded.add(name)
        t = inp.type
        cast = "" if inp.dtype is DType.INDEX else ".to(tl.float32)"
        if t.kind is Kind.TILE:
            self._need_width(t.width, tile=True)
            ptr = f"{name}_ptr + rows[:, None] * stride_{name}_m + {COLS[t.width]}[None, :] * stride_{name}_n"
            mask = tile_mask(t.width)
        elif t.kind is Kind.ROW:
            ptr, mask = f"{name}_ptr + rows * stride_{name}_m", "row_mask"
        elif t.kind is Kind.COL:
            self._need_width(t.width)
            ptr, mask = f"{name}_ptr + {COLS[t.width]} * stride_{name}_n", col_mask(t.width)
        else:
            self.lines.append(f"{name} = tl.load({name}_ptr){cast}")
            return
        other = "0" if inp.dtype is DType.INDEX else "0.0"
        self.lines.append(f"{name} = tl.load({ptr}, mask={mask}, other={other}){cast}")

    def ref(self, operand, into: ValueType | None = None) -> str:
        """Source for an operand, broadcast to `into` (a row vector becomes [:, None] in a tile)."""
        if isinstance(operand, Literal):
            return repr(operand.value)
        self._load(operand)
        text = operand
        inp = self.k.input(operand)
        if inp is not None and inp.dtype is DType.INDEX:
            text = f"{operand}.to(tl.float32)"
        t = self.types[operand]
        if into is not None and into.kind is Kind.TILE:
            if t.kind is Kind.ROW:
                return f"{text}[:, None]"
            if t.kind is Kind.COL:
                return f"{text}[None, :]"
        return text

    # -- steps --------------------------------------------------------------------------------------------
    def emit(self, step: Step) -> None:
        self.lines.append(f"# {step.loc.file}:{step.loc.line}  {step.op}")
        _EMITTERS[_family(step.op)](self, step)

    def _assign(self, step: Step, expr: str) -> None:
        self.lines.append(f"{step.out} = {expr}")

    def unary(self, s: Step) -> None:
        self._assign(s, UNARY[s.op].format(x=self.ref(s.args["x"])))

    def cast(self, s: Step) -> None:
        # round to the narrower type and back: models where an unfused program would store that type
        dtype = s.args["dtype"]
        to = f"{self.k.t_input}_ptr.dtype.element_ty" if dtype == "T" else TL_DTYPES[dtype]
        self._assign(s, f"{self.ref(s.args['x'])}.to({to}).to(tl.float32)")

    def binary(self, s: Step) -> None:
        out = self.types[s.out]
        self._assign(s, BINARY[s.op].format(x=self.ref(s.args["x"], out), y=self.ref(s.args["y"], out)))

    def scale(self, s: Step) -> None:
        out = self.types[s.out]
        self._assign(s, f"{self.ref(s.args['x'], out)} * {self.ref(s.args['by'], out)}")

    def gated(self, s: Step) -> None:
        self._assign(s, f"tile.{s.op}({self.ref(s.args['x'])})")

    def gated_bwd(self, s: Step) -> None:
        self._assign(s, f"tile.{s.op}({self.ref(s.args['dy'])}, {self.ref(s.args['x'])})")

    def rotary(self, s: Step) -> None:
        x, pos, freqs = (self.ref(s.args[a]) for a in ("x", "positions", "freqs"))
        inverse = "True" if s.op == "rope_bwd" else "False"
        self._assign(s, f"tile.rope({x}, {pos}, {freqs}, INVERSE={inverse})")

    def reduce(self, s: Step) -> None:
        t = self.types[s.args["x"]]
        self._need_width(t.width, tile=True)
        x, to, code = self.ref(s.args["x"]), s.target, REDUCE_CODE[s.args["op"]]
        # one partial per row and N-tile (or slice of one); a slice wholly past N, which the last tile split
        # for its epilogue can have, has no slot in tiles(N) and stores nothing
        guard = "pid_n * BLOCK_N < N"
        if s.args["axis"] == "cols":
            ptr, axis, mask = f"{to}_ptr + rows * stride_{to}_m + pid_n * stride_{to}_t", 1, "row_mask"
        else:  # one partial per column and M-tile
            w = t.width
            ptr, axis, mask, guard = (f"{to}_ptr + {COLS[w]} * stride_{to}_n + pid_m * stride_{to}_t", 0,
                                      col_mask(w), None)
        self._guarded(guard, f"tl.store({ptr}, tile.partial_reduce({x}, {tile_mask(t.width)}, OP={code}, "
                             f"AXIS={axis}), mask={mask})")

    def select(self, s: Step) -> None:
        w = self.types[s.args["x"]].width
        self._need_width(w)
        x, index, to = self.ref(s.args["x"]), s.args["index"], s.target
        self._load(index)
        self.lines.append(f"tile.store_selected({to}_ptr + rows * stride_{to}_m, {x}, {COLS[w]}, {col_mask(w)}, "
                          f"{index}, {SIZE[w]}, row_mask, pid_n == 0)")

    def one_hot(self, s: Step) -> None:
        index = s.args["index"]
        self._load(index)
        self._assign(s, f"tl.where(cols[None, :] == {index}[:, None], 1.0, 0.0)")

    def _tensor_ptr_mask(self, name: str, t: ValueType) -> tuple[str, str, str | None]:
        """Pointers, mask and the guard of a write: row and column vectors are written by one tile of each
        row (column) only. The guard is a scalar `if`, not `mask & (pid == 0)`: besides skipping the store,
        it avoids broadcasting a scalar bool, which Triton's interpreter (3.9) turns into an int32 mask."""
        if t.kind is Kind.TILE:
            self._need_width(t.width, tile=True)
            return (f"{name}_ptr + rows[:, None] * stride_{name}_m + {COLS[t.width]}[None, :] * stride_{name}_n",
                    tile_mask(t.width), None)
        if t.kind is Kind.ROW:  # one copy per row: the first N-tile writes it
            return f"{name}_ptr + rows * stride_{name}_m", "row_mask", "pid_n == 0"
        self._need_width(t.width)  # one copy per column: the first M-tile writes it
        return f"{name}_ptr + {COLS[t.width]} * stride_{name}_n", col_mask(t.width), "pid_m == 0"

    def _guarded(self, guard: str | None, line: str) -> None:
        if guard is None:
            self.lines.append(line)
        else:
            self.lines += [f"if {guard}:", f"    {line}"]

    def store(self, s: Step) -> None:
        t = self.types[s.args["x"]]
        x = self.ref(s.args["x"])
        ptr, mask, guard = self._tensor_ptr_mask(s.target, t)
        self._guarded(guard, f"tl.store({ptr}, {x}.to({s.target}_ptr.dtype.element_ty), mask={mask})")

    def accumulate(self, s: Step) -> None:
        t = self.types[s.args["x"]]
        x = self.ref(s.args["x"])
        ptr, mask, guard = self._tensor_ptr_mask(s.target, t)
        self._guarded(guard, f"tile.accumulate({ptr}, {x}, {mask})")


def _family(op: str) -> str:
    for family, names in (("unary", ops.UNARY), ("binary", ops.BINARY), ("gated", ops.GATED),
                          ("gated_bwd", ops.GATED_BWD), ("rotary", ops.ROTARY)):
        if op in names:
            return family
    return op


_EMITTERS = {name: getattr(EpilogueEmitter, name) for name in (
    "unary", "cast", "binary", "scale", "gated", "gated_bwd", "rotary", "reduce", "select", "one_hot", "store",
    "accumulate")}


def emit_epilogue(kernel: Kernel, types: dict[str, ValueType]) -> list[str]:
    e = EpilogueEmitter(kernel, types)
    e.lines.append("row_mask = rows < M")
    e._need_width(Width.FULL)
    for step in kernel.steps:
        e.emit(step)
    return e.lines

