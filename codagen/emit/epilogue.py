"""Epilogue steps -> Triton source lines. This module holds what every step shares (loads, masks, column
declarations, broadcasting, writes); each primitive's own lines come from its "tl" emitter in the registry
(codagen/primitives), which calls the methods below.

Every value in the epilogue is fp32 in registers. Inputs are loaded, masked, at their first use; the column
indices and masks of each width (N/2, N, 2*N) are declared once, before the first step that needs them.

A value 2*N wide (a tile or column vector of interleaved pairs, always loaded from memory) is held as two
values N wide, `<name>_even` and `<name>_odd`, so that pairwise steps take the two halves as they are. A tile
of pairs crosses memory whole, 2*BLOCK_N contiguous columns per row, and is split into its halves (joined, for
a store) in registers: loads and stores with a column stride of 2 spill less but move every byte in half-used
memory transactions (2.4x the time of swiglu_dgrad on the H200, measured). A column vector of pairs is loaded
as its two halves."""
from __future__ import annotations

from .. import dims
from ..model import DType, InputRole, Kernel, Kind, Literal, Step, ValueType, Width
from ..primitives import PRIMITIVES, step_text

HALVES = ("even", "odd")  # the two columns of each pair, in memory order
BLOCK = {Width.HALF: "BLOCK_N // 2", Width.FULL: "BLOCK_N"}
SIZE = {w: dims.python(w.value) for w in Width}  # a width's columns, as Python


class EpilogueEmitter:
    """The "tl" backend: Triton's language, with pointers and masks."""

    backend = "tl"
    lang = "tl"  # the language module, as generated code names it
    # The epilogue's own names start with '_', which no spec name can: the spec's inputs and values are the
    # function's other locals. (The Hopper emitter, GluonEpilogueEmitter, keeps names of its own.)
    own = "_"
    rows, cols, pid_m, pid_n, row_mask = "_rows", "_cols", "_pid_m", "_pid_n", "_row_mask"
    pair_cols = ("_even_cols", "_odd_cols")  # the columns of the even and odd halves of pairs, in 2*N

    def __init__(self, kernel: Kernel, types: dict[str, ValueType]):
        self.kernel = kernel
        self.types = types
        self.lines: list[str] = []
        self.loaded: set[str] = set()
        self.widths: set[Width] = set()
        self.tile_masks: set[Width] = set()
        self.joined: set[str] = set()  # tiles of pairs interleaved again for a store
        self.pair_tile_mask = False  # whether the columns and mask of tiles of pairs (2*BLOCK_N) are declared
        self.groups = False  # whether the column groups' indices and mask are declared
        self.t_outputs = set(t_tile_outputs(kernel))
        self.rounded_for_store = shared_roundings(kernel, types)
        self.stored_form: dict[str, str] = {}  # a value rounded to T with its store's tile: that tile's name

    # -- declarations -------------------------------------------------------------------------------------
    def need_width(self, w: Width, tile: bool = False) -> None:
        if w is Width.DOUBLE:  # pairs are masked by their index in N
            self.need_width(Width.FULL, tile)
            return
        if w not in self.widths:
            self.widths.add(w)
            if w is not Width.FULL:
                self.lines.append(f"{self.cols_of(w)} = {self.pid_n} * ({BLOCK[w]}) + tl.arange(0, {BLOCK[w]})")
            self.lines.append(f"{self.col_mask(w)} = {self.cols_of(w)} < {SIZE[w]}")
        if tile and w not in self.tile_masks:
            self.tile_masks.add(w)
            self.lines.append(f"{self.tile_mask(w)} = {self.row_mask}[:, None] & {self.col_mask(w)}[None, :]")

    def need_groups(self) -> None:
        """The indices and mask of the tile's column groups (of the kernel's column_group columns each)."""
        if not self.groups:
            self.groups = True
            g, o = self.kernel.column_group, self.own
            self.lines += [f"{o}cols_group = {self.pid_n} * (BLOCK_N // {g}) + tl.arange(0, BLOCK_N // {g})",
                           f"{o}col_mask_group = {o}cols_group < N // {g}",
                           f"{o}group_mask = {self.row_mask}[:, None] & {o}col_mask_group[None, :]"]

    def load(self, name: str) -> None:
        """Load an input at its first use, as fp32 (index inputs keep their integer type). Without a GEMM, a tile
        by pairs of elements (tile.widen); beside an accumulator, the compiler's conversion, which it makes after
        moving the tile into the accumulator's layout (compiled for sm_90: tile.widen before that move doubles
        what moves, and norm_dgrad's 128x256 tiles spill 2.2 KB a thread instead of 1 KB)."""
        inp = self.kernel.input(name)
        if inp is None or name in self.loaded or inp.role is InputRole.HOST_SCALAR:
            return
        self.loaded.add(name)
        t = inp.type
        cast = "" if inp.dtype is DType.INDEX else ".to(tl.float32)"
        widen = t.kind is Kind.TILE and self.kernel.gemm is None
        if t.width is Width.DOUBLE and t.kind is Kind.TILE:
            ptr, mask = self.pair_tile_ptr_mask(name)
            loaded = f"tl.load({ptr}, mask={mask}, other=0.0)"
            self.lines.append(f"{self.half(name, 'even')}, {self.half(name, 'odd')} = tile.split_pairs("
                              + (f"tile.widen({loaded}))" if widen else f"{loaded}{cast})"))
            return
        if t.width is Width.DOUBLE:
            for half in HALVES:
                ptr, mask, _ = self.tensor_ptr_mask(name, t, half)
                self.lines.append(f"{self.half(name, half)} = tl.load({ptr}, mask={mask}, other=0.0){cast}")
            return
        if t.kind is Kind.TILE:
            self.need_width(t.width, tile=True)
            ptr = self.tile_ptr(name, self.cols_of(t.width))
            mask = self.tile_mask(t.width)
        elif t.kind is Kind.ROW:
            ptr, mask = self.row_ptr(name), self.row_mask
        elif t.kind is Kind.GROUP:
            ptr, mask, _ = self.tensor_ptr_mask(name, t)
        elif t.kind is Kind.COL:
            self.need_width(t.width)
            ptr, mask = f"{self.ptr(name)} + {self.cols_of(t.width)} * {self.stride(name, 'n')}", self.col_mask(t.width)
        else:
            self.lines.append(f"{name} = tl.load({self.ptr(name)}){cast}")
            return
        if widen:
            self.lines.append(f"{name} = tile.widen(tl.load({ptr}, mask={mask}, other=0.0))")
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
        self.load(operand)
        inp = self.kernel.input(operand)
        text = f"{operand}.to(tl.float32)" if inp is not None and inp.dtype is DType.INDEX else operand
        return self.broadcast(text, self.types[operand], into)

    def halves(self, operand, into: ValueType | None = None) -> tuple[str, str]:
        """Source for an operand's even and odd halves; an operand that is not a pair is both."""
        if not self.is_pair(operand):
            return (self.ref(operand, into),) * 2
        self.load(operand)
        even, odd = (self.broadcast(self.half(operand, half), self.types[operand], into) for half in HALVES)
        return even, odd

    def broadcast(self, text: str, t: ValueType, into: ValueType | None) -> str:
        """Source for a value of type t where a value of type `into` is made (a row vector in a tile: [:, None])."""
        return _broadcast(text, t, into, self.kernel.column_group)

    # -- what primitives' emitters call (codagen/primitives) ---------------------------------------------
    def line(self, text: str) -> None:
        self.lines.append(text)

    def assign(self, step: Step, expr: str) -> None:
        self.lines.append(f"{step.out} = {expr}")

    def assign_pair(self, step: Step, expr: str) -> None:
        """out = expr, where expr gives the even and odd halves of a value of pairs."""
        self.lines.append(f"{self.half(step.out, 'even')}, {self.half(step.out, 'odd')} = {expr}")

    def elementwise(self, s: Step, template: str, operands: dict[str, object]) -> None:
        """out = template(operands); on a pair, once per half (the other operands broadcast to both)."""
        out = self.types[s.out]
        if not self.is_pair(s.out):
            self.assign(s, template.format(**{k: self.ref(v, out) for k, v in operands.items()}))
            return
        halves = {k: self.halves(v, out) for k, v in operands.items()}
        for i, half in enumerate(HALVES):
            self.lines.append(f"{self.half(s.out, half)} = " + template.format(**{k: h[i] for k, h in halves.items()}))

    def cast(self, s: Step) -> bool:
        """Emit a cast to T that a store shares (with the stored tile kept for it), unless the store before it
        emitted it already; False for a cast no store shares."""
        if not any(c is s for c in self.rounded_for_store.values()):
            return False
        if s.out in self.stored_form:
            self.lines[-1] += "  (rounded with the store above)"  # the step's header
        else:
            self.round_for_store(s)
        return True

    def round_for_store(self, s: Step) -> None:
        """The cast s of a tile to T, and that tile in T as its store takes it (`_<out>_as_t`): one conversion."""
        x, out, to = s.args["x"], s.out, self.t_dtype()
        as_t = f"{self.own}{out}_as_t"
        if self.is_pair(x):
            even, odd = self.halves(x)
            self.lines.append(f"{self.half(out, 'even')}, {self.half(out, 'odd')}, {as_t} = "
                              f"tile.round_pairs_for_store({even}, {odd}, {to})")
        else:
            self.lines.append(f"{out}, {as_t} = tile.round_for_store({self.ref(x)}, {to})")
        self.stored_form[out] = self.stored_form.setdefault(x, as_t)

    def stored_tile(self, x: str) -> str | None:
        """A tile stored to an output of type T, in T, where a cast to T shares its rounding (emitted here if
        the cast comes later); None for one the store converts itself."""
        cast = self.rounded_for_store.get(x)
        if cast is not None and cast.out not in self.stored_form:
            self.round_for_store(cast)
        return self.stored_form.get(x)

    def columns(self, x, w: Width) -> list[tuple[str, str]]:
        """(source, column indices) of each part of a value: its halves for a pair, else the value itself."""
        if self.is_pair(x):
            self.need_pair_columns()
            return list(zip(self.halves(x), self.pair_cols))
        return [(self.ref(x), self.cols_of(w))]

    def t_dtype(self) -> str:
        """T, the type of the kernel's matrix inputs at the launch, as generated code names it."""
        return f"{self.ptr(self.kernel.t_input)}.dtype.element_ty"

    # -- names ----------------------------------------------------------------------------------------------
    def ptr(self, name: str) -> str:
        """The pointer parameter of a tensor."""
        return f"{self.own}{name}_ptr"

    def stride(self, name: str, axis: str) -> str:
        """The stride parameter of a tensor along an axis (m, n, t: emit/kernel.AXIS)."""
        return f"{self.own}stride_{name}_{axis}"

    def half(self, name: str, half: str) -> str:
        """The even or odd half of a value of pairs."""
        return f"{self.own}{name}_{half}"

    def cols_of(self, w: Width) -> str:
        """The column indices of a width, N/2 or N."""
        return f"{self.own}cols_half" if w is Width.HALF else self.cols

    def col_mask(self, w: Width) -> str:
        """The mask of a width's columns; pairs (2*N) are masked by their index in N."""
        return f"{self.own}col_mask_half" if w is Width.HALF else f"{self.own}col_mask"

    def tile_mask(self, w: Width) -> str:
        return f"{self.own}tile_mask_half" if w is Width.HALF else f"{self.own}tile_mask"

    def tile_ptr(self, name: str, cols: str) -> str:
        """Pointers to a tile of a tensor, at the given column indices."""
        return (f"{self.ptr(name)} + {self.rows}[:, None] * {self.stride(name, 'm')} + {cols}[None, :] * "
                f"{self.stride(name, 'n')}")

    def row_ptr(self, name: str) -> str:
        """Pointers to a row vector (or a column of partials: add the tile's offset) at the tile's rows."""
        return f"{self.ptr(name)} + {self.rows} * {self.stride(name, 'm')}"

    @staticmethod
    def size(w: Width) -> str:
        """The number of columns of a width, in the kernel's sizes."""
        return SIZE[w]

    def tensor_ptr_mask(self, name: str, t: ValueType, half: str | None = None) -> tuple[str, str, str | None]:
        """Pointers, mask and the guard of a write (or a read: `load` uses it for pairs), for one `half` of
        a pair. Row and column vectors are written by one tile of each row (column) only. The guard is a
        scalar `if`, not `mask & (pid == 0)`: besides skipping the store, it avoids broadcasting a scalar
        bool, which Triton's interpreter (3.9) turns into an int32 mask."""
        if half:
            self.need_pair_columns()
        cols = self.pair_cols[HALVES.index(half)] if half else None
        if t.kind is Kind.TILE:
            self.need_width(t.width, tile=True)
            return self.tile_ptr(name, cols or self.cols_of(t.width)), self.tile_mask(t.width), None
        if t.kind is Kind.ROW:  # one copy per row: the first N-tile writes it
            return self.row_ptr(name), self.row_mask, f"{self.pid_n} == 0"
        if t.kind is Kind.GROUP:  # the groups of the tile's columns
            self.need_groups()
            return self.tile_ptr(name, f"{self.own}cols_group"), f"{self.own}group_mask", None
        self.need_width(t.width)  # one copy per column: the first M-tile writes it
        return (f"{self.ptr(name)} + {cols or self.cols_of(t.width)} * {self.stride(name, 'n')}",
                self.col_mask(t.width), f"{self.pid_m} == 0")

    def need_pair_columns(self) -> None:
        """The column indices of the even and odd halves of pairs, in 2*N."""
        if Width.DOUBLE not in self.widths:
            self.widths.add(Width.DOUBLE)
            even, odd = self.pair_cols
            self.lines += [f"{even} = 2 * {self.cols}", f"{odd} = {even} + 1"]

    def pair_tile_ptr_mask(self, name: str) -> tuple[str, str]:
        """Pointers and mask of a tile of pairs: its 2*BLOCK_N contiguous columns of each row."""
        if not self.pair_tile_mask:
            self.pair_tile_mask = True
            o = self.own
            self.lines += [f"{o}cols_double = {self.pid_n} * (2 * BLOCK_N) + tl.arange(0, 2 * BLOCK_N)",
                           f"{o}tile_mask_double = {self.row_mask}[:, None] & ({o}cols_double < 2 * N)[None, :]"]
        return self.tile_ptr(name, f"{self.own}cols_double"), f"{self.own}tile_mask_double"

    def guarded(self, guard: str | None, line: str) -> None:
        if guard is None:
            self.lines.append(line)
        else:
            self.lines += [f"if {guard}:", f"    {line}"]

    def write(self, s: Step, template: str, rounded: str | None = None) -> None:
        """A store or accumulate of the step's x into its target: `template` formatted with ptr, x and mask;
        `rounded`, the store of a tile that a cast to T rounded already (in T, pairs joined), where there is one."""
        x, t = s.args["x"], self.types[s.args["x"]]
        stored = self.stored_tile(x) if rounded and s.target in self.t_outputs else None
        if stored is not None:
            ptr, mask = (self.pair_tile_ptr_mask(s.target) if self.is_pair(x) else
                         self.tensor_ptr_mask(s.target, t)[:2])
            self.lines.append(rounded.format(ptr=ptr, x=stored, mask=mask))
            return
        if self.is_pair(x) and t.kind is Kind.TILE:  # interleaved again, under the value's own name
            ptr, mask = self.pair_tile_ptr_mask(s.target)
            if x not in self.joined:
                self.joined.add(x)
                self.lines.append("{} = tile.join_pairs({}, {})".format(x, *self.halves(x)))
            self.lines.append(template.format(ptr=ptr, x=x, mask=mask))
            return
        halves = self.halves(x) if self.is_pair(x) else (self.ref(x),)
        for value, half in zip(halves, HALVES if self.is_pair(x) else (None,)):
            ptr, mask, guard = self.tensor_ptr_mask(s.target, t, half)
            self.guarded(guard, template.format(ptr=ptr, x=value, mask=mask))

    # -- steps --------------------------------------------------------------------------------------------
    def emit(self, step: Step) -> None:
        emitter = PRIMITIVES[step.op].emitters.get(self.backend)
        if emitter is None:
            raise LookupError(f"{step.loc}: {step.op} has no {self.backend} emitter (primitives.unsupported_steps "
                              "lists such steps before a build)")
        self.lines.append(f"# {step_text(step)}")
        emitter(self, step)


def t_tile_outputs(k: Kernel) -> list[str]:
    """Outputs stored as tiles of type T, N/2, N or 2*N wide (by TMA in the Hopper kernel)."""
    stored = [s.target for s in k.steps if s.op == "store"]
    return [o.name for o in k.outputs if o.name in stored and o.dtype is DType.T and not o.inplace
            and len(o.dims) == 2 and o.dims[1].width in (Width.HALF, Width.FULL, Width.DOUBLE)]


def shared_roundings(k: Kernel, types: dict[str, ValueType]) -> dict[str, Step]:
    """Casts to T of tiles that a store to an output of type T also rounds, by the stored value: the cast's
    result itself (the logits: cast, then stored), or the value it casts (a gradient stored, then cast for a
    row dot, which must see what was stored). Such a cast and store convert once (emitted by whichever
    comes first); the stored tile is the cast's bits."""
    stored = {s.args["x"] for s in k.steps if s.op == "store" and s.target in t_tile_outputs(k)}
    shared = {}
    for s in k.steps:
        if s.op == "cast" and s.args["dtype"] == "T" and types[s.args["x"]].kind is Kind.TILE:
            for value in (s.out, s.args["x"]):
                if value in stored:
                    shared.setdefault(value, s)
    return shared


def _broadcast(text: str, t: ValueType, into: ValueType | None, group: int | None) -> str:
    if into is not None and into.kind is Kind.TILE:
        if t.kind is Kind.ROW:
            return f"{text}[:, None]"
        if t.kind is Kind.COL:
            return f"{text}[None, :]"
        if t.kind is Kind.GROUP:  # each group's value over its columns (half as many in an N/2-wide tile)
            return f"tile.expand_groups({text}, GROUP={dims.group_columns(group, into.width.value)})"
    if into is not None and into.kind is Kind.GROUP and t.kind is Kind.ROW:
        return f"{text}[:, None]"
    return text


def emit_epilogue(kernel: Kernel, types: dict[str, ValueType]) -> list[str]:
    """The epilogue's statements, one a line (the line breaker fits the rendered module to its width)."""
    e = EpilogueEmitter(kernel, types)
    e.lines.append(f"{e.row_mask} = {e.rows} < M")
    e.need_width(Width.FULL)
    for step in kernel.steps:
        e.emit(step)
    return e.lines
