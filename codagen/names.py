"""Which names a spec may use. Spec names become Python and Triton identifiers in generated code, so they
are checked against a strict pattern and every name the generated code itself uses."""
from __future__ import annotations

import builtins
import keyword
import re
import unicodedata

IDENTIFIER = re.compile(r"[a-z][a-z0-9_]{0,47}")

# Every lowercase name that the generated modules (codagen/templates, codagen/emit) use for themselves:
# modules, locals and parameters of the kernels, launchers and ops, the Hopper backend's schedule, and the
# blocks. tests/test_bad_specs.py scans the generated sources for any name not listed here.
INTERNAL = frozenset("""
    tl triton torch math functools runtime tile codagen generated acc pid pid_m pid_n num_pid_m num_pid_n
    num_pid_in_group group_id first_pid_m group_size_m k0 a_tile b_tile rows cols cols_half cols_even
    cols_odd cols_double row_mask col_mask col_mask_half tile_mask tile_mask_half tile_mask_double first_row
    first_col part
    config grid device dtype out outs ctx self args kwargs library op fake meta m n k
    launch values sizes t_dtype tensors key plan tma tile_id offs_k path
    gluon gl hopper mbarrier fence_async_shared a_ring b_ring ready empty turn buffers epilogue_buffers
    inputs_ready slice_n acc_slice first_buffer slot k_steps step tile_count i step_start in_step early_part
    nn kernels finish chosen check_launch cols_group col_mask_group group_mask grad_factor
""".split())
# Names made from a spec name x: x_ptr, x_ptrs (pointers), x_desc (TMA descriptors), x_even, x_odd (halves
# of pairs, emit/epilogue.py), x_of_columns (per-pair values by column), x_as_t (a cast's tile in T for its
# store, emit/gluon.py), stride_x_m and the like, offs_*
RESERVED_SUFFIXES = ("_ptr", "_ptrs", "_desc", "_even", "_odd", "_of_columns", "_as_t")
RESERVED_PREFIXES = ("stride_", "offs_")
# What a kernel named k defines besides k itself: checked against the kernel's own names (validate.py)
KERNEL_FUNCTIONS = ("kernel", "gluon_kernel", "epilogue", "consumer", "load_inputs", "op")
# torch.ops.codagen.<kernel> is an attribute of an op namespace, which has one public attribute of its own
TAKEN_KERNEL_NAMES = frozenset({"name"})

# A block's attrs and parameters become attributes of its nn.Module (self.<name>): not one of torch.nn.Module's
# own (tests/test_bad_specs.py compares with the installed torch) nor a method of the generated module
MODULE_ATTRIBUTES = frozenset("""
    add_module apply bfloat16 buffers call_super_init children compile cpu cuda double dump_patches eval
    extra_repr float forward get_buffer get_extra_state get_parameter get_submodule half ipu load_state_dict
    modules mtia named_buffers named_children named_modules named_parameters parameters register_backward_hook
    register_buffer register_forward_hook register_forward_pre_hook register_full_backward_hook
    register_full_backward_pre_hook register_load_state_dict_post_hook register_load_state_dict_pre_hook
    register_module register_parameter register_state_dict_post_hook register_state_dict_pre_hook requires_grad_
    set_extra_state set_submodule share_memory state_dict to to_empty train training type xpu zero_grad
    reset_parameters
""".split())


def kernel_functions(kernel: str) -> tuple[str, ...]:
    """The names the generated module of `kernel` gives its functions: k_kernel, k_epilogue, ..."""
    return tuple(f"{kernel}_{f}" for f in KERNEL_FUNCTIONS)


def identifier_problem(name: object) -> str | None:
    """Why `name` does not match IDENTIFIER (with the name escaped for a message), or None when it does."""
    if not isinstance(name, str):
        return "expected a name"
    if not IDENTIFIER.fullmatch(name):
        return f"'{_shorten(name)}' is not a valid name: {_why_invalid(name)}"
    return None


def name_problem(name: object) -> str | None:
    """Why `name` cannot be a spec identifier, or None when it can."""
    problem = identifier_problem(name)
    if problem:
        return problem
    if keyword.iskeyword(name) or keyword.issoftkeyword(name):
        return f"'{name}' is a Python keyword; choose another name"
    if hasattr(builtins, name):
        return f"'{name}' is a Python builtin; choose another name"
    # *_even and *_odd: the halves of a value of interleaved pairs (see emit/epilogue.py)
    if name in INTERNAL or name.endswith(RESERVED_SUFFIXES) or name.startswith(RESERVED_PREFIXES):
        return (f"'{name}' is reserved for generated code (names such as acc, tl, part, *_ptr, *_desc, *_even, "
                "*_odd, stride_* and offs_* are taken); choose another name")
    return None


_RULE = "use lowercase ASCII letters, digits and '_', starting with a letter, at most 48 characters"


def _why_invalid(name: str) -> str:
    foreign = next((c for c in name if ord(c) > 127), None)
    if foreign is not None:
        label = unicodedata.name(foreign, "unnamed character")
        return f"it contains the non-ASCII character U+{ord(foreign):04X} ({label}); {_RULE}"
    if not name:
        return f"it is empty; {_RULE}"
    if len(name) > 48:
        return f"it is {len(name)} characters long; {_RULE}"
    if not ("a" <= name[0] <= "z"):
        return f"it must start with a lowercase letter; {_RULE}"
    other = next((c for c in name if not (c.islower() or c.isdigit() or c == "_")), None)
    if other is not None and other.isupper():
        return f"it contains the capital letter '{other}'; {_RULE}"
    if other is not None:
        return f"it contains '{_shorten(other)}'; {_RULE}"
    return _RULE


def _shorten(s: str, n: int = 40) -> str:
    s = s.encode("unicode_escape").decode("ascii")
    return s if len(s) <= n else s[:n] + "..."
