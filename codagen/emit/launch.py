"""What a kernel's launch takes: its arguments in order, which are allocated and which a caller may give, and how
the generated launchers, the op and the public function declare and pass them. Both backends' modules read this
one view (templates/kernel.py.j2, templates/kernel_gluon.py.j2): the Hopper module's `launch` takes the tl
launcher's arguments, which passes them on by name."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from .. import dims
from ..model import Dim, DType, Input, InputRole, Kernel, Output
from ..validate import in_place_inputs

AXIS = {Dim.M: "m", Dim.K: "k", Dim.N: "n", Dim.N_HALF: "n", Dim.N_DOUBLE: "n", Dim.TILES_M: "t",
        Dim.TILES_N: "t", Dim.GROUPS_N: "n", Dim.GROUPS_K: "k", Dim.BLOCKS_N: "n"}  # the axis of a dim, as stride
# names spell it (stride_x_m)
TORCH_DTYPES = {DType.FLOAT32: "torch.float32", DType.FLOAT16: "torch.float16", DType.BFLOAT16: "torch.bfloat16",
                DType.FLOAT8_E4M3FN: "torch.float8_e4m3fn", DType.FLOAT8_E5M2: "torch.float8_e5m2"}


@dataclass(frozen=True)
class Tensor:
    """A tensor argument of the kernel."""

    name: str
    dims: tuple[str, ...]
    axes: tuple[str, ...]  # each dim's axis letter (AXIS)
    dtype: str
    output: bool
    inplace: bool  # an output the caller passes, updated in place
    in_place_of: tuple[str, ...]  # the inputs this output may be passed as, to write over them in place
    alloc_shape: str  # Python source of the shape, for allocated outputs
    alloc_dtype: str

    @property
    def strides(self) -> tuple[str, ...]:
        """The tl kernel's stride parameters of this tensor."""
        return tuple(f"_stride_{self.name}_{a}" for a in self.axes)

    @property
    def stride_args(self) -> tuple[str, ...]:
        return tuple(f"{self.name}.stride({i})" for i in range(len(self.dims)))

    @property
    def decl(self) -> str:
        """The runtime.Decl of this argument, as the launchers check it."""
        return (f'runtime.Decl("{self.name}", {_strings(self.dims)}, "{self.dtype}"'
                + (", output=True" if self.output else "")
                + (f", in_place_of={_strings(self.in_place_of)}" if self.in_place_of else "") + ")")


def _strings(items: tuple[str, ...]) -> str:
    """A tuple of strings as Python source."""
    return "(" + ", ".join(f'"{i}"' for i in items) + ("," if len(items) == 1 else "") + ")"


def _tensor(decl: Input | Output, output: bool, group: int | str | None, in_place_of: tuple[str, ...] = ()) -> Tensor:
    shape = ", ".join(dims.python(d.value, group) for d in decl.dims)
    return Tensor(
        name=decl.name,
        dims=tuple(d.value for d in decl.dims),
        axes=tuple(AXIS[d] for d in decl.dims),
        dtype=decl.dtype.value,
        output=output,
        inplace=output and decl.inplace,
        in_place_of=in_place_of,
        alloc_shape=f"({shape},)" if len(decl.dims) == 1 else f"({shape})",
        alloc_dtype="_t_dtype" if decl.dtype is DType.T else TORCH_DTYPES.get(decl.dtype, ""),
    )


@dataclass(frozen=True)
class LaunchSignature:
    """A kernel's launch arguments. Inputs come in spec order (host scalars among them), then the outputs updated
    in place: the op's arguments; the allocated outputs follow, keyword-only, then the config."""

    kernel: Kernel

    @cached_property
    def tensors(self) -> tuple[Tensor, ...]:
        """The tensor arguments in launch order: inputs (host scalars aside), then outputs."""
        k, in_place = self.kernel, in_place_inputs(self.kernel)
        return (tuple(_tensor(i, False, k.column_group) for i in k.inputs if i.role is not InputRole.HOST_SCALAR)
                + tuple(_tensor(o, True, k.column_group, in_place.get(o.name, ())) for o in k.outputs))

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tensors]

    @property
    def inputs(self) -> list[Tensor]:
        return [t for t in self.tensors if not t.output]

    @property
    def allocated(self) -> list[Tensor]:
        """The outputs the module allocates (and returns)."""
        return [t for t in self.tensors if t.output and not t.inplace]

    @property
    def scalars(self) -> list[str]:
        return [i.name for i in self.kernel.inputs if i.role is InputRole.HOST_SCALAR]

    @property
    def given(self) -> list[Tensor]:
        """The allocated outputs that a caller may give (such as the input it may be written over): keyword-only,
        None allocates."""
        return [t for t in self.allocated if t.in_place_of]

    @property
    def returned(self) -> list[str]:
        return [t.name for t in self.allocated]

    @property
    def mutated(self) -> list[str]:
        """The outputs updated in place."""
        return [o.name for o in self.kernel.outputs if o.inplace]

    @property
    def op_args(self) -> list[str]:
        """The op's arguments: every input, then the outputs updated in place."""
        return [i.name for i in self.kernel.inputs] + self.mutated

    @property
    def launch_params(self) -> list[str]:
        """`launch`'s parameters (both backends')."""
        return self.op_args + (["*", *self.returned] if self.returned else []) + ["config=None"]

    @property
    def launch_args(self) -> list[str]:
        """The arguments of `launch` but the config."""
        return self.op_args + self.returned

    @property
    def run_params(self) -> list[str]:
        """The parameters of the public function (and of `_run`, `_allocate`): the op's, and the outputs a
        caller may give."""
        return self.op_args + (["*", *(f"{t.name}=None" for t in self.given)] if self.given else [])

    @property
    def run_args(self) -> list[str]:
        """What the public function passes `_run`."""
        return self.op_args + [f"{t.name}={t.name}" for t in self.given]

    @property
    def op_params(self) -> list[str]:
        """The op's parameters, annotated as torch.library reads its schema."""
        return [f"{n}: float" if n in self.scalars else f"{n}: torch.Tensor" for n in self.op_args]

    @property
    def returns(self) -> str:
        """The annotation of what the op returns."""
        n = len(self.returned)
        return "None" if n == 0 else "torch.Tensor" if n == 1 else f"tuple[{', '.join(['torch.Tensor'] * n)}]"

    @property
    def gemm_operands(self) -> tuple[int, int] | None:
        """The positions of the GEMM's operands among the tensors."""
        gemm = self.kernel.gemm
        return (self.names.index(gemm.a), self.names.index(gemm.b)) if gemm else None
