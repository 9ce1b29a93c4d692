"""Epilogue steps -> Triton source lines, one emitter per primitive (a table, not an if-chain).

Every value in the epilogue is fp32 in registers. Inputs are loaded, masked, at their first use; the column
indices and masks of each width (N/2, N, 2*N) are declared once, before the first step that needs them.

A value 2*N wide (a tile or column vector of interleaved pairs, always loaded from memory) is held as two
values N wide, `<name>_even` and `<name>_odd`, loaded and stored with a column stride of 2: pairwise steps
then take the two halves as they are, where an interleaved tile would have to be shuffled apart in
registers (twice the spill, compiled for sm_90)."""
from __future__ import annotations

from ..model import DType, InputRole, Kernel, Kind, Literal, Step, ValueType, Width
from .. import ops

COLS = {Width.HALF: "cols_half", Width.FULL: "cols"}
HALVES = ("even", "odd")  # the two columns of each pair, in memory order
BLOCK = {Width.HALF: "BLOCK_N // 2", Width.FULL: "BLOCK_N"}
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
    """The mask of a width's columns; pairs (2*N) are masked by their index in N."""
    return "col_mask_half" if w is Width.HALF else "col_mask"


def tile_mask(w: Width) -> str:
    return "tile_mask_half" if w is Width.HALF else "tile_mask"


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
        if w is Width.DOUBLE:
            self._need_width(Width.FULL, tile)
            if w not in self.widths:
                self.widths.add(w)
                self.lines += ["cols_even = 2 * cols", "cols_odd = cols_even + 1"]
            return
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
        if t.width is Width.DOUBLE:
            self._need_width(t.width, tile=t.kind is Kind.TILE)
            for half in HALVES:
                ptr, mask, _ = self._tensor_ptr_mask(name, t, half)
                self.lines.append(f"{name}_{half} = tl.load({ptr}, mask={mask}, other=0.0){cast}")
            return
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

    def is_pair(self, operand) -> bool:
        return not isinstance(operand, Literal) and self.types[operand].width is Width.DOUBLE

    def ref(self, operand, into: ValueType | None = None) -> str:
        """Source for an operand, broadcast to `into` (a row vector becomes [:, None] in a tile)."""
        if isinstance(operand, Literal):
            return repr(operand.value)
        assert not self.is_pair(operand), f"{operand} is a pair: read it with halves()"
        self._load(operand)
        inp = self.k.input(operand)
        text = f"{operand}.to(tl.float32)" if inp is not None and inp.dtype is DType.INDEX else operand
        return _broadcast(text, self.types[operand], into)

    def halves(self, operand, into: ValueType | None = None) -> tuple[str, str]:
        """Source for an operand's even and odd halves; an operand that is not a pair is both."""
        if not self.is_pair(operand):
            return (self.ref(operand, into),) * 2
        self._load(operand)
        even, odd = (_broadcast(f"{operand}_{half}", self.types[operand], into) for half in HALVES)
        return even, odd

    # -- steps --------------------------------------------------------------------------------------------
    def emit(self, step: Step) -> None:
        self.lines.append(f"# {step.loc.file}:{step.loc.line}  {step.op}")
        _EMITTERS[_family(step.op)](self, step)

    def _assign(self, step: Step, expr: str) -> None:
        self.lines.append(f"{step.out} = {expr}")

    def _elementwise(self, s: Step, template: str, operands: dict[str, object]) -> None:
        """out = template(operands); on a pair, once per half (the other operands broadcast to both)."""
        out = self.types[s.out]
        if not self.is_pair(s.out):
            self._assign(s, template.format(**{k: self.ref(v, out) for k, v in operands.items()}))
            return
        halves = {k: self.halves(v, out) for k, v in operands.items()}
        for i, half in enumerate(HALVES):
            self.lines.append(f"{s.out}_{half} = " + template.format(**{k: h[i] for k, h in halves.items()}))

    def unary(self, s: Step) -> None:
        self._elementwise(s, UNARY[s.op], {"x": s.args["x"]})

    def cast(self, s: Step) -> None:
        # round to the narrower type and back: models where an unfused program would store that type
        dtype = s.args["dtype"]
        to = f"{self.k.t_input}_ptr.dtype.element_ty" if dtype == "T" else TL_DTYPES[dtype]
        self._elementwise(s, f"{{x}}.to({to}).to(tl.float32)", {"x": s.args["x"]})

    def binary(self, s: Step) -> None:
        self._elementwise(s, BINARY[s.op], {"x": s.args["x"], "y": s.args["y"]})

    def scale(self, s: Step) -> None:
        self._elementwise(s, "{x} * {by}", {"x": s.args["x"], "by": s.args["by"]})

    def gated(self, s: Step) -> None:
        x = s.args["x"]
        if self.is_pair(x):
            self._assign(s, f"tile.{s.op}_pairs({', '.join(self.halves(x))})")
        else:
            self._assign(s, f"tile.{s.op}({self.ref(x)})")

    def gated_bwd(self, s: Step) -> None:
        dy, x = self.ref(s.args["dy"]), s.args["x"]
        if self.is_pair(x):
            self.lines.append(f"{s.out}_even, {s.out}_odd = tile.{s.op}_pairs({dy}, {', '.join(self.halves(x))})")
        else:
            self._assign(s, f"tile.{s.op}({dy}, {self.ref(x)})")

    def rotary(self, s: Step) -> None:
        x = s.args["x"]
        xs = self.halves(x) if self.is_pair(x) else (self.ref(x),)
        pos, freqs = self.ref(s.args["positions"]), self.ref(s.args["freqs"])
        args = ", ".join((*xs, pos, freqs, f"INVERSE={s.op == 'rope_bwd'}"))
        if self.is_pair(x):
            self.lines.append(f"{s.out}_even, {s.out}_odd = tile.rope_pairs({args})")
        else:
            self._assign(s, f"tile.rope({args})")

    def reduce(self, s: Step) -> None:
        x, t = s.args["x"], self.types[s.args["x"]]
        self._need_width(t.width, tile=True)
        to, code, mask = s.target, REDUCE_CODE[s.args["op"]], tile_mask(t.width)
        if s.args["axis"] == "cols":
            # one partial per row and N-tile (or slice of one); a slice wholly past N, which the last tile
            # split for its epilogue can have, has no slot in tiles(N) and stores nothing
            ptr = f"{to}_ptr + rows * stride_{to}_m + pid_n * stride_{to}_t"
            if self.is_pair(x):
                partial = f"tile.partial_reduce_pairs({', '.join(self.halves(x))}, {mask}, OP={code})"
            else:
                partial = f"tile.partial_reduce({self.ref(x)}, {mask}, OP={code}, AXIS=1)"
            self._guarded("pid_n * BLOCK_N < N", f"tl.store({ptr}, {partial}, mask=row_mask)")
            return
        # one partial per column and M-tile
        for value, cols in self._columns(x, t.width):
            self.lines.append(f"tl.store({to}_ptr + {cols} * stride_{to}_n + pid_m * stride_{to}_t, "
                              f"tile.partial_reduce({value}, {mask}, OP={code}, AXIS=0), mask={col_mask(t.width)})")

    def _columns(self, x, w: Width) -> list[tuple[str, str]]:
        """(source, column indices) of each part of a value: its halves for a pair, else the value itself."""
        if self.is_pair(x):
            return list(zip(self.halves(x), (f"cols_{half}" for half in HALVES)))
        return [(self.ref(x), COLS[w])]

    def select(self, s: Step) -> None:
        x, w = s.args["x"], self.types[s.args["x"]].width
        self._need_width(w)
        index, to = s.args["index"], s.target
        parts = self._columns(x, w)
        self._load(index)
        for i, (value, cols) in enumerate(parts):
            # the first tile of a row stores its ignored indices' zeros, once
            first = "pid_n == 0" if i == 0 else "False"
            self.lines.append(f"tile.store_selected({to}_ptr + rows * stride_{to}_m, {value}, {cols}, "
                              f"{col_mask(w)}, {index}, {SIZE[w]}, row_mask, {first})")

    def one_hot(self, s: Step) -> None:
        index = s.args["index"]
        self._load(index)
        self._assign(s, f"tl.where(cols[None, :] == {index}[:, None], 1.0, 0.0)")

    def _tensor_ptr_mask(self, name: str, t: ValueType, half: str | None = None) -> tuple[str, str, str | None]:
        """Pointers, mask and the guard of a write (or a read: `_load` uses it for pairs), for one `half` of
        a pair. Row and column vectors are written by one tile of each row (column) only. The guard is a
        scalar `if`, not `mask & (pid == 0)`: besides skipping the store, it avoids broadcasting a scalar
        bool, which Triton's interpreter (3.9) turns into an int32 mask."""
        cols = f"cols_{half}" if half else COLS.get(t.width)
        if t.kind is Kind.TILE:
            self._need_width(t.width, tile=True)
            return (f"{name}_ptr + rows[:, None] * stride_{name}_m + {cols}[None, :] * stride_{name}_n",
                    tile_mask(t.width), None)
        if t.kind is Kind.ROW:  # one copy per row: the first N-tile writes it
            return f"{name}_ptr + rows * stride_{name}_m", "row_mask", "pid_n == 0"
        self._need_width(t.width)  # one copy per column: the first M-tile writes it
        return f"{name}_ptr + {cols} * stride_{name}_n", col_mask(t.width), "pid_m == 0"

    def _guarded(self, guard: str | None, line: str) -> None:
        if guard is None:
            self.lines.append(line)
        else:
            self.lines += [f"if {guard}:", f"    {line}"]

    def _write(self, s: Step, line: str) -> None:
        """A store or accumulate of the step's x into its target, `line` formatted with ptr, x and mask."""
        x, t = s.args["x"], self.types[s.args["x"]]
        halves = self.halves(x) if self.is_pair(x) else (self.ref(x),)
        for value, half in zip(halves, HALVES if self.is_pair(x) else (None,)):
            ptr, mask, guard = self._tensor_ptr_mask(s.target, t, half)
            self._guarded(guard, line.format(ptr=ptr, x=value, mask=mask))

    def store(self, s: Step) -> None:
        self._write(s, f"tl.store({{ptr}}, {{x}}.to({s.target}_ptr.dtype.element_ty), mask={{mask}})")

    def accumulate(self, s: Step) -> None:
        self._write(s, "tile.accumulate({ptr}, {x}, {mask})")


def _broadcast(text: str, t: ValueType, into: ValueType | None) -> str:
    if into is not None and into.kind is Kind.TILE:
        if t.kind is Kind.ROW:
            return f"{text}[:, None]"
        if t.kind is Kind.COL:
            return f"{text}[None, :]"
    return text


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

