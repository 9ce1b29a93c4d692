"""Which names a spec may use. Spec names become Python and Triton identifiers in generated code, so they
are checked against a strict pattern (a lowercase letter first: never '_', which starts the generated code's
own names) and the few names the generated code has in scope wherever a spec name is."""
from __future__ import annotations

import builtins
import keyword
import re
import unicodedata

IDENTIFIER = re.compile(r"[a-z][a-z0-9_]{0,47}")

# The generated code's own locals, parameters and helpers start with '_' (or are uppercase: sizes and
# constexprs), which no spec name can, so a spec's names share no scope with them. What is left in scope wherever
# a spec name is: the keyword argument of every launcher, the accumulator of the spec language, and the modules
# and public function of a generated kernel module. (A kernel that the Hopper backend could not lower for its
# names keeps the tl kernel: codagen/emit/gluon.py.)
CONFIG = "config"  # launch(..., config=None): the keyword argument of the public launch API
MODULES = frozenset({"torch", "triton", "tl", "tile", "runtime", "launch"})
RESERVED = frozenset({CONFIG, "acc", *MODULES})
# A block's nn.Module takes these keyword arguments besides its attrs: no attr may be named so (blockspec.py)
MODULE_KEYWORDS = ("device", "dtype")
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
    if name == CONFIG:
        return "'config' is the keyword argument of every generated launch(); choose another name"
    if name == "acc":
        return "'acc' is the GEMM accumulator; choose another name"
    if name in MODULES:
        return (f"'{name}' is a name of every generated kernel module ({', '.join(sorted(MODULES))}: the modules "
                "it imports and its launch()); choose another name")
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
