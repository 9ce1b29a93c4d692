"""A checked kernel -> the source of its Hopper module (generated/kernels/gluon/<name>.py): a persistent,
warp-specialized Gluon kernel (codagen/runtime/gluon_hopper.py describes the schedule) and its launcher.

The epilogue is the spec's steps, lowered as for the tl kernel except that

- tile inputs of type T arrive by TMA into shared memory while the tile's mainloop runs, and are read from
  there into the accumulator's register layout when the epilogue starts; a tile of pairs (2*N columns, such
  as the saved (gate, up) pre-activations of a gated activation's backward) crosses whole, 2*BLOCK_N
  columns, into a buffer twice as wide, and is read as its even and odd columns, each in the accumulator's
  layout (`hopper.load_pairs`);
- stores of tiles of type T go through shared memory with TMA (`hopper.store_tile`); a tile of pairs is
  interleaved again in registers and leaves whole; a tile narrower than the buffer (a gated activation
  (SwiGLU, GeGLU) of the accumulator's pairs split in registers, N/2 wide; a tile N wide where the buffers
  hold pairs) goes through the first part of a buffer's memory (`hopper.store_narrow_tile`); with direct
  stores (a constexpr of the kernel), every such tile leaves from registers instead (`hopper.store_direct`),
  and the buffers hold the tile inputs alone; a rotation
  (RoPE) of the accumulator's pairs takes its per-pair frequencies loaded once per column, in the
  accumulator's column layout;
- a row vector ([M]) is loaded by the consumer once per tile, while the tile's mainloop runs, and reaches the
  epilogue of each column slice as a value;
- a cast to T names T by the GEMM operand's descriptor (the tl text names it by a pointer), and a cast of a
  tile, like the reads of tile inputs, converts bf16 by pairs of elements (`tile.round_to`, `tile.widen`);
- a group value (one per row and column group, [M, groups(N)]) is held over its group's columns, a tile in
  the accumulator's layout (`hopper.group_reduce`): steps on it are the tl text on a tile, it meets a tile as
  it is, the first column of each group stores it, and every column loads its group's.

Each primitive the backend lowers has a "gluon" entry in the registry's `emitters` (codagen/primitives): most
are its "tl" text, since Triton's builtins, called from a @gluon.jit function, run with Gluon's semantics, and
element-wise arithmetic, reductions, masked loads and stores of row and column vectors all take their layouts
from `rows` and `cols`, which the kernel creates in slices of the accumulator's layout. What needs a layout of
its own (tl.arange, tl.full, tl.zeros_like) does not compile there; the emitter below provides what differs.

What cannot be lowered yet (`unlowered`: a primitive without a "gluon" emitter, or an operand the emitter has
no layout or TMA path for) keeps the kernel on the tl path alone; the build says which step and why, and the
package's docstring lists it."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from .. import dims
from ..model import DType, InputRole, Kernel, Kind, Step, ValueType, Width
from ..primitives import step_text, unsupported_steps
from .epilogue import EpilogueEmitter, t_tile_outputs
from .launch import LaunchSignature
from .layout import layout
from .templates import render

DEFAULT_BLOCK_N = 128  # the Hopper kernels' default tile width (codagen/runtime/gluon_hopper.py, HopperConfig)
GATED = ("swiglu", "geglu")  # pairwise steps on the accumulator's pairs that the Hopper backend lowers
ROTARY = ("rope", "rope_bwd")  # and rotations of them, whose per-pair frequencies it loads per column

@dataclass(frozen=True)
class Fallback:
    """A kernel that keeps the tl path only, and why: the step (None: the kernel as a whole)."""

    kernel: Kernel
    step: Step | None
    reason: str

    def __str__(self) -> str:
        if self.step is None:
            return f"{self.kernel.loc}: {self.kernel.name}: {self.reason}; it keeps the tl kernel only"
        return (f"{self.step.loc}: {step_text(self.step)}: {self.reason}; {self.kernel.name} keeps the tl "
                "kernel only")


def tma_inputs(k: Kernel) -> list[str]:
    """Tile inputs of type T, N wide or tiles of pairs (2*N): loaded by TMA into the epilogue's buffers."""
    return [i.name for i in k.inputs if i.role is InputRole.TENSOR and i.dtype is DType.T
            and i.type.kind is Kind.TILE and i.type.width in (Width.FULL, Width.DOUBLE)]


def tma_outputs(k: Kernel) -> list[str]:
    """Outputs stored as tiles of type T: written by TMA from the epilogue's buffers."""
    return t_tile_outputs(k)


def row_inputs(k: Kernel) -> list[str]:
    """Row vectors ([M]) the epilogue reads: loaded by the consumer once per tile, while its mainloop runs, and
    passed to the epilogue of each slice as values (not reloaded and waited for slice by slice)."""
    return [i.name for i in k.inputs if i.role is InputRole.TENSOR and i.type.kind is Kind.ROW]


def tile_width(k: Kernel, name: str) -> Width:
    """The width of a TMA tensor's tiles: N/2 (a gated activation's output), N, or 2*N (pairs)."""
    inp = k.input(name)
    return inp.type.width if inp is not None else k.output(name).dims[1].width


def buffer_width(k: Kernel) -> Width:
    """The width of the epilogue's buffers: 2*N where a tile of pairs crosses by TMA, else N."""
    doubles = any(tile_width(k, n) is Width.DOUBLE for n in (*tma_inputs(k), *tma_outputs(k)))
    return Width.DOUBLE if doubles else Width.FULL


def buffer_columns(k: Kernel) -> int:
    """The width of the epilogue's buffers in BLOCK_N."""
    return 2 if buffer_width(k) is Width.DOUBLE else 1


# a TMA tensor's block by its tiles' width (one epilogue slice's), as the launcher writes it
BLOCKS = {Width.HALF: "[config.block_m, slice_n // 2]", Width.FULL: "[config.block_m, slice_n]",
          Width.DOUBLE: "[config.block_m, 2 * slice_n]"}
# the column of a slice's first element, as the epilogue writes it (pid_n and BLOCK_N are the slice's there)
FIRST_COLUMN = {Width.HALF: "pid_n * (BLOCK_N // 2)", Width.FULL: "pid_n * BLOCK_N",
                Width.DOUBLE: "pid_n * (2 * BLOCK_N)"}
# the columns of a tensor of tiles of that width
COLUMNS = {w: dims.python(w.value) for w in Width}
# ... and as the consumer writes it, for TMA loads
SLICE_COLUMN = {Width.HALF: "slice_n * (SLICE_N // 2)", Width.FULL: "slice_n * SLICE_N",
                Width.DOUBLE: "slice_n * (2 * SLICE_N)"}


# The names the Hopper modules use for themselves, unprefixed (unlike the tl kernel's, which start with '_'),
# and the forms of the names they make from a spec name x (x_ptr, x_desc, stride_x_m, ...): a kernel whose
# spec names meet them keeps the tl kernel (`unlowered`)
HOPPER_NAMES = frozenset("""
    tl triton torch runtime tile gluon gl hopper mbarrier fence_async_shared tma acc pid_m pid_n rows cols
    cols_half cols_even cols_odd cols_double row_mask col_mask col_mask_half tile_mask tile_mask_half
    tile_mask_double cols_group col_mask_group group_mask config device out tensors key plan values sizes
    t_dtype mainloop ready buffers epilogue_buffers inputs_ready slice_n acc_slice first_buffer
    slot k_steps step tile_count tile_id i step_start in_step early_part part first_row num_pid_m num_pid_n
    launch check_launch
""".split())
HOPPER_SUFFIXES = ("_ptr", "_ptrs", "_desc", "_even", "_odd", "_of_columns", "_as_t")
HOPPER_PREFIXES = ("stride_", "offs_")


def _hopper_name_clashes(k: Kernel) -> list[str]:
    """The spec names of a kernel that the Hopper module would use for something else."""
    names = [*(i.name for i in k.inputs), *(o.name for o in k.outputs), *(s.out for s in k.steps if s.out)]
    return sorted({n for n in names if n in HOPPER_NAMES or n.endswith(HOPPER_SUFFIXES)
                   or n.startswith(HOPPER_PREFIXES)})


def unlowered(k: Kernel, types: dict[str, ValueType]) -> list[Fallback]:
    """Why the Hopper backend cannot lower this kernel yet: every step it cannot, or the kernel itself."""
    if k.gemm is None:
        return [Fallback(k, None, "no GEMM; the Hopper backend schedules GEMM mainloops only")]
    clashes = _hopper_name_clashes(k)
    if clashes:
        return [Fallback(k, None, f"the Hopper module uses {', '.join(repr(n) for n in clashes)} for names of its "
                                  "own (x_ptr, x_desc, stride_x_m, ... of a tensor x among them); rename to lower it")]
    if k.fp8_gemm:
        return [Fallback(k, None, f"FP8 GEMM operands ({k.input(k.gemm.a).dtype.value} '{k.gemm.a}'); the Hopper "
                                  "kernel's mainloop takes bfloat16 or float16, and the tl kernel's runs FP8")]
    if k.whole_rows:
        return [Fallback(k, None, "column_group N (a tile as wide as the row); the Hopper kernels' tiles are "
                                  "128 columns wide")]
    missing = unsupported_steps(k, GluonEpilogueEmitter.backend)
    found = []
    for s in k.steps:
        reason = f"no Gluon lowering of '{s.op}' yet" if any(s is m for m in missing) else _beyond_emitter(k, types, s)
        if reason:
            found.append(Fallback(k, s, reason))
    return found


def _beyond_emitter(k: Kernel, types: dict[str, ValueType], s: Step) -> str | None:
    """Why the emitter cannot place a step's operands (a layout or TMA path it lacks), if it cannot."""
    if s.op == "store" and types[s.args["x"]].kind is Kind.TILE and s.target not in tma_outputs(k):
        return "only tiles of type T are stored, through TMA"
    operands = [v for v in s.args.values() if isinstance(v, str) and v in types] + ([s.out] if s.out else [])
    # a value N/2 wide lies in the layout that splitting the pairs gives; only a TMA store takes it as it is
    halves = [v for v in operands if types[v].width is Width.HALF]
    if s.op in ROTARY and halves == [s.args["freqs"]]:
        if k.input(s.args["freqs"]) is None:
            return "the frequencies of a rotation are loaded by column in Gluon: an input only"
        halves = []
    if halves and not (s.op == "store" or (s.op in GATED and halves == [s.out])):
        return "a value N/2 wide is only stored by the Hopper backend yet (no other step takes its layout)"
    for v in operands:
        inp = k.input(v)
        if inp is not None and inp.type.kind is Kind.TILE and v not in tma_inputs(k):
            return f"tile input '{v}' is not of type T; only those are loaded, through TMA"
    return None


class GluonEpilogueEmitter(EpilogueEmitter):
    """The epilogue in a Gluon kernel: TMA for tile inputs and tile stores, the registry's tl text for the
    rest (see the module's docstring)."""

    backend = "gluon"
    # the Hopper module's names, unprefixed: a kernel whose spec names meet them keeps the tl kernel (unlowered)
    own = ""
    rows, cols, pid_m, pid_n, row_mask = "rows", "cols", "pid_m", "pid_n", "row_mask"
    pair_cols = ("cols_even", "cols_odd")

    def __init__(self, kernel: Kernel, types: dict[str, ValueType], buffers: int):
        super().__init__(kernel, types)
        self.tma_inputs = tma_inputs(kernel)
        self.tma_outputs = tma_outputs(kernel)
        self.row_inputs = row_inputs(kernel)
        self.buffers = buffers
        self.stores = 0  # TMA stores emitted so far

    def load(self, name: str) -> None:
        if name in self.tma_inputs or name in self.row_inputs:  # read by the consumer before the epilogue
            self.loaded.add(name)
            return
        inp = self.kernel.input(name)
        if inp is not None and inp.type.kind is Kind.GROUP and name not in self.loaded:
            # held over its groups' columns, in the accumulator's layout: each column loads its group's value
            self.loaded.add(name)
            self.need_width(Width.FULL, tile=True)
            self.lines.append(f"{name} = tl.load({self.group_ptr(name)}, mask=tile_mask, other=0.0).to(tl.float32)")
            return
        super().load(name)

    def group_ptr(self, name: str) -> str:
        """Pointers to a group value's element of each column of the tile: its group's."""
        return f"{name}_ptr + rows[:, None] * stride_{name}_m + (cols // {self.kernel.column_group})[None, :] * " \
               f"stride_{name}_n"

    def broadcast(self, text: str, t: ValueType, into: ValueType | None) -> str:
        if t.kind is Kind.GROUP and into is not None and into.kind is Kind.TILE:
            return text  # held over its groups' columns already
        return super().broadcast(text, t, into)

    def tensor_ptr_mask(self, name: str, t: ValueType, half: str | None = None) -> tuple[str, str, str | None]:
        if t.kind is not Kind.GROUP:
            return super().tensor_ptr_mask(name, t, half)
        # a write of a group value, held over its groups' columns: the first column of each group writes it
        self.need_width(Width.FULL, tile=True)
        return self.group_ptr(name), f"tile_mask & (cols % {self.kernel.column_group} == 0)[None, :]", None

    def store_tile(self, s: Step) -> None:
        """A tile of type T (N/2, N or 2*N wide), stored to its output through shared memory by TMA, or, with
        direct stores, from registers."""
        # buffers in turn; a buffer is rewritten once the store that last read it is done, which leaves the
        # other buffers' stores in flight. Several buffers come only with as many tile inputs, and then each
        # tile starts with every store done (before its inputs' TMA loads): as each column slice has buffers of
        # its own, a buffer's first store in the slice waits for none
        buffer = self.stores % self.buffers
        pending = None if self.tma_inputs and self.stores < self.buffers else self.buffers - 1
        self.stores += 1
        x, width = s.args["x"], tile_width(self.kernel, s.target)
        value = self.stored_tile(x)
        if value is None:
            value = "tile.join_pairs({}, {})".format(*self.halves(x)) if self.is_pair(x) else self.ref(x)
        # a tile narrower than the buffer goes through the first part of its memory
        store = "store_tile" if width is buffer_width(self.kernel) else "store_narrow_tile"
        out = s.target
        self.lines += ["if DIRECT_STORES:",
                       f"    hopper.store_direct({out}_ptr, stride_{out}_m, stride_{out}_n, {value}, pid_m * BLOCK_M, "
                       f"{FIRST_COLUMN[width]}, M, {COLUMNS[width]})",
                       "else:",
                       f"    hopper.{store}({out}_desc, buffers[{buffer}], {value}, pid_m * BLOCK_M, "
                       f"{FIRST_COLUMN[width]}, PENDING={pending})"]

    def column_frequencies(self, name: str) -> str:
        """A vector of per-pair values (N/2) loaded once per column of the tile, in the accumulator's column
        layout: both columns of a pair read its value."""
        if f"{name}_of_columns" not in self.loaded:
            self.loaded.add(f"{name}_of_columns")
            self.lines.append(f"{name}_of_columns = tl.load({name}_ptr + (cols // 2) * stride_{name}_n, "
                              "mask=col_mask, other=0.0).to(tl.float32)")
        return f"{name}_of_columns"

    def t_dtype(self) -> str:
        # the tl text names T by an input's pointer; here the GEMM operand's TMA descriptor names it
        return f"{self.kernel.gemm.a}_desc.dtype"


def epilogue_buffers(k: Kernel) -> int:
    """Shared-memory tiles per consumer and epilogue stage: one per tile input (all read before the first
    store), at least one where tiles are stored by TMA, none where nothing crosses by TMA. One store waits for
    the last to have read the buffer; a second buffer would let it run on but costs an operand stage at
    128x128 tiles, which the mainloop needs more (measured on the H200)."""
    return max(len(tma_inputs(k)), 1 if tma_outputs(k) else 0)


def default_split(k: Kernel) -> int:
    """Column slices the epilogue runs on by default, where the whole 128x128 tile spills, compiled for sm_90
    with triton 3.6 (benchmarks/results/h200-gluon-compile.md): 8 where tiles of pairs cross by TMA (a whole
    tile's pairs and their results spill 1.5-3.9 KB per thread; slices of 16 columns none, or 0.2 KB); 4 where
    the epilogue also reduces over rows through a scratch (the RMSNorm backward's weight gradient: 0.7-1.0 KB
    on the whole tile, none on quarters); else the whole tile (RoPE's included, since tile.sincos)."""
    split = 8 if buffer_columns(k) == 2 else 4 if epilogue_scratch(k) else 1
    while split > 1 and k.column_group and (DEFAULT_BLOCK_N // split) % k.column_group:
        split //= 2  # each slice holds whole column groups
    return split


def _slice_buffers(buffers: int, part: str = "part") -> list[str]:
    """The lines that make `slot`, the consumer's epilogue stage of the column slice whose index in the tile is
    `part`, and `buffers`, that stage's epilogue buffers, as a tuple."""
    lines = [f"slot = CONSUMER * EPILOGUE_STAGES + {part} % EPILOGUE_STAGES"]
    if buffers == 1:
        return lines + ["buffers = (epilogue_buffers.index(slot),)"]
    return lines + [f"first_buffer = slot * {buffers}",
                    "buffers = (" + ", ".join(f"epilogue_buffers.index(first_buffer{f' + {i}' if i else ''})"
                                              for i in range(buffers)) + ")"]


def _epilogue_slice_buffers(k: Kernel, buffers: int) -> list[str]:
    """_slice_buffers for the epilogue of a slice: none where nothing crosses by TMA, and none with direct
    stores where the buffers are there for the stores alone."""
    if not buffers:
        return []
    if tma_inputs(k):
        return _slice_buffers(buffers)
    return ["if DIRECT_STORES:", "    buffers = ()", "else:", *("    " + line for line in _slice_buffers(buffers))]


def epilogue_scratch(k: Kernel) -> int:
    """Bytes of shared memory Triton takes for the epilogue: a reduction over rows crosses the warps through
    it (4.2 KB at 128x128 tiles, compiled for sm_90); reductions over columns stay within warps."""
    return 8192 if any(s.op == "reduce" and s.args["axis"] == "rows" for s in k.steps) else 0


def _unused_mask(line: str, lines: list[str]) -> bool:
    """A row or column mask that no other line reads (TMA stores need none)."""
    name = line.split(" = ")[0]
    return name in ("row_mask", "col_mask") and not any(name in other for other in lines if other != line)


@dataclass(frozen=True)
class Pointer:
    """A tensor the epilogue addresses through pointers (row and column vectors, partial reductions)."""

    name: str
    strides: tuple[str, ...]

    @property
    def ptr(self) -> str:
        return f"{self.name}_ptr"

    @property
    def stride_args(self) -> tuple[str, ...]:
        return tuple(f"{self.name}.stride({i})" for i in range(len(self.strides)))


def _buffer_of(k: Kernel, name: str, buffer: str) -> str:
    """A TMA tensor's tile in an epilogue buffer: the buffer, or its first part for a narrower tile."""
    return buffer if tile_width(k, name) is buffer_width(k) else f"hopper.view({buffer}, {name}_desc)"


def _row_load(k: Kernel, name: str) -> str:
    """The consumer's load of a row vector for the tile's rows, as fp32 (an index keeps its integer type)."""
    index = k.input(name).dtype is DType.INDEX
    return (f"{name} = gl.load({name}_ptr + rows * stride_{name}_m, mask=rows < M, other={0 if index else 0.0})"
            + ("" if index else ".to(gl.float32)"))


def _input_reads(k: Kernel) -> list[str]:
    """The consumer's reads of the tile inputs from their buffers, once their TMA loads have landed."""
    lines = []
    for i, name in enumerate(tma_inputs(k)):
        if tile_width(k, name) is Width.DOUBLE:
            lines.append(f"{name}_even, {name}_odd = hopper.load_pairs(buffers[{i}], acc_slice)")
        else:
            lines.append(f"{name} = tile.widen({_buffer_of(k, name, f'buffers[{i}]')}.load(SLICE))")
    return lines


@dataclass(frozen=True)
class HopperKernel:
    """What the Hopper module of a kernel is made of, as its template reads it: the launch's arguments
    (LaunchSignature, shared with the tl module), the tensors that cross by TMA and by pointers, the epilogue's
    buffers, and the parameter lists of the epilogue and the consumer."""

    kernel: Kernel
    types: dict[str, ValueType]

    @cached_property
    def sig(self) -> LaunchSignature:
        return LaunchSignature(self.kernel)

    @cached_property
    def buffers(self) -> int:
        return epilogue_buffers(self.kernel)

    @cached_property
    def epilogue(self) -> list[str]:
        e = GluonEpilogueEmitter(self.kernel, self.types, self.buffers)
        e.lines.append("row_mask = rows < M")
        e.need_width(Width.FULL)
        for step in self.kernel.steps:
            e.emit(step)
        return [line for line in e.lines if not _unused_mask(line, e.lines)]

    @cached_property
    def tma_inputs(self) -> list[str]:
        return tma_inputs(self.kernel)

    @cached_property
    def tma_outputs(self) -> list[str]:
        return tma_outputs(self.kernel)

    @property
    def input_descs(self) -> list[str]:
        return [f"{n}_desc" for n in self.tma_inputs]

    @property
    def descs(self) -> list[str]:
        """The TMA descriptors of the tile inputs and outputs."""
        return [f"{n}_desc" for n in (*self.tma_inputs, *self.tma_outputs)]

    @property
    def casts_to_t(self) -> bool:
        return any(s.op == "cast" and s.args["dtype"] == "T" for s in self.kernel.steps)

    @property
    def consumer_descs(self) -> list[str]:
        """The descriptors the consumer takes: and the GEMM's a, whose type is the T of a cast to T."""
        return self.descs + ([f"{self.kernel.gemm.a}_desc"] if self.casts_to_t else [])

    @cached_property
    def all_pointers(self) -> list[Pointer]:
        """Every tensor but the GEMM's operands and the tile inputs: tile outputs too, for direct stores."""
        gemm = self.kernel.gemm
        return [Pointer(t.name, tuple(f"stride_{t.name}_{axis}" for axis in t.axes)) for t in self.sig.tensors
                if t.name not in (gemm.a, gemm.b, *self.tma_inputs)]

    @property
    def pointers(self) -> list[Pointer]:
        """The tensors the epilogue always addresses through pointers."""
        return [p for p in self.all_pointers if p.name not in self.tma_outputs]

    @property
    def strides(self) -> list[str]:
        return [s for p in self.all_pointers for s in p.strides]

    @property
    def row_loads(self) -> list[str]:
        """The consumer's loads of the row vectors, once per tile."""
        return [_row_load(self.kernel, n) for n in row_inputs(self.kernel)]

    @property
    def epilogue_strides(self) -> list[str]:
        rows_in = row_inputs(self.kernel)
        return [s for p in self.all_pointers if p.name not in rows_in for s in p.strides]

    @property
    def epilogue_args(self) -> list[str]:
        """What the consumer passes the epilogue of a slice: its tile inputs (read), buffers, descriptors,
        row vectors (loaded) and pointers, host scalars."""
        k, rows_in = self.kernel, row_inputs(self.kernel)
        return [*(f"{n}_even, {n}_odd" if tile_width(k, n) is Width.DOUBLE else n for n in self.tma_inputs),
                *(["buffers"] if self.buffers else []), *(f"{n}_desc" for n in self.tma_outputs),
                *(p.name if p.name in rows_in else p.ptr for p in self.all_pointers), *self.sig.scalars,
                *([f"{k.gemm.a}_desc"] if self.casts_to_t else [])]

    @property
    def consumer_args(self) -> list[str]:
        """What the kernel passes each consumer, its index aside."""
        return ["mainloop", *(["epilogue_buffers"] if self.buffers else []), "inputs_ready", *self.consumer_descs,
                *(p.ptr for p in self.all_pointers), *self.sig.scalars, "M", "N", "K", *self.strides, "NUM_PROGRAMS",
                "EPILOGUE_SPLIT", "EPILOGUE_STAGES", "SLICE_LOOP", "SLICE_UNROLL",
                *(["DIRECT_STORES"] if self.buffers else [])]

    @property
    def blocks(self) -> dict[str, str]:
        """Each TMA tensor's block, as the launcher writes it."""
        return {n: BLOCKS[tile_width(self.kernel, n)] for n in (*self.tma_inputs, *self.tma_outputs)}

    @property
    def input_loads(self) -> list[tuple[str, str, str]]:
        """Each tile input's TMA load: its name, the column of a slice's first element, its buffer."""
        k = self.kernel
        return [(n, SLICE_COLUMN[tile_width(k, n)], _buffer_of(k, n, f"buffers[{i}]"))
                for i, n in enumerate(self.tma_inputs)]

    @property
    def input_reads(self) -> list[str]:
        return _input_reads(self.kernel)

    @property
    def slice_buffers(self) -> list[str]:
        return _slice_buffers(self.buffers, "early_part")

    @property
    def epilogue_slice_buffers(self) -> list[str]:
        return _epilogue_slice_buffers(self.kernel, self.buffers)

    @property
    def columns(self) -> int:
        return buffer_columns(self.kernel)

    @property
    def scratch(self) -> int:
        return epilogue_scratch(self.kernel)

    @property
    def split(self) -> int:
        return default_split(self.kernel)

    @property
    def b_kn(self) -> bool:
        return self.kernel.gemm.b_layout.value == "kn"

    @property
    def bind_args(self) -> str:
        """As the tl launcher binds sizes: gated outputs split N in halves; column groups tile N."""
        even_n = any(t.width is Width.HALF for t in self.types.values())
        group = self.kernel.column_group
        return (", even_n=True" if even_n else "") + (f", group={group}" if group else "")

    @property
    def imports(self) -> set[str]:
        """The modules the epilogue uses of those the module imports only where used."""
        text = (*self.epilogue, *self.input_reads)
        return ({"tl"} if any("tl." in line for line in self.epilogue) else set()) | (
            {"tile"} if any("tile." in line for line in text) else set()) | (
            {"triton"} if self.kernel.tile_dependent else set())


def render_gluon_kernel(k: Kernel, types: dict[str, ValueType], regenerate: str) -> str:
    m = HopperKernel(k, types)
    return render("kernel_gluon.py.j2", k=k, gemm=k.gemm, sig=m.sig, m=m, regenerate=regenerate)


def render_gluon(kernels: list[tuple[Kernel, dict[str, ValueType]]], regenerate: str) -> dict[str, str]:
    """The Hopper backend's files, by path under the output folder: a module per kernel it lowers, and the
    package's __init__.py, which imports none of them and lists the kernels that keep the tl path only (the files
    a build writes for this backend, through codagen.emit.backends.render_backends, alone)."""
    files = {}
    lowered, fallbacks = [], []
    for k, types in kernels:
        found = unlowered(k, types)
        fallbacks += found
        if not found:
            lowered.append(k)
            files[f"kernels/gluon/{k.name}.py"] = render_gluon_kernel(k, types, regenerate)
    files["kernels/gluon/__init__.py"] = render_package_init(lowered, fallbacks, regenerate)
    return files


def render_package_init(lowered: list[Kernel], fallbacks: list[Fallback], regenerate: str) -> str:
    """kernels/gluon/__init__.py: its docstring lists the kernels the backend lowers, and why it does not lower
    the others."""
    lines = ["# @generated by codagen; do not edit.", f"# Regenerate with: {regenerate}",
             '"""Hopper (sm_90) kernels in Gluon: one module per kernel spec that the Hopper backend lowers, each '
             "with a", "`launch` that takes the tl kernel's arguments. Import one only on a Hopper GPU; this "
             "package imports none.", ""]
    lines += [f"- {k.name} ({k.source})" for k in lowered]
    if fallbacks:
        lines += ["", "Kernels that keep the tl path only, and why:", ""]
        lines += [f"- {f}" for f in fallbacks]
    return layout("\n".join(lines) + '\n"""\n')
