"""The bad-spec corpus: every way a spec can be wrong that we know of, each with the exact place the error
must point at and the words it must say. Specs are written to tmp_path and loaded with codagen.api.load,
which raises ValidationFailed listing every error (SpecError: .loc file/line/col, .message).

Most cases are variations of one good spec, built by `spec()` with a fixed layout, so that line numbers
are easy to read off:

    1 kernel:   2 doc:   3 gemm:   4 inputs:   5 outputs:   6 epilogue:   7.. one step per line

A case's `at` is (line, token): the error's column is where `token` first occurs on that line (or an int
column). `words` must all appear in the message. `count` is how many errors the file yields in all: one
mistake should give one error, not a cascade."""
from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from codagen import api
from codagen.errors import SpecError, ValidationFailed
from codagen.names import IDENTIFIER, MODULE_ATTRIBUTES
from conftest import REPO

BLOCK_SUFFIXES = ("rows", "chunks", "sum")

STEPS = [
    "add: {x: acc, y: x, out: x_new}",                        # 7
    "store: {x: x_new, to: x_out}",                           # 8
    "reduce: {op: sumsq, x: x_new, axis: cols, to: ss}",     # 9
    "scale: {x: x_new, by: wn, out: hv}",                     # 10
    "store: {x: hv, to: h}",                                  # 11
]
INPUTS = "{y: [M, K], w_o: [N, K], x: [M, N], wn: [N]}"
OUTPUTS = "{x_out: [M, N], h: [M, N], ss: [M, tiles(N)]}"
ROPE_STEPS = ["rope: {x: acc, positions: pos, freqs: freqs, out: r}", "store: {x: r, to: q}"]
AB = "{a: [M, K], b: [N, K]"  # inputs of the smaller kernels below, to be closed with more inputs and '}'
E4M3_MK, E4M3_NK, E4M3_KN = ("{shape: [%s], dtype: float8_e4m3fn}" % s for s in ("M, K", "N, K", "K, N"))


def spec(kernel="k1", doc="Out-projection with the residual add and the RMSNorm statistics.",
         gemm="{a: y, b: w_o, b_layout: nk}", inputs=INPUTS, outputs=OUTPUTS, steps=STEPS) -> str:
    """A spec in the fixed layout of the module docstring; each argument is the YAML text after its key."""
    lines = [f"kernel: {kernel}", f"doc: {doc}", f"gemm: {gemm}" if gemm else "# no gemm",
             f"inputs: {inputs}", f"outputs: {outputs}", "epilogue:"] + [f"  - {s}" for s in steps]
    return "\n".join(lines) + "\n"


def grouped(text: str, group: str = "8") -> str:
    """A spec with column groups: `column_group` on the line after its last step."""
    return text + f"column_group: {group}\n"


GROUP_STEPS = ["group_reduce: {op: sum, x: acc, out: s}", "scale: {x: acc, by: s, out: t}", "store: {x: t, to: o}"]


def ab_spec(inputs: str, outputs: str, steps: list[str]) -> str:
    """A smaller kernel: gemm a @ b^T plus the given inputs (YAML text inside the braces)."""
    return spec(gemm="{a: a, b: b}", inputs=f"{AB}, {inputs}}}" if inputs else AB + "}", outputs=outputs,
                steps=steps)


KG_SA = "sa: {shape: [M, groups(K)], dtype: float32}"
KG_SB = "sb: {shape: [blocks(N), groups(K)], dtype: float32}"


def kg_spec(scales="{a: sa, b: sb, group: 128}", inputs=f"{{a: {E4M3_MK}, b: {E4M3_NK}, {KG_SA}, {KG_SB}}}",
            outputs="{o: {shape: [M, N], dtype: float32}}", steps=("store: {x: acc, to: o}",)) -> str:
    """A kernel of FP8 operands with K-group scales (gemm.scales)."""
    return spec(gemm=f"{{a: a, b: b, scales: {scales}}}", inputs=inputs, outputs=outputs, steps=list(steps))


@dataclass(frozen=True)
class Case:
    id: str
    text: str | bytes
    at: tuple[int, str | int | None]  # (line, token or column or None for "line only")
    words: tuple[str, ...]
    count: int = 1


def c(id, text, at, *words, count=1) -> Case:
    return Case(id, text, at, words, count)


BILLION_LAUGHS = """\
a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]
b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]
c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]
d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]
e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d]
f: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e]
g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f]
kernel: k1
"""

CASES = [
    # -- YAML that must never be constructed ----------------------------------------------------------------
    c("python_apply_os_system", spec(kernel='!!python/object/apply:os.system ["echo pwned"]'), (1, "!!python"),
      "tag '!!python/object/apply:os.system'", "not allowed", "remove the tag"),
    c("python_name", spec(doc="!!python/name:os.system ''"), (2, "!!python"), "'!!python/name:os.system'"),
    c("python_object_in_step", spec(steps=["add: !!python/object:os.Evil {x: acc, y: x, out: x_new}"] + STEPS[1:]),
      (7, "!!python"), "'!!python/object:os.Evil'", "not allowed"),
    c("python_module_in_inputs", spec(inputs="!!python/module:os {}"), (4, "!!python"), "'!!python/module:os'"),
    c("binary_tag", spec(doc="!!binary aGVsbG8gd29ybGQ="), (2, "!!binary"), "tag '!!binary'", "not allowed"),
    c("set_tag", spec(outputs="!!set {x_out: null}"), (5, "!!set"), "tag '!!set'"),
    c("local_tag", spec(kernel="!shell k1"), (1, "!shell"), "tag '!shell'", "not allowed"),
    c("billion_laughs", BILLION_LAUGHS, (1, "&a"), "anchor '&a'", "not allowed", "write the value out"),
    c("anchor_alias_in_spec", spec(inputs="&ins {y: [M, K], w_o: [N, K], x: [M, N], wn: [N]}", outputs="*ins"),
      (4, "&ins"), "anchor '&ins'", "no anchors or aliases"),
    c("alias_without_anchor", spec(doc="*d"), (2, "*d"), "alias '*d'", "not allowed"),
    c("implicit_date", spec(doc="2026-12-02"), (2, "2026"), "'2026-12-02'", "date", "quotes"),
    c("boolean_key", spec(inputs="{y: [M, K], w_o: [N, K], x: [M, N], wn: [N], on: [M]}"), (4, "on:"),
      "key 'on' reads as YAML bool", "quotes"),
    c("huge_integer", spec(steps=["mul: {x: acc, y: " + "9" * 5000 + ", out: x_new}"] + STEPS[1:]), (7, "999"),
      "number '9999", "finite"),
    c("nan_literal", spec(steps=["mul: {x: acc, y: .nan, out: x_new}"] + STEPS[1:]), (7, ".nan"), "finite"),
    c("beyond_float32", spec(steps=["mul: {x: acc, y: 1.0e+39, out: x_new}"] + STEPS[1:]), (7, "1.0e+39"),
      "'1.0e+39' is not a finite float32", "3.402823e+38"),
    c("zero_in_float32", spec(steps=["mul: {x: acc, y: -1.0e-50, out: x_new}"] + STEPS[1:]), (7, "-1.0e-50"),
      "'-1.0e-50' is 0 in float32"),
    c("bool_tag_on_text", spec(kernel="!!bool maybe"), (1, "!!bool"), "'maybe' is tagged !!bool but is not true"),
    c("int_tag_on_empty_text", spec(kernel='!!int ""'), (1, "!!int"), "'' is tagged !!int but is not a number"),
    c("float_tag_on_empty_text", spec(steps=['mul: {x: acc, y: !!float "", out: x_new}'] + STEPS[1:]),
      (7, "!!float"), "'' is tagged !!float but is not a number"),
    # -- malformed YAML and unreadable files ----------------------------------------------------------------
    c("syntax_unclosed_flow_mapping", spec(gemm="{a: y, b: w_o, b_layout: nk"), (4, ":"),
      "YAML syntax error: expected ',' or '}'", "while parsing a flow mapping that starts at line 3, column 7"),
    c("syntax_bad_indentation", spec().replace("\ndoc:", "\n  doc:"), (2, ":"),
      "YAML syntax error: mapping values are not allowed here", "put the text in quotes"),
    c("syntax_tab", spec().replace("  - store: {x: hv", "\t- store: {x: hv"), (11, 1),
      "YAML syntax error", "'\\t'", "spaces, not tabs"),
    c("two_documents", spec() + "---\n" + spec(), (12, 1), "single document"),
    c("deep_nesting", "kernel: " + "[" * 2000 + "]" * 2000 + "\n", (1, 9 + 15), "nesting is too deep",
      "16 levels"),
    c("huge_file", spec() + "# padding padding padding padding padding padding padding\n" * 5000, (1, 1),
      "bytes, more than the 256 KiB", "right file"),
    c("empty_file", "", (1, 1), "spec is empty", "'kernel:'"),
    c("only_comments", "# nothing here\n\n", (1, 1), "spec is empty"),
    c("not_utf8", spec().encode().replace(b"Out-projection", b"Out-pr\xf6jection"), (2, len("doc: Out-pr") + 1),
      "not UTF-8",
      "0xf6"),
    c("control_character", spec(doc="Adds the\x07 residual."), (2, "\x07"), "control character U+0007"),
    c("top_level_list", "- kernel: k1\n", (1, 1), "a spec must be a mapping, got a list"),
    # -- structure: keys -----------------------------------------------------------------------------------
    c("duplicate_top_level_key", spec().replace("outputs:", "inputs: {q: [M]}\noutputs:"), (5, "inputs"),
      "duplicate key 'inputs'", "first at line 4"),
    c("duplicate_key_in_step", spec(steps=["add: {x: acc, y: x, x: wn, out: x_new}"] + STEPS[1:]), (7, "x: wn"),
      "duplicate key 'x'", "first at line 7"),
    c("unknown_top_level_key", spec().replace("epilogue:", "version: 2\nepilogue:"), (6, "version"),
      "unknown key 'version' in the kernel spec",
      "expected one of: kernel, doc, gemm, column_group, inputs, outputs, epilogue"),
    c("misspelt_top_level_key", spec().replace("inputs:", "inptus:"), (4, "inptus"),
      "unknown key 'inptus'", "did you mean 'inputs'?", count=2),  # and: the kernel spec is missing 'inputs'
    c("missing_outputs", spec().replace(f"outputs: {OUTPUTS}", "# no outputs"), (1, 1),
      "the kernel spec is missing 'outputs'"),
    c("unknown_key_in_step", spec(steps=STEPS[:3] + ["scale: {x: x_new, by: wn, along: cols, out: hv}", STEPS[4]]),
      (10, "along"), "unknown key 'along' in scale", "expected one of: x, by, out"),
    c("unknown_key_in_gemm", spec(gemm="{a: y, b: w_o, trans_b: true}"), (3, "trans_b"),
      "unknown key 'trans_b' in gemm", "a, b, b_layout"),
    c("unknown_primitive", spec(steps=STEPS[:2] + ["reduc: {op: sumsq, x: x_new, axis: cols, to: ss}"] + STEPS[3:]),
      (9, "reduc"), "unknown primitive 'reduc'", "did you mean 'reduce'?"),
    c("missing_step_argument", spec(steps=["add: {x: acc, out: x_new}"] + STEPS[1:]), (7, "{"),
      "add is missing 'y'"),
    c("step_missing_dash", spec().replace("  - store: {x: x_new, to: x_out}", "    store: {x: x_new, to: x_out}"),
      (7, "add"), "exactly one key", "got a mapping with 2 keys (add, store)", "'- ' missing"),
    c("step_with_two_primitives", spec(steps=["{add: {x: acc, y: x, out: x_new}, mul: {x: acc, y: 2.0, out: m}}"]
                                       + STEPS[1:]), (7, "{"), "exactly one key"),
    # -- structure: types of YAML values --------------------------------------------------------------------
    c("number_for_kernel_name", spec(kernel="42"), (1, "42"), "kernel: expected a name, got a number (42)"),
    c("number_for_store_target", spec(steps=STEPS[:4] + ["store: {x: hv, to: 3}"]), (11, "3"),
      "store.to: expected a name, got a number (3)"),
    c("list_for_inputs", spec(inputs="[y, w_o, x, wn]"), (4, "["), "inputs must be a mapping, got a list"),
    c("list_for_step_body", spec(steps=["add: [acc, x, x_new]"] + STEPS[1:]), (7, "["),
      "add must be a mapping, got a list"),
    c("mapping_for_shape_dim", spec(inputs="{y: [M, K], w_o: [N, K], x: [M, {n: N}], wn: [N]}"), (4, "{n"),
      "unknown dimension a mapping", "expected one of: M, K, N/2, N, 2*N"),
    c("unknown_dimension", spec(inputs="{y: [M, K], w_o: [N, K], x: [M, D], wn: [N]}"), (4, "D]"),
      "input 'x' shape: unknown dimension 'D'", "expected one of: M, K, N/2, N, 2*N"),
    c("tiles_in_input", spec(inputs="{y: [M, K], w_o: [N, K], x: [M, tiles(N)], wn: [N]}"), (4, "tiles"),
      "unknown dimension 'tiles(N)'"),
    c("three_dims", spec(inputs="{y: [M, K], w_o: [N, K], x: [M, N, N], wn: [N]}"), (4, "[M, N, N]"),
      "3 dimensions", "at most 2"),
    c("unknown_dtype", spec(inputs="{y: [M, K], w_o: [N, K], x: [M, N], wn: {shape: [N], dtype: float64}}"),
      (4, "float64"),
      "dtype must be one of: T, float32, float16, bfloat16, float8_e4m3fn, float8_e5m2, index, got 'float64'"),
    c("inplace_not_bool", ab_spec("", "{o: {shape: [M, N], inplace: yes please}}", ["accumulate: {x: acc, into: o}"]),
      (5, "yes please"), "inplace must be true or false", "got 'yes please'"),
    c("doc_not_text", spec(doc="3"), (2, "3"), "doc must be a sentence", "got a number (3)"),
    # -- enums ---------------------------------------------------------------------------------------------
    c("axis_col", spec(steps=STEPS[:2] + ["reduce: {op: sumsq, x: x_new, axis: col, to: ss}"] + STEPS[3:]),
      (9, "col,"), "reduce.axis must be 'cols' or 'rows', got 'col'", "did you mean 'cols'?"),
    c("reduce_op_mean", spec(steps=STEPS[:2] + ["reduce: {op: mean, x: x_new, axis: cols, to: ss}"] + STEPS[3:]),
      (9, "mean"), "reduce.op must be one of 'sum', 'sumsq', 'max', 'logsumexp', got 'mean'"),
    c("b_layout_nt", spec(gemm="{a: y, b: w_o, b_layout: nt}"), (3, "nt"),
      "gemm.b_layout must be 'nk'", "or 'kn'", "got 'nt'"),
    # -- names: identifiers that reach generated source -----------------------------------------------------
    c("name_injection_semicolon", spec(kernel='"x; import os"'), (1, '"x;'),
      "kernel: 'x; import os' is not a valid name", "contains ';'", "lowercase ASCII letters"),
    c("name_injection_newline", spec(steps=['add: {x: acc, y: x, out: "a\\nimport os"}'] + STEPS[1:]), (7, '"a'),
      "add.out: 'a\\nimport os' is not a valid name", "contains '\\n'"),
    c("name_unicode_lookalike", spec(inputs="{y: [M, K], w_o: [N, K], \u0445: [M, N], wn: [N]}"),
      (4, "\u0445"), "'\\u0445' is not a valid name", "U+0445", "CYRILLIC SMALL LETTER HA"),
    c("name_dunder_import", spec(kernel="__import__"), (1, "__import__"), "'__import__' is not a valid name",
      "start with a lowercase letter"),
    c("name_uppercase", spec(kernel="OutProj"), (1, "OutProj"), "'OutProj' is not a valid name"),
    c("name_too_long", spec(kernel="k" * 49), (1, 9), "49 characters long"),
    c("name_keyword_lambda", spec(inputs="{y: [M, K], w_o: [N, K], lambda: [M, N], wn: [N]}"), (4, "lambda"),
      "'lambda' is a Python keyword"),
    c("name_builtin_print", spec(steps=STEPS[:3] + ["scale: {x: x_new, by: wn, out: print}",
                                                    "store: {x: print, to: h}"]),
      (10, "print"), "'print' is a Python builtin", count=2),  # the store reads the same bad name
    c("name_underscore_first", spec(inputs="{y: [M, K], w_o: [N, K], x: [M, N], _wn: [N]}"), (4, "_wn"),
      "'_wn' is not a valid name", "start with a lowercase letter"),  # '_' starts the generated code's own names
    c("name_reserved_acc_as_out", spec(steps=["add: {x: acc, y: x, out: acc}"] + STEPS[1:]), (7, "acc}"),
      "'acc' is the GEMM accumulator"),
    c("name_reserved_config", spec(inputs="{y: [M, K], w_o: [N, K], x: [M, N], config: [N]}"), (4, "config"),
      "'config' is the keyword argument of every generated launch()"),
    c("name_reserved_tl", spec(inputs="{y: [M, K], w_o: [N, K], x: [M, N], tl: [N]}"), (4, "tl"),
      "'tl' is a name of every generated kernel module"),
    c("name_reserved_launch", spec(inputs="{y: [M, K], w_o: [N, K], x: [M, N], launch: [N]}"), (4, "launch"),
      "'launch' is a name of every generated kernel module"),
    c("name_of_generated_kernel", spec(inputs="{y: [M, K], w_o: [N, K], x: [M, N], wn: [N], k1_kernel: [M]}"),
      (4, "k1_kernel"), "'k1_kernel' is the name of a function of the generated kernel module", count=2),  # unused
    c("name_of_generated_epilogue", spec(inputs="{y: [M, K], w_o: [N, K], x: [M, N], wn: [N], k1_epilogue: scalar}"),
      (4, "k1_epilogue"), "'k1_epilogue' is the name of a function of the generated kernel module", count=2),
    c("value_named_like_generated_op", spec(steps=STEPS[:3] + ["scale: {x: x_new, by: wn, out: k1_op}",
                                                               "store: {x: k1_op, to: h}"]),
      (10, "k1_op"), "scale.out: 'k1_op' is the name of a function of the generated kernel module"),
    c("kernel_named_name", spec(kernel="name"), (1, "name"), "'name' is taken", "torch.ops.codagen.name"),
    # -- doc text: it goes into docstrings -----------------------------------------------------------------
    c("doc_triple_quote", spec(doc="'Adds \"\"\" + __import__(\"os\").system(\"ls\") + \"\"\"'"), (2, "'"),
      'triple quote (""")', "docstring"),
    c("doc_backslash", spec(doc="'Scales by \\N{GREEK SMALL LETTER ALPHA}'"), (2, "'"), "backslash", "escape"),
    c("doc_ends_with_quote", spec(doc="'Computes the \"residual\"'"), (2, "'"), "may not end with a double quote"),
    c("doc_control_character", spec(doc='"Adds\\0 the residual."'), (2, '"'), "unprintable character U+0000"),
    # -- the gemm --------------------------------------------------------------------------------------------
    c("gemm_a_wrong_shape", spec(inputs="{y: [K, M], w_o: [N, K], x: [M, N], wn: [N]}"), (4, "y"),
      "gemm.a 'y' must have shape [M, K], got [K, M]"),
    c("gemm_b_wrong_shape_for_kn", spec(gemm="{a: y, b: w_o, b_layout: kn}"), (4, "w_o"),
      "gemm.b 'w_o' must have shape [K, N] with b_layout 'kn', got [N, K]"),
    c("gemm_a_not_an_input", spec(gemm="{a: yy, b: w_o}"), (3, "{"),
      "gemm.a 'yy' is not among the inputs", "declare it as [M, K]", count=2),  # and: 'y' is a K input unused
    c("k_input_not_in_gemm", spec(inputs="{y: [M, K], w_o: [N, K], x: [M, N], wn: [N], z: [M, K]}"), (4, "z:"),
      "input 'z' has a K dimension but is not an operand of the gemm"),
    c("gemm_operand_read_in_epilogue", spec(steps=["add: {x: acc, y: y, out: x_new}"] + STEPS[1:]), (7, "y, out"),
      "add.y: 'y' is a gemm operand and cannot be read in the epilogue", count=2),  # and: input 'x' unused
    c("acc_without_gemm", spec(gemm=None, inputs="{x: [M, N], wn: [N]}"), (7, "acc"),
      "add.x: 'acc' exists only in kernels with a gemm"),
    c("cast_to_t_without_t", spec(gemm=None, inputs="{x: {shape: [M, N], dtype: float32}}",
                                  outputs="{o: {shape: [M, N], dtype: float32}}",
                                  steps=["cast: {x: x, dtype: T, out: xt}", "store: {x: xt, to: o}"]),
      (7, "T"), "cast.dtype T is the type of the kernel's matrix inputs, and it has none"),
    # -- values: defined once, before use, and used -------------------------------------------------------
    c("undefined_value", spec(steps=[STEPS[0], "store: {x: x_nwe, to: x_out}"] + STEPS[2:]), (8, "x_nwe"),
      "store.x: 'x_nwe' is not defined", "did you mean 'x_new'?"),
    c("used_before_defined", spec(steps=[STEPS[1], STEPS[0]] + STEPS[2:]), (7, "x_new"),
      "'x_new' is used before it is defined (at line 8)", "move this step"),
    c("redefined_value", spec(steps=STEPS + ["mul: {x: x_new, y: 2.0, out: x_new}"]), (12, "x_new}"),
      "mul.out: 'x_new' is already defined at line 7", "assigned once"),
    c("value_named_like_input", spec(steps=STEPS[:3] + ["scale: {x: x_new, by: wn, out: wn}", "store: {x: wn, to: h}"]),
      (10, "wn}"), "scale.out: 'wn' is already an input (line 4)", count=2),  # the store then reads input wn [N]
    c("value_named_like_output", spec(steps=STEPS[:3] + ["scale: {x: x_new, by: wn, out: h}", "store: {x: h, to: h}"]),
      (10, "h}"), "scale.out: 'h' is an output", count=2),  # and the store reads the output 'h'
    c("output_read_as_value", spec(steps=STEPS + ["exp: {x: h, out: e}", "store: {x: e, to: h2}"],
                                   outputs="{x_out: [M, N], h: [M, N], ss: [M, tiles(N)], h2: [M, N]}"),
      (12, "h,"), "exp.x: 'h' is an output; outputs are written, not read"),
    c("unused_value", spec(steps=STEPS + ["exp: {x: x_new, out: e}"]), (12, "e}"), "value 'e' is never used"),
    c("unused_input", spec(inputs="{y: [M, K], w_o: [N, K], x: [M, N], wn: [N], bias: [N]}"), (4, "bias"),
      "input 'bias' is never used"),
    c("unused_acc", spec(steps=["mul: {x: x, y: 2.0, out: x_new}"] + STEPS[1:]), (3, "{"),
      "the GEMM accumulator 'acc' is never used"),
    c("declared_twice", spec(outputs="{x_out: [M, N], h: [M, N], ss: [M, tiles(N)], x: [M, N]}"), (5, "x:"),
      "'x' is declared twice (first at line 4)", count=2),  # and: output 'x' is never written
    c("literal_with_literal", spec(steps=STEPS[:3] + ["mul: {x: 2.0, y: 3.0, out: two}",
                                                      "scale: {x: x_new, by: two, out: hv}", STEPS[4]],
                                   inputs="{y: [M, K], w_o: [N, K], x: [M, N]}"),
      (10, "mul"), "mul: both operands are numbers; write the result as one number"),
    # -- outputs: written exactly once, the right way --------------------------------------------------------
    c("output_never_written", spec(outputs="{x_out: [M, N], h: [M, N], ss: [M, tiles(N)], extra: [M, N]}"),
      (5, "extra"), "output 'extra' is never written", "store: {x: ..., to: extra}"),
    c("output_written_twice", spec(steps=STEPS + ["store: {x: hv, to: x_out}"]), (12, "x_out"),
      "store.to: output 'x_out' is already written at line 8", "written once"),
    c("store_to_undeclared_output", spec(steps=STEPS + ["store: {x: hv, to: hh}"]), (12, "hh"),
      "store.to: 'hh' is not among the outputs", "did you mean 'h'?"),
    c("store_shape_mismatch", spec(outputs="{x_out: [M, N], h: [M], ss: [M, tiles(N)]}"), (11, "h}"),
      "store.to: output 'h' has shape [M], but this step writes [M, N]", "declare 'h' as [M, N]"),
    c("accumulate_into_not_inplace", ab_spec("", "{dx: [M, N]}", ["accumulate: {x: acc, into: dx}"]), (7, "dx"),
      "accumulate.into: output 'dx' must be declared with 'inplace: true'"),
    c("store_into_inplace", ab_spec("", "{dx: {shape: [M, N], inplace: true}}", ["store: {x: acc, to: dx}"]),
      (7, "dx"), "store.to: output 'dx' is inplace; update it with 'accumulate'"),
    c("output_of_index_dtype", ab_spec("", "{o: {shape: [M, N], dtype: index}}", ["store: {x: acc, to: o}"]),
      (5, "o:"), "output 'o' cannot have dtype index"),
    # -- shapes and widths -----------------------------------------------------------------------------------
    c("width_mismatch_in_binary", spec(inputs="{y: [M, K], w_o: [N, K], x: [M, N/2], wn: [N]}"), (7, "add"),
      "add: cannot combine tile [M, N] 'acc' with tile [M, N/2] 'x'", "widths differ"),
    c("scale_by_wrong_width", spec(inputs="{y: [M, K], w_o: [N, K], x: [M, N], wn: [2*N]}"), (10, "wn"),
      "scale.by: column vector [2*N] 'wn' does not match tile [M, N] 'x_new'"),
    c("scale_by_a_tile", spec(steps=STEPS[:3] + ["scale: {x: x_new, by: x, out: hv}", STEPS[4]]), (10, "x, out"),
      "scale.by must be a row vector, column vector, group value or scalar, got tile [M, N] 'x'",
      count=2),  # and: wn unused
    c("swiglu_on_half_tile", ab_spec("", "{out_y: [M, N/2]}", ["swiglu: {x: acc, out: g1}", "swiglu: {x: g1, out: g2}",
                                                              "store: {x: g2, to: out_y}"]),
      (8, "g1"), "swiglu.x: 'g1' is a tile [M, N/2], already halved", "[M, N] or [M, 2*N]"),
    c("swiglu_bwd_wrong_width", ab_spec("dy: [M, N]", "{dz: [M, N]}",
                                        ["swiglu_bwd: {dy: dy, x: acc, out: d}", "store: {x: d, to: dz}"]),
      (7, "acc"), "swiglu_bwd.x must be twice as wide as dy ([M, 2*N]), got tile [M, N] 'acc'"),
    c("rope_freqs_wrong_width", ab_spec("pos: {shape: [M], dtype: index}, freqs: [N]", "{q: [M, N]}", ROPE_STEPS),
      (7, "freqs, out"), "rope.freqs must have one frequency per pair, [N/2]", "column vector [N] 'freqs'"),
    c("rope_positions_not_a_row", ab_spec("pos: [N], freqs: [N/2]", "{q: [M, N]}", ROPE_STEPS),
      (7, "pos,"), "rope.positions must be a row vector [M] of positions, got column vector [N] 'pos'"),
    c("index_input_not_a_row", ab_spec("t: {shape: [N], dtype: index}", "{o: [M]}",
                                       ["select: {x: acc, index: t, to: o}"]), (4, "t:"),
      "input 't' has dtype index, which only row vectors [M] may have"),
    # -- partial reductions ----------------------------------------------------------------------------------
    c("partial_wrong_shape_for_cols", spec(outputs="{x_out: [M, N], h: [M, N], ss: [M, tiles(M)]}"), (9, "ss}"),
      "reduce.to: output 'ss' has shape [M, tiles(M)], but this step writes [M, tiles(N)]",
      "one partial per row and N-tile"),
    c("partial_wrong_shape_for_rows", spec(steps=STEPS[:2] + ["reduce: {op: sum, x: x_new, axis: rows, to: ss}"]
                                           + STEPS[3:]), (9, "ss}"),
      "output 'ss' has shape [M, tiles(N)], but this step writes [N, tiles(M)]", "one partial per column and M-tile"),
    c("partial_not_float32", spec(outputs="{x_out: [M, N], h: [M, N], ss: {shape: [M, tiles(N)], dtype: bfloat16}}"),
      (5, "ss"), "output 'ss' holds partial reductions and must be float32, got bfloat16"),
    c("partial_inplace", spec(outputs="{x_out: [M, N], h: [M, N], ss: {shape: [M, tiles(N)], inplace: true}}"),
      (5, "ss"), "output 'ss' holds partial reductions and cannot be inplace"),
    c("store_into_partial_output", spec(steps=STEPS[:2] + ["store: {x: x_new, to: ss}"] + STEPS[3:]), (9, "ss"),
      "store.to: output 'ss' holds partial reductions [M, tiles(N)]", "- reduce: {op: ..., x: ..., axis: ..., to: ss}"),
    c("reduce_of_a_row_vector", ab_spec("r: [M]", "{ss: [M, tiles(N)], o: [M, N]}",
                                        ["reduce: {op: sum, x: r, axis: cols, to: ss}", "store: {x: acc, to: o}"]),
      (7, "r,"), "reduce.x must be a tile, got row vector [M] 'r'"),
    # -- column groups -------------------------------------------------------------------------------------
    c("column_group_not_a_power_of_two", grouped(ab_spec("", "{o: [M, N]}", GROUP_STEPS), "96"), (10, "96"),
      "column_group must be a power of two from 2 to 512", "got a number (96)"),
    c("column_group_too_wide", grouped(ab_spec("", "{o: [M, N]}", GROUP_STEPS), "1024"), (10, "1024"),
      "column_group must be a power of two from 2 to 512"),
    c("group_reduce_without_column_group", ab_spec("", "{o: [M, N]}", GROUP_STEPS), (7, "group_reduce"),
      "group_reduce reduces over column groups, and the kernel declares none", "'column_group: <width>'"),
    c("groups_dim_without_column_group",
      ab_spec("g: {shape: [M, groups(N)], dtype: float32}", "{o: [M, N]}",
              ["scale: {x: acc, by: g, out: t}", "store: {x: t, to: o}"]), (4, "g:"),
      "'g' has a groups(N) dimension, but the kernel declares no column groups"),
    c("group_reduce_of_a_half_width_tile",
      grouped(ab_spec("", "{o: [M, groups(N)]}", ["swiglu: {x: acc, out: y}", "group_reduce: {op: sum, x: y, out: s}",
                                                  "store: {x: s, to: o}"])), (8, "y,"),
      "group_reduce.x must be a tile of width N", "got tile [M, N/2] 'y'"),
    c("group_reduce_of_a_row", grouped(ab_spec("r: [M]", "{o: [M, N]}", [GROUP_STEPS[0].replace("acc", "r")]
                                               + GROUP_STEPS[1:])), (7, "r,"),
      "group_reduce.x must be a tile of width N, got row vector [M] 'r'"),
    c("group_value_with_a_double_width_tile",
      grouped(ab_spec("d: [M, 2*N]", "{o: [M, 2*N]}", ["group_reduce: {op: sum, x: acc, out: s}",
                                                       "mul: {x: d, y: s, out: t}", "store: {x: t, to: o}"])),
      (8, "mul"), "mul: cannot combine tile [M, 2*N] 'd' with group value [M, groups(N)] 's'"),
    c("group_value_stored_as_a_tile",
      grouped(ab_spec("", "{o: [M, N]}", ["group_reduce: {op: max, x: acc, out: s}", "store: {x: s, to: o}"])),
      (8, "o}"), "store.to: output 'o' has shape [M, N], but this step writes [M, groups(N)]"),
    c("partial_reduce_of_a_group_value",
      grouped(ab_spec("", "{ss: [M, tiles(N)]}", ["group_reduce: {op: sum, x: acc, out: s}",
                                                  "reduce: {op: sum, x: s, axis: cols, to: ss}"])), (8, "s,"),
      "reduce.x must be a tile, got group value [M, groups(N)] 's'"),
    # -- FP8 quantization (docs/fp8.md) ----------------------------------------------------------------------
    c("fp8_scale_without_column_group",
      ab_spec("", "{o: [M, N]}", ["fp8_scale: {x: acc, dtype: float8_e4m3fn, out: s}"] + GROUP_STEPS[1:]),
      (7, "fp8_scale"), "fp8_scale scales each column group, and the kernel declares none", "'column_group: 128'"),
    c("fp8_scale_of_a_double_width_tile",
      grouped(ab_spec("d: [M, 2*N]", "{o: {shape: [M, groups(N)], dtype: float32}, p: [M, N]}",
                      ["fp8_scale: {x: d, dtype: float8_e4m3fn, out: s}", "store: {x: s, to: o}",
                       "store: {x: acc, to: p}"])), (7, "d,"),
      "fp8_scale.x must be a tile of width N or N/2", "got tile [M, 2*N] 'd'"),
    c("fp8_scale_of_an_unknown_format",
      grouped(ab_spec("", "{o: {shape: [M, groups(N)], dtype: float32}}",
                      ["fp8_scale: {x: acc, dtype: float8_e4m3, out: s}", "store: {x: s, to: o}"])),
      (7, "float8_e4m3,"),
      "float8_e4m3fn", "float8_e5m2"),
    c("quantize_by_a_column_vector",
      ab_spec("w: [N]", "{o: {shape: [M, N], dtype: float8_e4m3fn}}",
              ["quantize: {x: acc, scale: w, dtype: float8_e4m3fn, out: q}", "store: {x: q, to: o}"]),
      (7, "w,"), "quantize.scale must be the scale of its group, a group value (fp8_scale's)", "got column vector"),
    c("fp8_scale_of_whole_rows",
      grouped(ab_spec("", "{o: {shape: [M], dtype: float32}}",
                      ["fp8_scale: {x: acc, dtype: float8_e4m3fn, out: s}", "store: {x: s, to: o}"]), "N"),
      (7, "fp8_scale"), "fp8_scale with column_group N (one scale per whole row) is not implemented"),
    c("fp8_scale_stored_narrower",
      grouped(ab_spec("", "{o: {shape: [M, N], dtype: float8_e4m3fn}, s_out: {shape: [M, groups(N)], dtype: bfloat16}}",
                      ["fp8_scale: {x: acc, dtype: float8_e4m3fn, out: s}",
                       "quantize: {x: acc, scale: s, dtype: float8_e4m3fn, out: q}", "store: {x: q, to: o}",
                       "store: {x: s, to: s_out}"])),
      (10, "s_out"), "'s' is an FP8 scale, which must be stored in float32", "has dtype bfloat16"),
    c("unquantized_store_to_fp8",
      ab_spec("", "{o: {shape: [M, N], dtype: float8_e4m3fn}}", ["store: {x: acc, to: o}"]), (7, "acc,"),
      "output 'o' has dtype float8_e4m3fn, and 'acc' is not a quantize value of that dtype"),
    c("quantize_to_the_other_fp8_format",
      grouped(ab_spec("", "{o: {shape: [M, N], dtype: float8_e5m2}}",
                      ["fp8_scale: {x: acc, dtype: float8_e4m3fn, out: s}",
                       "quantize: {x: acc, scale: s, dtype: float8_e4m3fn, out: q}", "store: {x: q, to: o}"])),
      (9, "q,"), "output 'o' has dtype float8_e5m2, and 'q' is not a quantize value of that dtype"),
    c("fp8_input", ab_spec("x8: {shape: [M, N], dtype: float8_e4m3fn}", "{o: [M, N]}",
                           ["add: {x: acc, y: x8, out: t}", "store: {x: t, to: o}"]), (4, "x8:"),
      "input 'x8' has dtype float8_e4m3fn; the only FP8 inputs are the gemm's operands"),
    c("fp8_row_output", ab_spec("r: [M]", "{o: {shape: [M], dtype: float8_e4m3fn}, t: [M, N]}",
                                ["store: {x: r, to: o}", "store: {x: acc, to: t}"]),
      (5, "o:"), "output 'o' has dtype float8_e4m3fn: FP8 outputs hold quantized tiles", "got shape [M]"),
    # -- FP8 GEMM operands (docs/fp8.md) ---------------------------------------------------------------------
    c("fp8_gemm_a_with_a_t_b", spec(gemm="{a: a, b: b}", inputs=f"{{a: {E4M3_MK}, b: [N, K]}}",
                                    outputs="{o: {shape: [M, N], dtype: float32}}", steps=["store: {x: acc, to: o}"]),
      (4, "b: ["), "gemm.b 'b' must be FP8 like gemm.a 'a' (float8_e4m3fn)", "got T"),
    c("fp8_gemm_a_with_a_float32_b",
      spec(gemm="{a: a, b: b}", inputs=f"{{a: {E4M3_MK}, b: {{shape: [N, K], dtype: float32}}}}",
           outputs="{o: {shape: [M, N], dtype: float32}}", steps=["store: {x: acc, to: o}"]),
      (4, "b: {"), "gemm.b 'b' must be FP8 like gemm.a 'a'", "got float32"),
    c("fp8_gemm_b_only", spec(gemm="{a: a, b: b}", inputs="{a: [M, K], b: {shape: [N, K], dtype: float8_e4m3fn}}",
                              outputs="{o: [M, N]}", steps=["store: {x: acc, to: o}"]),
      (4, "b: {"), "gemm.b 'b' takes the kernel's type T", "an FP8 gemm.b needs an FP8 gemm.a"),
    c("fp8_gemm_kn", spec(gemm="{a: a, b: b, b_layout: kn}", inputs=f"{{a: {E4M3_MK}, b: {E4M3_KN}}}",
                          outputs="{o: {shape: [M, N], dtype: float32}}", steps=["store: {x: acc, to: o}"]),
      (3, "{"), "FP8 operands take b_layout 'nk'", "got 'kn'"),
    c("fp8_gemm_output_of_type_t", spec(gemm="{a: a, b: b}", inputs=f"{{a: {E4M3_MK}, b: {E4M3_NK}}}",
                                        outputs="{o: [M, N]}", steps=["store: {x: acc, to: o}"]),
      (5, "o:"), "'o' has the kernel's type T, and a kernel with FP8 gemm operands has none",
      "'o: {shape: [M, N], dtype: bfloat16}'"),
    c("fp8_gemm_input_of_type_t", spec(gemm="{a: a, b: b}", inputs=f"{{a: {E4M3_MK}, b: {E4M3_NK}, r: [M]}}",
                                       outputs="{o: {shape: [M, N], dtype: float32}}",
                                       steps=["scale: {x: acc, by: r, out: t}", "store: {x: t, to: o}"]),
      (4, "r:"), "'r' has the kernel's type T, and a kernel with FP8 gemm operands has none"),
    c("fp8_gemm_cast_to_t", spec(gemm="{a: a, b: b}", inputs=f"{{a: {E4M3_MK}, b: {E4M3_NK}}}",
                                 outputs="{o: {shape: [M, N], dtype: float32}}",
                                 steps=["cast: {x: acc, dtype: T, out: t}", "store: {x: t, to: o}"]),
      (7, "T,"), "cast.dtype T is the type of the kernel's matrix inputs, and it has none"),
    # -- K-group scales of FP8 operands (gemm.scales, docs/fp8.md) ------------------------------------------
    c("kgroup_scales_of_t_operands",
      kg_spec(inputs=f"{{a: [M, K], b: [N, K], {KG_SA}, {KG_SB}}}", outputs="{o: [M, N]}"),
      (3, "{a: sa"), "gemm.scales: K-group scales dequantize FP8 operands, and gemm.a 'a' is not FP8"),
    c("kgroup_group_not_a_power_of_two", kg_spec(scales="{a: sa, b: sb, group: 100}"), (3, "100"),
      "gemm.scales.group must be a power of two from 32 to 512", "got a number (100)"),
    c("kgroup_group_below_a_k_step", kg_spec(scales="{a: sa, b: sb, group: 8}"), (3, "8}"),
      "gemm.scales.group must be a power of two from 32 to 512", "each K step of the mainloop"),
    c("kgroup_no_group", kg_spec(scales="{a: sa, b: sb}"), (3, "{a: sa"), "gemm.scales is missing 'group'"),
    c("kgroup_no_scales", kg_spec(scales="{group: 128}", inputs=f"{{a: {E4M3_MK}, b: {E4M3_NK}}}"), (3, "{group"),
      "gemm.scales names no scales", "[M, groups(K)]", "[blocks(N), groups(K)]"),
    c("kgroup_unknown_key", kg_spec(scales="{a: sa, b: sb, group: 128, granularity: 1}"), (3, "granularity"),
      "unknown key 'granularity' in gemm.scales", "expected one of: a, b, group"),
    c("kgroup_scales_not_a_mapping", kg_spec(scales="[sa, sb]"), (3, "[sa"), "gemm.scales must be a mapping"),
    c("kgroup_scale_not_declared", kg_spec(inputs=f"{{a: {E4M3_MK}, b: {E4M3_NK}, {KG_SB}}}"), (3, "{a: sa"),
      "gemm.scales.a 'sa' is not among the inputs", "'sa: {shape: [M, groups(K)], dtype: float32}'"),
    c("kgroup_a_scale_per_row", kg_spec(inputs=f"{{a: {E4M3_MK}, b: {E4M3_NK}, sa: {{shape: [M], dtype: float32}}, "
                                               f"{KG_SB}}}"), (4, "sa:"),
      "gemm.scales.a 'sa' must be [M, groups(K)] float32 (one per row of a and group of K), got [M] float32"),
    c("kgroup_b_scale_of_type_t",
      kg_spec(inputs=f"{{a: {E4M3_MK}, b: {E4M3_NK}, {KG_SA}, sb: [blocks(N), groups(K)]}}"),
      (4, "sb:"), "gemm.scales.b 'sb' must be [blocks(N), groups(K)] float32 (one per 128 x 128 block of b",
      "got [blocks(N), groups(K)] T"),
    c("kgroup_scale_is_an_operand", kg_spec(scales="{a: a, group: 128}", inputs=f"{{a: {E4M3_MK}, b: {E4M3_NK}}}"),
      (3, "{a: a, group"), "gemm.scales.a 'a' is a gemm operand"),
    c("kgroup_one_scale_for_both", kg_spec(scales="{a: sa, b: sa, group: 128}", inputs=f"{{a: {E4M3_MK}, b: {E4M3_NK}, "
                                                                                      f"{KG_SA}}}"),
      (3, "{a: sa"), "gemm.scales.a and gemm.scales.b must be different inputs"),
    c("kgroup_dims_of_another_input", kg_spec(inputs=f"{{a: {E4M3_MK}, b: {E4M3_NK}, {KG_SA}, {KG_SB}, "
                                                     "r: {shape: [M, groups(K)], dtype: float32}}"), (4, "r:"),
      "input 'r' has shape [M, groups(K)]: groups(K) and blocks(N) are the dims of the gemm's K-group scales"),
    c("kgroup_dims_of_an_output", kg_spec(outputs="{o: {shape: [M, N], dtype: float32}, "
                                                  "s: {shape: [blocks(N), groups(K)], dtype: float32}}"),
      (5, "s: {shape: [b"),
      "output 's' has shape [blocks(N), groups(K)]", count=2),  # and: output 's' is never written
    c("kgroup_scale_in_the_epilogue", kg_spec(steps=["scale: {x: acc, by: sa, out: t}", "store: {x: t, to: o}"]),
      (7, "sa,"), "scale.by: 'sa' is a K-group scale of the gemm (gemm.scales), which the mainloop applies"),
    # -- select ----------------------------------------------------------------------------------------------
    c("select_with_non_index_input", ab_spec("target: [M]", "{picked: [M]}",
                                             ["select: {x: acc, index: target, to: picked}"]), (7, "target"),
      "select.index: input 'target' has dtype T", "{shape: [M], dtype: index}"),
    c("select_with_undeclared_index", ab_spec("", "{picked: [M]}", ["select: {x: acc, index: target, to: picked}"]),
      (7, "target"), "select.index: 'target' is not an input"),
]


def _write(tmp_path: Path, name: str, content: str | bytes) -> Path:
    p = tmp_path / f"{name}.yaml"
    if isinstance(content, bytes):
        p.write_bytes(content)
    else:
        p.write_text(content, encoding="utf-8")
    return p


def _errors(*paths: Path) -> list[SpecError]:
    with pytest.raises(ValidationFailed) as info:
        api.load(list(paths))
    return info.value.errors


def _line_of(case: Case, line: int) -> str:
    text = case.text.decode("utf-8", "replace") if isinstance(case.text, bytes) else case.text
    return text.split("\n")[line - 1]


def test_the_base_spec_is_valid(tmp_path):
    """The cases below are one change away from this spec; it must be valid for them to mean anything."""
    (checked,) = api.load([_write(tmp_path, "base", spec())])
    assert checked.kernel.name == "k1"
    assert [s.op for s in checked.kernel.steps] == ["add", "store", "reduce", "scale", "store"]
    assert checked.kernel.steps[2].loc.line == 9
    (small,) = api.load([_write(tmp_path, "small", ab_spec("", "{o: [M, N]}", ["store: {x: acc, to: o}"]))])
    assert small.kernel.input("a") and small.kernel.output("o")


def test_the_corpus_is_large_and_distinct():
    assert len(CASES) >= 30
    assert len({c.id for c in CASES}) == len(CASES)
    assert len({c.text for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_spec(tmp_path, case: Case):
    path = _write(tmp_path, case.id, case.text)
    start = time.perf_counter()
    errors = _errors(path)
    elapsed = time.perf_counter() - start
    listing = "\n".join(str(e) for e in errors)
    assert len(errors) == case.count, f"expected {case.count} error(s), got:\n{listing}"

    line, token = case.at
    if isinstance(token, str):
        source_line = _line_of(case, line)
        assert token in source_line, f"test bug: {token!r} is not on line {line}: {source_line!r}"
        col = source_line.index(token) + 1
    else:
        col = token
    matching = [e for e in errors if e.loc.line == line and (col is None or e.loc.col == col)]
    assert matching, f"no error at {path}:{line}:{col}; got:\n{listing}"
    err = matching[0]
    for w in case.words:
        assert w in err.message, f"{w!r} not in the message: {err.message}"

    # The error names the file as given, and prints as file:line:col: message on one line.
    assert err.loc.file == str(path)
    for e in errors:
        assert str(e) == f"{e.loc.file}:{e.loc.line}:{e.loc.col}: {e.message}"
        assert "\n" not in str(e) and "\r" not in str(e)
        assert "Traceback" not in e.message
    assert elapsed < 2.0, f"{case.id} took {elapsed:.2f} s to fail"


def test_python_tags_run_nothing(tmp_path):
    """An apply tag that would create a folder if it were ever constructed; the folder must not appear."""
    target = tmp_path / "pwned"
    for i, tag in enumerate(("!!python/object/apply:os.mkdir", "!!python/object/apply:pathlib.Path.mkdir",
                             "!!python/object/new:os.mkdir")):
        path = _write(tmp_path, f"evil{i}", spec(kernel=f'{tag} ["{target}"]'))
        (err,) = _errors(path)
        assert (err.loc.line, err.loc.col) == (1, 9) and "not allowed" in err.message
    assert not target.exists()


def test_hostile_inputs_fail_fast(tmp_path):
    """Nesting far past the recursion limit and a 100 MiB file both fail in well under a second, with a
    message instead of a RecursionError or a MemoryError."""
    deep = _write(tmp_path, "deep", "kernel: " + "[" * 100_000 + "]" * 100_000)
    big = tmp_path / "big.yaml"
    with big.open("wb") as f:  # sparse: takes no disk space, reads as zeros
        f.write(spec().encode())
        f.truncate(100 * 1024 * 1024)
    for path, words in ((deep, "nesting is too deep"), (big, "104,857,600 bytes, more than the 256 KiB")):
        start = time.perf_counter()
        (err,) = _errors(path)
        assert time.perf_counter() - start < 1.0
        assert words in err.message


def test_wide_flat_yaml_is_bounded(tmp_path):
    """Many nodes in little text (a flow list of 30k empty strings) is stopped by the node limit."""
    path = _write(tmp_path, "wide", "kernel: [" + "'', " * 30_000 + "]\n")
    (err,) = _errors(path)
    assert err.loc.line == 1 and "more than 20,000 YAML nodes" in err.message


def test_all_errors_of_a_file_are_reported_together(tmp_path):
    """Three independent mistakes (an unused input, a store of the wrong shape, an unused value) give exactly
    three errors, in line order."""
    text = spec(inputs="{y: [M, K], w_o: [N, K], x: [M, N], wn: [N], bias: [N]}",           # 4: unused input
                outputs="{x_out: [M, N], h: [M], ss: [M, tiles(N)]}",                        # 11: store shape
                steps=STEPS[:2] + ["reduce: {op: sumsq, x: x_new, axis: cols, to: ss}",
                                   "scale: {x: x_new, by: wn, out: hv}", "store: {x: hv, to: h}",
                                   "exp: {x: hv, out: unused}"])                             # 12: unused value
    errors = _errors(_write(tmp_path, "three", text))
    assert [(e.loc.line, e.message.split(" ")[0]) for e in errors] == [
        (4, "input"), (11, "store.to:"), (12, "value")], "\n".join(map(str, errors))


def test_structural_errors_are_reported_together(tmp_path):
    """The loader, too, reports every structural problem of a file at once: a bad name, a bad gemm layout and
    a bad reduce axis. (Rules across steps, such as unused values, run once the structure is sound.)"""
    text = spec(kernel="K1", gemm="{a: y, b: w_o, b_layout: nt}",
                steps=STEPS[:2] + ["reduce: {op: sumsq, x: x_new, axis: col, to: ss}"] + STEPS[3:])
    errors = _errors(_write(tmp_path, "structural", text))
    assert [e.loc.line for e in errors] == [1, 3, 9], "\n".join(map(str, errors))


def test_errors_of_several_files_are_reported_together(tmp_path):
    a = _write(tmp_path, "a_bad", spec(kernel="ka", gemm="{a: y, b: w_o, b_layout: nt}"))
    b = _write(tmp_path, "b_bad", spec(kernel="kb", doc="!!binary aGk="))
    good = _write(tmp_path, "c_good", spec(kernel="kc"))
    errors = _errors(tmp_path)
    assert [(e.loc.file, e.loc.line) for e in errors] == [(str(a), 3), (str(b), 2)]
    assert good.exists()


def test_same_kernel_name_in_two_files_names_both(tmp_path):
    first = _write(tmp_path, "first", spec(kernel="same_name"))
    second = _write(tmp_path, "second", spec(kernel="same_name"))
    (err,) = _errors(tmp_path)
    assert err.loc.file == str(second) and err.loc.line == 1
    assert "kernel 'same_name' is already defined in" in err.message
    assert str(first) in err.message
    assert "unique" in err.message


def test_a_file_that_is_no_spec_shows_nothing_of_itself(tmp_path):
    """A spec linked to another file (outside the specs folder): the error says what is wrong, at most with
    the first word of a value, never the file's content."""
    secret = tmp_path / "secret.txt"
    specs = tmp_path / "specs"
    specs.mkdir()
    for content in ("TOKEN=abc123 hunter2 rest of the line\nsecond line\n",
                    "kernel: k1\ndoc: [TOKEN=abc123 hunter2 rest]\n"):
        secret.write_text(content)
        (specs / "k.yaml").unlink(missing_ok=True)
        (specs / "k.yaml").symlink_to(secret)
        errors = _errors(specs)
        assert errors and not any("hunter2" in e.message for e in errors), "\n".join(map(str, errors))


def test_unsafe_spec_path_is_refused(tmp_path):
    """Spec paths are written into generated headers and comments; odd characters are refused."""
    d = tmp_path / "odd dir"
    d.mkdir()
    _write(d, "k1", spec())
    (err,) = _errors(d)
    assert "letters, digits and '_./-'" in err.message and "rename" in err.message


def test_byte_order_mark_and_windows_line_ends_are_accepted(tmp_path):
    bom = _write(tmp_path, "bom", b"\xef\xbb\xbf" + spec(kernel="with_bom").encode())
    crlf = _write(tmp_path, "crlf", spec(kernel="with_crlf").replace("\n", "\r\n").encode())
    assert sorted(c.kernel.name for c in api.load([bom, crlf])) == ["with_bom", "with_crlf"]
    (err,) = _errors(_write(tmp_path, "crlf_bad", spec(gemm="{a: y, b: w_o, b_layout: nt}").replace("\n", "\r\n")))
    assert (err.loc.line, err.loc.col) == (3, 32)


@pytest.mark.parametrize("doc", [
    "Uses 'single' and \"double\" quotes, ''' and a trailing period.",
    "Unicode is fine: α·β → γ, ∑ x².",
    "\"Starts with a quote.",
    "A # hash and {braces} and a {{ jinja }} look-alike and a %s.",
])
def test_accepted_docs_give_valid_python(tmp_path, doc):
    """Docs that the loader accepts end up in docstrings; the generated module must still compile."""
    import yaml

    path = _write(tmp_path, "doc_ok", spec(doc=yaml.safe_dump(doc, width=1000).strip().removesuffix("\n...")))
    generated = api.generate([path], out=tmp_path / "gen")
    assert generated.files, "nothing generated"
    for rel, source in generated.files.items():
        compile(source, rel, "exec")
    assert doc in generated.files["kernels/k1.py"]


# -- block specs -----------------------------------------------------------------------------------------------
STATS_KERNEL = (REPO / "specs" / "rmsnorm_stats.yaml").read_text(encoding="utf-8")
STATS_BLOCK = """\
block: {name}
doc: RMSNorm statistics.
attrs:
  {attrs}
{params}inputs:
  x: [M, {dim}]
  wn: {{shape: [dim], grad: false}}
outputs:
  h: {{shape: [M, dim], grad: false}}
  rstd: {{shape: [M], dtype: float32, grad: false}}
forward:
  - rmsnorm_stats: {{x: x, wn: wn, h: h, ss: {ss}}}
  - {rstd}: {{x: {ss}, size: dim, eps: eps, out: rstd}}
"""


def stats_block(name="stats", attrs="dim: int, eps: 1.0e-6", params="", dim="dim", ss="ss", rstd="rstd") -> str:
    """A block around rmsnorm_stats; `attrs` is the flow mapping's inside, `params` whole lines."""
    return STATS_BLOCK.format(name=name, attrs="{" + attrs + "}", params=params, dim=dim, ss=ss, rstd=rstd) \
        .replace("attrs:\n  {", "attrs: {")


def _block_errors(tmp_path: Path, **blocks: str) -> list[SpecError]:
    _write(tmp_path, "rmsnorm_stats", STATS_KERNEL)
    for name, text in blocks.items():
        _write(tmp_path, name, text)
    return _errors(tmp_path)


@pytest.mark.parametrize("kwargs, line, words", [
    ({"dim": "dim/0"}, 5, "dimension 'dim/0' must be M, an int attr"),
    ({"dim": "0*dim"}, 5, "dimension '0*dim' must be M"),
    ({"params": "params: {eps: [dim]}\n"}, 4, "'eps' is reserved or an attr"),
    ({"attrs": "dim: int, eps: 1.0e-6, training: 1"}, 3, "'training' is an attribute of the generated nn.Module"),
    ({"params": "params: {forward: [dim]}\n"}, 4, "'forward' is an attribute of the generated nn.Module"),
    ({"attrs": "dim: int, eps: 1.0e-6, device: 1"}, 3, "'device' is a keyword argument of every generated nn.Module"),
    ({"ss": "ss_sum"}, 11, "'ss_sum' is reserved"),
    ({"rstd": '"rs\\x1b[31mtd"'}, 12, "'rs\\x1b[31mtd' is not a valid name"),  # a terminal escape code
], ids=["divide-by-zero", "zero-times", "param-named-like-attr", "attr-training", "param-forward", "attr-device",
         "derived-sum",
        "escape-code-op"])
def test_bad_block(tmp_path, kwargs, line, words):
    errors = _block_errors(tmp_path, b=stats_block(**kwargs))
    listing = "\n".join(map(str, errors))
    assert any(e.loc.line == line and words in e.message for e in errors), listing
    assert all(e.message.isprintable() for e in errors), listing


def test_module_attributes_are_those_of_torch():
    """A block's attrs and parameters become attributes of an nn.Module: the names it has are refused."""
    # in a fresh interpreter: other libraries imported by the suite (transformers) add methods to nn.Module
    names = subprocess.run([sys.executable, "-c", "import torch.nn as nn; print(*dir(nn.Module()))"],
                           capture_output=True, text=True, check=True).stdout.split()
    public = {a for a in names if IDENTIFIER.fullmatch(a)}
    assert public <= MODULE_ATTRIBUTES, f"add to codagen/names.py MODULE_ATTRIBUTES: {public - MODULE_ATTRIBUTES}"


def test_row_chunks_named_by_text_that_is_no_name(tmp_path):
    """backward_row_chunks names an int attr; other text (here a terminal escape code) is refused, escaped."""
    errors = _block_errors(tmp_path, b=stats_block() + 'backward_row_chunks: "\\x1b[2J"\n')
    assert [(e.loc.line, e.message.split(":")[0]) for e in errors] == [(13, "backward_row_chunks")]
    assert "'\\x1b[2J' is not a valid name" in errors[0].message


@pytest.mark.parametrize("first, second, cls", [("stats", "stats_function", "StatsFunction"),
                                                 ("norm1", "norm_1", "Norm1")])
def test_block_class_names_must_not_collide(tmp_path, first, second, cls):
    (err,) = _block_errors(tmp_path, a=stats_block(name=first), b=stats_block(name=second))
    assert f"block '{second}' generates the class {cls}, as block '{first}'" in err.message


def test_attrs_with_and_without_defaults_in_any_order(tmp_path):
    """A default before a required attr: the constructor takes the required ones first, each group in spec
    order, and the module compiles."""
    _write(tmp_path, "rmsnorm_stats", STATS_KERNEL)
    _write(tmp_path, "b", stats_block(attrs="eps: 1.0e-6, dim: int, chunk: 64, width: int"))
    source = api.generate([tmp_path], out=tmp_path / "gen").files["blocks/stats.py"]
    compile(source, "blocks/stats.py", "exec")
    assert "def __init__(self, dim, width, eps=1e-06, chunk=64, *, device=None, dtype=None):" in source


def test_build_refuses_generated_code_that_does_not_compile(tmp_path, monkeypatch):
    """Were a template to print broken Python for an accepted spec, the build fails at that spec and writes
    nothing (a bug of codagen's, reported as such)."""
    import dataclasses

    from codagen.emit import backends

    path = _write(tmp_path, "k1", spec())
    tl = backends.backend("tl")
    broken = dataclasses.replace(tl, render=lambda *a: tl.render(*a).replace("def launch(", "def launch(("))
    monkeypatch.setattr(backends, "BACKENDS", tuple(broken if b is tl else b for b in backends.BACKENDS))
    with pytest.raises(ValidationFailed) as info:
        api.build([path], out=tmp_path / "gen")
    (err,) = info.value.errors
    assert (err.loc.file, err.loc.line) == (path.relative_to(tmp_path).as_posix(), 1)  # from the folder of gen
    assert "codagen generated kernels/k1.py, which does not compile" in err.message and "bug" in err.message
    assert not (tmp_path / "gen").exists()
