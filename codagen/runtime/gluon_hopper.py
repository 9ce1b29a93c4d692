"""What generated Hopper (Gluon) kernels import: their tile configuration, launch checks, TMA descriptors, and
the device functions every such kernel shares: the tile order, the producer that fills the ring of operand
stages, the consumers' mainloop and the TMA store of an epilogue value.

The schedule (generated/kernels/gluon/*.py): a persistent grid, one program per SM. Per program, one producer
warp loads the GEMM operands with TMA into a ring of STAGES shared-memory stages, each with a `ready` barrier
(the copy landed) and an `empty` one (the MMAs that read it are done). Two consumer warpgroups take the
program's tiles in turn, consumer 0 the even ones and consumer 1 the odd ones, and each keeps its tile's
accumulator in its own registers; a `turn` barrier pair lets only one of them run its mainloop at a time, so
that while one runs its MMAs the other runs its epilogue ("ping-pong", as in CUTLASS's Hopper kernels). It also
keeps each consumer's waits on the ring in ring order, which mbarrier phases need: a consumer that waited on a
stage two fills ahead would take the older fill's phase for its own.

Import this module only where Gluon kernels can run (a Hopper GPU with Triton's Gluon): nothing else does."""

import dataclasses
import functools
from dataclasses import dataclass

import torch

from . import sm_count  # first: codagen.runtime decides whether Triton interprets before triton loads
from . import tile
from .checks import Aliasing
from .configs import CONSUMER_REGS, PRODUCER_REGS, REGISTERS, HopperConfig  # noqa: F401 (re-exported)
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}

# TMA copies by their Triton 3.6 names, or by the names that replaced them (Triton 3.9 removed the old ones):
# generated kernels call these, so that they compile with either (the GPU machine has 3.6, CI 3.9)
if hasattr(tma, "async_load"):
    tma_load, tma_store = tma.async_load, tma.async_store
else:
    tma_load, tma_store = tma.async_copy_global_to_shared, tma.async_copy_shared_to_global
# Gluon's aggregate (device values passed as one argument), by its Triton 3.6 name or its public one (3.7 on).
# It checks values against its fields' annotations, hence this module's annotations are not postponed (PEP 563).
aggregate = getattr(gluon, "aggregate", None) or triton.language.core._aggregate


@dataclass(frozen=True)
class Epilogue:
    """What a kernel's epilogue holds in shared memory besides the operand ring: per consumer and epilogue
    stage (HopperConfig.epilogue_stages), `buffers` slices of type T (its TMA loads and stores), each BLOCK_M x
    `columns` * the slice's width (2 where a tile of pairs, 2*N columns, crosses by TMA; narrower tiles then
    use the first part of a buffer), and `scratch` bytes for Triton's own use on a 128x128 slice, in
    proportion to a slice's size (a reduction over rows crosses warps through shared memory: 4.2 KB on
    128x128 tiles, 0.7 KB on 128x32 slices, compiled for sm_90). `split`: the column slices the default config
    runs the epilogue on (8 where tiles of pairs cross: a whole tile's pairs, its accumulator and their
    results do not fit in a warpgroup's registers). `inputs`: how many of the buffers hold tile inputs (the others
    are there for the stores alone, which direct stores do without)."""

    buffers: int
    inputs: int = 0
    scratch: int = 0
    columns: int = 1
    split: int = 1  # the default config's epilogue_split
    column_group: int | None = None  # the kernel's column_group: each epilogue slice must hold whole groups


SMEM_LIMIT = 232448  # bytes of shared memory one program may use on sm_90 (227 KiB)
MAX_STAGES = 6
TMA_BOX = 256  # the most elements a TMA copy's block spans in each dimension


def default_config(epilogue: Epilogue, block_k: int = 64) -> HopperConfig:
    """128x128 tiles with as many operand stages, up to MAX_STAGES, as fit beside the epilogue (16-bit
    operands); where fewer than 3 fit (buffers of tiles of pairs, and scratch), stages of half the depth, twice
    as many (the same bytes in flight, a deeper pipeline)."""
    config = HopperConfig(block_k=block_k, stages=MAX_STAGES, epilogue_split=epilogue.split)
    while config.stages > 2 and config.smem_bytes(2, epilogue) > SMEM_LIMIT:
        config = dataclasses.replace(config, stages=config.stages - 1)
    if config.stages < 3 and block_k > 32:
        return default_config(epilogue, block_k // 2)
    return config


def launch_config(config: HopperConfig | None, epilogue: Epilogue) -> HopperConfig:
    """The config of a launch: the default for None (default_config), else the HopperConfig given (a tuning
    table's, or the caller's); a config of another backend is refused."""
    if config is None:
        return default_config(epilogue)
    if not isinstance(config, HopperConfig):
        raise ValueError(f"a config of the {getattr(config, 'backend', type(config).__name__)} backend given to a "
                         "Hopper (gluon) kernel, which takes a HopperConfig")
    return config


def available(device: torch.device) -> bool:
    """Whether this device runs the Hopper kernels: an sm_90 GPU."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


def check(kernel: str, config: HopperConfig, epilogue: Epilogue, t_dtype: torch.dtype, k: int, values: dict,
          tma_tensors: tuple[str, ...], pointer_tensors: tuple[str, ...]) -> None:
    """Refuse, with the reason, a launch the Hopper kernel cannot make (the tl kernel can): operands that are
    not bf16 or fp16, an empty K, slices that TMA cannot copy, that split column groups or that the epilogue's
    stages do not divide, tensors that TMA cannot address (strides, or a base not 16-byte aligned), offsets past
    32 bits, or a tile shape that does not fit in shared memory."""
    if t_dtype not in GL_DTYPES:
        raise ValueError(f"{kernel}: the Hopper kernel takes bfloat16 or float16 operands, got {t_dtype}")
    if k == 0:
        raise ValueError(f"{kernel}: K is 0; the Hopper kernel's mainloop needs at least one K step")
    slice_n = config.block_n // config.epilogue_split
    if config.epilogue_split % config.slices_in_flight:
        raise ValueError(f"{kernel}: {config.label()}: epilogue_stages {config.epilogue_stages} does not divide "
                         f"epilogue_split {config.epilogue_split}")
    if epilogue.columns * slice_n > TMA_BOX:
        raise ValueError(f"{kernel}: {config.label()}: a slice of pairs spans 2 * block_n / epilogue_split = "
                         f"{epilogue.columns * slice_n} columns, more than the {TMA_BOX} a TMA copy takes")
    if epilogue.column_group and slice_n % epilogue.column_group:
        raise ValueError(f"{kernel}: {config.label()}: epilogue slices of {slice_n} columns do not hold whole "
                         f"column groups of {epilogue.column_group}")
    if slice_n < 16:
        raise ValueError(f"{kernel}: {config.label()}: epilogue slices of {slice_n} columns; they need 16 or more "
                         "(a TMA copy of a gated output's half slice spans 16 bytes at least)")
    if not available(values[tma_tensors[0]].device):
        raise ValueError(f"{kernel}: the Hopper kernel runs on an sm_90 GPU only")
    for name in tma_tensors:
        t = values[name]
        if name == tma_tensors[0] and mn_major(t):  # the GEMM's a, addressed as a.T (descriptor_a)
            t = t.T
        if t.stride(-1) != 1 or (t.stride(0) * t.element_size()) % 16:
            raise ValueError(f"{kernel}: TMA cannot address '{name}' (it needs a contiguous last dimension and "
                             f"16-byte aligned rows; strides {t.stride()})")
        if t.data_ptr() % 16:
            raise ValueError(f"{kernel}: TMA cannot address '{name}': its base is not 16-byte aligned (a view at "
                             "an offset?)")
    for name in pointer_tensors:
        t = values[name]
        if sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) >= 2**31:
            raise ValueError(f"{kernel}: '{name}' spans 2**31 elements or more, which the Hopper kernel's 32-bit "
                             "offsets do not reach")
    smem = config.smem_bytes(torch.empty((), dtype=t_dtype).element_size(), epilogue)
    if smem > SMEM_LIMIT:
        raise ValueError(f"{kernel}: {config.label()} needs {smem} bytes of shared memory, more than the "
                         f"{SMEM_LIMIT} a program has")


def signature(tensors, config: HopperConfig) -> tuple | None:
    """What a launch plan depends on (as runtime.signature for the tl kernels): the config, and the types,
    shapes, strides, dtypes and devices of the arguments. None when one is not a tensor: no plan has that key,
    and making one says which."""
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return None
    return (config, *[(type(t), t.shape, t.stride(), t.dtype, t.device) for t in tensors])


@dataclass(frozen=True)
class LaunchPlan:
    device: torch.device
    m: int
    n: int
    k: int
    programs: int
    aliasing: Aliasing  # the per-call check that outputs share no memory with other arguments

    @property
    def empty(self) -> bool:
        return self.m == 0 or self.n == 0

    @classmethod
    def make(cls, device: torch.device, m: int, n: int, k: int, config: HopperConfig,
             aliasing: Aliasing) -> "LaunchPlan":
        tiles = -(-m // config.block_m) * -(-n // config.block_n)
        return cls(device, m, n, k, programs=max(1, min(tiles, sm_count(device))), aliasing=aliasing)


def descriptor(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    """A TMA descriptor of `t` in blocks of `block`; per launch, since a tensor's base moves between calls."""
    if t.data_ptr() % 16:
        raise ValueError(f"TMA needs a 16-byte aligned base, got a tensor at {t.data_ptr():#x} (a view at an "
                         "offset?); the tl kernel takes it")
    return TensorDescriptor.from_tensor(t, block, _shared_layout(tuple(block), t.dtype))


def mn_major(a: torch.Tensor) -> bool:
    """Whether a GEMM's `a` ([M, K]) has M contiguous: the transpose of a [K, M] tensor, as the chunk's dz^T of
    the LM head's weight gradient. Its descriptor then addresses a.T, whose [BLOCK_K, BLOCK_M] blocks wgmma
    reads transposed from shared memory (compiled for sm_90: HGMMA ... tnspA, as many as K-contiguous)."""
    return a.stride(0) == 1 and a.stride(1) != 1


def descriptor_a(a: torch.Tensor, config: HopperConfig) -> TensorDescriptor:
    """The TMA descriptor of the GEMM's `a`: of a itself in [BLOCK_M, BLOCK_K] blocks, or of a.T in
    [BLOCK_K, BLOCK_M] blocks where a is M-contiguous (the kernel's A_KM: mn_major)."""
    if mn_major(a):
        return descriptor(a.T, [config.block_k, config.block_m])
    return descriptor(a, [config.block_m, config.block_k])


def store_descriptor(t: torch.Tensor, block: list[int], config: HopperConfig) -> TensorDescriptor | None:
    """An output's TMA descriptor, or None where the config stores from registers (the kernel reads none)."""
    return None if config.direct_stores else descriptor(t, block)


@functools.lru_cache(maxsize=None)
def _shared_layout(block: tuple[int, ...], dtype: torch.dtype):
    """The shared-memory layout of a TMA block: made once per block shape and dtype, since making it takes most
    of a descriptor's host time (6.6 of 8.5 us with triton 3.6, measured on the CPU)."""
    return gl.NVMMASharedLayout.get_default_for(list(block), GL_DTYPES[dtype])


@aggregate
class Mainloop:
    """The GEMM of a kernel, passed as one argument to its producer and its consumers (as the Gluon
    warp-specialization tutorial passes its partitions' arguments): the operands' TMA descriptors, their ring of
    STAGES shared-memory stages with its `ready` and `empty` barriers, the consumers' `turn` barriers, and the
    tile settings. A_KM: a is M-contiguous, a_desc its transpose's (descriptor_a); B_KN: b is [K, N]."""

    a_desc: tma.tensor_descriptor
    b_desc: tma.tensor_descriptor
    a_ring: gl.shared_memory_descriptor
    b_ring: gl.shared_memory_descriptor
    ready: gl.shared_memory_descriptor
    empty: gl.shared_memory_descriptor
    turn: gl.shared_memory_descriptor
    BLOCK_M: gl.constexpr
    BLOCK_N: gl.constexpr
    BLOCK_K: gl.constexpr
    GROUP_M: gl.constexpr
    STAGES: gl.constexpr
    CONSUMERS: gl.constexpr
    B_KN: gl.constexpr
    A_KM: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, a_desc, b_desc, a_ring, b_ring, ready, empty, turn, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                 STAGES, CONSUMERS, B_KN, A_KM):
        self.a_desc, self.b_desc = a_desc, b_desc
        self.a_ring, self.b_ring = a_ring, b_ring
        self.ready, self.empty, self.turn = ready, empty, turn
        self.BLOCK_M, self.BLOCK_N, self.BLOCK_K = gl.constexpr(BLOCK_M), gl.constexpr(BLOCK_N), gl.constexpr(BLOCK_K)
        self.GROUP_M, self.STAGES, self.CONSUMERS = gl.constexpr(GROUP_M), gl.constexpr(STAGES), gl.constexpr(CONSUMERS)
        self.B_KN, self.A_KM = gl.constexpr(B_KN), gl.constexpr(A_KM)


@gluon.jit
def allocate_mainloop(a_desc, b_desc, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                      GROUP_M: gl.constexpr, STAGES: gl.constexpr, CONSUMERS: gl.constexpr, B_KN: gl.constexpr,
                      A_KM: gl.constexpr):
    """A kernel's Mainloop: the ring's stages in the layouts of the operands' TMA blocks, and its barriers."""
    a_ring = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_ring = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(CONSUMERS):
        mbarrier.init(turn.index(i), count=1)
    return Mainloop(a_desc, b_desc, a_ring, b_ring, ready, empty, turn, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES,
                    CONSUMERS, B_KN, A_KM)


@gluon.jit
def tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M: gl.constexpr):
    """Tile id -> (pid_m, pid_n) in grouped order: GROUP_M row-tiles share each column of B while it is in L2
    (the tl kernels' order)."""
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (tile_id // num_pid_in_group) * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((tile_id % num_pid_in_group) % group_size_m)
    pid_n = (tile_id % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@gluon.jit
def load_operands(mainloop, M, N, K, NUM_PROGRAMS):
    """The producer: every K step of every tile of this program, in order, into the ring. A stage is
    refilled once its `empty` barrier says the MMAs that read it are done; barriers start with their phase
    1 complete, hence the first wait on each stage passes. Edges read zeros (TMA's out-of-bounds fill)."""
    BLOCK_M: gl.constexpr = mainloop.BLOCK_M
    BLOCK_N: gl.constexpr = mainloop.BLOCK_N
    BLOCK_K: gl.constexpr = mainloop.BLOCK_K
    STAGES: gl.constexpr = mainloop.STAGES
    a_desc, b_desc = mainloop.a_desc, mainloop.b_desc
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    k_steps = gl.cdiv(K, BLOCK_K)
    step = 0
    for tile_id in range(gl.program_id(0), num_pid_m * num_pid_n, NUM_PROGRAMS):
        pid_m, pid_n = tile_coords(tile_id, num_pid_m, num_pid_n, mainloop.GROUP_M)
        for k in range(k_steps):
            stage = step % STAGES
            mbarrier.wait(mainloop.empty.index(stage), ((step // STAGES) & 1) ^ 1)
            ready = mainloop.ready.index(stage)
            mbarrier.expect(ready, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            if mainloop.A_KM:  # a's [K, M] transpose (mn_major)
                tma_load(a_desc, [k * BLOCK_K, pid_m * BLOCK_M], ready, mainloop.a_ring.index(stage))
            else:
                tma_load(a_desc, [pid_m * BLOCK_M, k * BLOCK_K], ready, mainloop.a_ring.index(stage))
            if mainloop.B_KN:
                tma_load(b_desc, [k * BLOCK_K, pid_n * BLOCK_N], ready, mainloop.b_ring.index(stage))
            else:
                tma_load(b_desc, [pid_n * BLOCK_N, k * BLOCK_K], ready, mainloop.b_ring.index(stage))
            step += 1


@gluon.jit
def mma_tile(mainloop, step, k_steps, tile_count, ACC: gl.constexpr, CONSUMER: gl.constexpr):
    """One tile's mainloop on ring steps [step, step + k_steps), once the consumer before this one (in turn,
    of CONSUMERS) has run its mainloop (the `turn` barriers); this consumer's `tile_count`-th tile. One wgmma
    stays in flight: a stage is released as soon as the wgmma after it is issued. Returns the fp32
    accumulator. Consumer 0's first wait passes at once (a barrier starts with its phase 1 complete)."""
    STAGES: gl.constexpr = mainloop.STAGES
    mbarrier.wait(mainloop.turn.index(CONSUMER), (tile_count & 1) ^ (1 if CONSUMER == 0 else 0))
    acc = gl.zeros((mainloop.BLOCK_M, mainloop.BLOCK_N), gl.float32, ACC)
    for k in range(k_steps):
        stage = (step + k) % STAGES
        mbarrier.wait(mainloop.ready.index(stage), ((step + k) // STAGES) & 1)
        a = mainloop.a_ring.index(stage)
        if mainloop.A_KM:
            a = a.permute((1, 0))
        b = mainloop.b_ring.index(stage)
        if mainloop.B_KN:
            acc = warpgroup_mma(a, b, acc, is_async=True)
        else:
            acc = warpgroup_mma(a, b.permute((1, 0)), acc, is_async=True)
        acc, a, b = warpgroup_mma_wait(1, deps=(acc, a, b))
        mbarrier.arrive(mainloop.empty.index((step + k + STAGES - 1) % STAGES), pred=k > 0)
    mbarrier.arrive(mainloop.turn.index((CONSUMER + 1) % mainloop.CONSUMERS))
    acc = warpgroup_mma_wait(0, deps=(acc,))
    mbarrier.arrive(mainloop.empty.index((step + k_steps + STAGES - 1) % STAGES))
    return acc


@gluon.jit
def column_slice(x, start, offset: gl.constexpr, PARTS: gl.constexpr, STEP: gl.constexpr, LAYOUT: gl.constexpr):
    """tile.column_slice of the accumulator, slice start + offset (`start` a multiple of STEP), in LAYOUT: the
    accumulator's layout at the slice's width, which the halves of halves of x are in already (the conversion
    asserts that no value moves). A `start` known at compile time takes its slice as it is; one known at run
    time (HopperConfig.slice_loop) selects it, element by element, from the PARTS / STEP slices it may be."""
    if isinstance(start, gl.constexpr):
        chosen = gl.convert_layout(tile.column_slice(x, start + offset, PARTS), LAYOUT, assert_trivial=True)
    else:
        chosen = gl.convert_layout(tile.column_slice(x, offset, PARTS), LAYOUT, assert_trivial=True)
        for p in gl.static_range(offset + STEP, PARTS, STEP):
            chosen = gl.where(start + offset == p, gl.convert_layout(tile.column_slice(x, p, PARTS), LAYOUT,
                                                                     assert_trivial=True), chosen)
    return chosen


# a shared-memory buffer viewed as another block shape: `reinterpret` since Triton 3.9, `_reinterpret` before
REINTERPRET_PUBLIC: gl.constexpr = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))


@gluon.jit
def view(buffer, desc):
    """The first part of a buffer's memory as a tile of a TMA descriptor's block shape, in its layout: a tile
    narrower than the buffer (half its width: a gated activation's output, or a tile N wide in a buffer made
    for tiles of pairs)."""
    if REINTERPRET_PUBLIC:
        part = buffer.reinterpret(desc.dtype, desc.block_type.shape, desc.layout)
    else:
        part = buffer._reinterpret(desc.dtype, desc.block_type.shape, desc.layout)
    return part


@gluon.jit
def load_pairs(buffer, like):
    """A tile of interleaved pairs (2 * BLOCK_N columns) read from a shared-memory buffer as fp32, split into
    its even and odd columns, each in the layout of `like` (the accumulator, BLOCK_N wide): the tile is read
    in the layout that joining two such tiles gives, so every thread reads the pairs of the elements it holds
    and the split moves no value between threads (the conversions assert as much)."""
    PAIRS: gl.constexpr = tile.join_pairs(like, like).type.layout
    even, odd = tile.split_pairs(tile.widen(buffer.load(PAIRS)))
    return (gl.convert_layout(even, like.type.layout, assert_trivial=True),
            gl.convert_layout(odd, like.type.layout, assert_trivial=True))


@gluon.jit
def group_reduce(x, mask, GROUP: gl.constexpr, OP: gl.constexpr):
    """tile.group_reduce of a tile in the accumulator's layout, each group's value held over the group's GROUP
    columns (tile.expand_groups), in x's layout: reduced within the threads and lanes that hold a row's
    columns, and expanded back to the elements they came from, so no value moves (the conversion asserts as
    much). A group value held so meets tiles as it is."""
    return gl.convert_layout(tile.expand_groups(tile.group_reduce(x, mask, GROUP, OP), GROUP), x.type.layout,
                             assert_trivial=True)


@gluon.jit
def store_direct(ptr, stride_m, stride_n, value, row, col, M, COLUMNS):
    """An epilogue value stored from registers, in its own layout, at rows row.. and columns col.. of an
    [M, COLUMNS] tensor, masked at its edges (HopperConfig.direct_stores): no buffer, nothing to wait for.
    Row offsets in 64 bits, since an output (a chunk of logits) may span more than 2**31 elements."""
    LAYOUT: gl.constexpr = value.type.layout
    rows = row + gl.arange(0, value.type.shape[0], layout=gl.SliceLayout(1, LAYOUT))
    cols = col + gl.arange(0, value.type.shape[1], layout=gl.SliceLayout(0, LAYOUT))
    mask = (rows < M)[:, None] & (cols < COLUMNS)[None, :]
    gl.store(ptr + rows.to(gl.int64)[:, None] * stride_m + cols[None, :] * stride_n,
             value.to(ptr.dtype.element_ty), mask=mask)


@gluon.jit
def store_narrow_tile(desc, buffer, value, row, col, PENDING: gl.constexpr):
    """store_tile of a value narrower than the buffer, through the first part of its memory (`view`)."""
    store_tile(desc, view(buffer, desc), value, row, col, PENDING)


@gluon.jit
def store_tile(desc, buffer, value, row, col, PENDING: gl.constexpr):
    """TMA store of an epilogue value through a shared-memory buffer, once at most PENDING of this consumer's
    earlier stores are still reading their buffers (so this buffer's last store is done with it; None: no
    store has read it since the consumer last waited for all). The copy runs on while the epilogue goes on;
    TMA skips what lies past the tensor's edges."""
    if PENDING is not None:
        tma.store_wait(PENDING)
    buffer.store(value.to(desc.dtype))
    fence_async_shared()
    tma_store(desc, [row, col], buffer)
