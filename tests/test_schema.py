"""The editor schema, codagen/schema/kernel.schema.json, against the code.

(a) Always: its hand-written parts, the enums (dimensions, dtypes, b_layout) and name rules, equal the model's,
so the schema cannot drift from the language; its step section is generated from the primitive registry.
(b) With the `jsonschema` package (a test dependency): every kernel spec under specs/ and tests/specs/
validates against the schema, and documents that break the structure are rejected by both the schema and
codagen."""
from __future__ import annotations

import builtins
import copy
import json
import keyword
from pathlib import Path

import pytest
import yaml

from codagen import api, loader
from codagen.errors import ValidationFailed
from codagen.loader import MAX_STEPS
from codagen.model import BLayout, Dim, DType
from codagen.names import IDENTIFIER, RESERVED, name_problem

REPO = Path(__file__).resolve().parent.parent
SCHEMA_PATH = REPO / "codagen" / "schema" / "kernel.schema.json"
SCHEMA = json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))
DEFS = SCHEMA["$defs"]
NO_JSONSCHEMA = "jsonschema is not installed (pip install jsonschema): specs are not validated against the schema"


# -- (a) the schema equals the code -----------------------------------------------------------------------
# Its step section is generated from the registry: tests/test_registry.py checks that it is up to date.
def test_a_step_is_one_primitive():
    step = DEFS["step"]
    assert (step["type"], step["minProperties"], step["maxProperties"], step["additionalProperties"]) == (
        "object", 1, 1, False)
    assert SCHEMA["properties"]["epilogue"]["minItems"] == 1
    assert SCHEMA["properties"]["epilogue"]["maxItems"] == MAX_STEPS


def test_top_level_keys():
    assert list(SCHEMA["properties"]) == ["kernel", "doc", "gemm", "column_group", "inputs", "outputs", "epilogue"]
    assert SCHEMA["properties"]["column_group"]["enum"] == [2 ** i for i in range(1, 10)] + ["N"]
    assert SCHEMA["required"] == ["kernel", "doc", "inputs", "outputs", "epilogue"]
    gemm = SCHEMA["properties"]["gemm"]
    assert list(gemm["properties"]) == ["a", "b", "b_layout", "scales"] and gemm["required"] == ["a", "b"]
    scales = gemm["properties"]["scales"]
    assert list(scales["properties"]) == ["a", "b", "group"] and scales["required"] == ["group"]
    assert scales["properties"]["group"]["enum"] == [
        2 ** i for i in range(10) if loader.MIN_K_GROUP <= 2 ** i <= loader.MAX_K_GROUP]
    assert gemm["properties"]["b_layout"]["enum"] == [layout.value for layout in BLayout]


def test_every_mapping_is_closed():
    """additionalProperties is false wherever properties are listed, so a misspelled key is flagged."""
    def walk(node, path):
        if isinstance(node, dict):
            if "properties" in node:
                assert node.get("additionalProperties") is False, f"{path} admits unknown keys"
            for key, value in node.items():
                walk(value, f"{path}/{key}")
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, f"{path}/{i}")

    walk(SCHEMA, "#")


def test_dimensions_and_dtypes():
    tiles = (Dim.TILES_M, Dim.TILES_N)
    assert DEFS["input_dim"]["enum"] == [d.value for d in Dim if d not in tiles]
    k_grouped = (Dim.K, Dim.GROUPS_K, Dim.BLOCKS_N)  # K and the K-group scales' dims: inputs only
    assert DEFS["output_dim"]["enum"] == [d.value for d in Dim if d not in k_grouped]
    assert DEFS["dtype"]["enum"] == [d.value for d in DType]
    output_decl = DEFS["output"]["oneOf"][1]["properties"]
    assert output_decl["dtype"]["enum"] == [d.value for d in DType if d is not DType.INDEX]
    assert DEFS["input"]["oneOf"][0]["const"] == "scalar"


def test_name_rules():
    assert DEFS["name"]["pattern"] == f"^{IDENTIFIER.pattern}$"
    assert DEFS["reserved_generated"]["enum"] == sorted(RESERVED), (
        "codagen/names.py RESERVED changed: run python -m codagen.primitives.docs")
    for name in RESERVED:
        assert name_problem(name), f"{name} is in codagen/names.py RESERVED but codagen accepts it"
    python_names = set(DEFS["reserved_python"]["enum"])
    for name in python_names:  # the schema never refuses a name that codagen accepts
        assert name_problem(name), f"{name} is in $defs.reserved_python but codagen accepts it"
    python = {n for n in (*keyword.kwlist, *keyword.softkwlist, *dir(builtins)) if IDENTIFIER.fullmatch(n)}
    assert python <= python_names, f"add to $defs.reserved_python: {sorted(python - python_names)}"


# -- (b) specs against the schema -------------------------------------------------------------------------
def _jsonschema():
    return pytest.importorskip("jsonschema", reason=NO_JSONSCHEMA)


def _spec_files() -> list[Path]:
    return [p for folder in (REPO / "specs", REPO / "tests" / "specs") if folder.is_dir()
            for p in sorted(folder.rglob("*")) if p.suffix in (".yaml", ".yml") and p.is_file()]


def test_schema_is_valid_json_schema():
    jsonschema = _jsonschema()
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    jsonschema.Draft7Validator.check_schema(SCHEMA)  # editors that implement only draft-07 read it too


@pytest.mark.parametrize("path", _spec_files(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_repo_specs_validate(path):
    """Every kernel spec that codagen accepts, the schema accepts."""
    jsonschema = _jsonschema()
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    if isinstance(data, dict) and "block" in data:
        pytest.skip("a block spec: kernel.schema.json describes kernel specs only")
    try:
        api.load([path])
    except ValidationFailed:
        pytest.skip("codagen rejects this spec (a negative test case?), so the schema may too")
    errors = sorted(jsonschema.Draft202012Validator(SCHEMA).iter_errors(data), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors)


BASE = {
    "kernel": "k1",
    "doc": "Out-projection with the residual add and the RMSNorm statistics.",
    "gemm": {"a": "y", "b": "w_o", "b_layout": "nk"},
    "inputs": {"y": ["M", "K"], "w_o": ["N", "K"], "x": ["M", "N"], "wn": ["N"], "eps": "scalar"},
    "outputs": {"x_out": ["M", "N"], "h": {"shape": ["M", "N"], "dtype": "bfloat16"}, "ss": ["M", "tiles(N)"]},
    "epilogue": [
        {"add": {"x": "acc", "y": "x", "out": "x_new"}},
        {"store": {"x": "x_new", "to": "x_out"}},
        {"reduce": {"op": "sumsq", "x": "x_new", "axis": "cols", "to": "ss"}},
        {"scale": {"x": "x_new", "by": "wn", "out": "hv"}},
        {"mul": {"x": "hv", "y": "eps", "out": "hw"}},
        {"mul": {"x": 0.5, "y": "hw", "out": "hh"}},
        {"store": {"x": "hh", "to": "h"}},
    ],
}


def _mutate(change):
    def build():
        doc = copy.deepcopy(BASE)
        change(doc)
        return doc
    return build


INVALID = {
    "unknown top-level key": _mutate(lambda d: d.update(block="b")),
    "missing doc": _mutate(lambda d: d.pop("doc")),
    "unknown gemm key": _mutate(lambda d: d["gemm"].update(c="x")),
    "bad b_layout": _mutate(lambda d: d["gemm"].update(b_layout="nt")),
    "unknown dimension": _mutate(lambda d: d["inputs"].update(x=["M", "P"])),
    "tiles in an input": _mutate(lambda d: d["inputs"].update(x=["M", "tiles(N)"])),
    "three dimensions": _mutate(lambda d: d["outputs"].update(x_out=["M", "N", "N"])),
    "bad dtype": _mutate(lambda d: d["outputs"].update(h={"shape": ["M", "N"], "dtype": "float64"})),
    "unknown output key": _mutate(lambda d: d["outputs"].update(h={"shape": ["M", "N"], "inplce": True})),
    "inplace not a boolean": _mutate(lambda d: d["outputs"].update(h={"shape": ["M", "N"], "inplace": "yes"})),
    "capital letter in a name": _mutate(lambda d: d.update(kernel="K1")),
    "reserved name": _mutate(lambda d: d["epilogue"][3]["scale"].update(out="config")),
    "module name": _mutate(lambda d: d["epilogue"][3]["scale"].update(out="tl")),
    "name starting with '_'": _mutate(lambda d: d["epilogue"][3]["scale"].update(out="_hv")),
    "builtin name": _mutate(lambda d: d["inputs"].update(sum=["M"])),
    "empty epilogue": _mutate(lambda d: d.update(epilogue=[])),
    "two primitives in one step": _mutate(lambda d: d["epilogue"][0].update(store={"x": "acc", "to": "h"})),
    "unknown primitive": _mutate(lambda d: d["epilogue"].insert(0, {"mean": {"x": "acc", "out": "mu"}})),
    "unknown argument": _mutate(lambda d: d["epilogue"][3]["scale"].update(along="cols")),
    "missing argument": _mutate(lambda d: d["epilogue"][2]["reduce"].pop("axis")),
    "bad reduce.op": _mutate(lambda d: d["epilogue"][2]["reduce"].update(op="mean")),
    "bad reduce.axis": _mutate(lambda d: d["epilogue"][2]["reduce"].update(axis="columns")),
    "number where a value name is needed": _mutate(lambda d: d["epilogue"][1]["store"].update(x=1.0)),
    "boolean operand": _mutate(lambda d: d["epilogue"][5]["mul"].update(x=True)),
    "bad cast.dtype": _mutate(lambda d: d["epilogue"].insert(
        4, {"cast": {"x": "hv", "dtype": "float64", "out": "hb"}})),
}


@pytest.mark.parametrize("case", list(INVALID))
def test_invalid_documents_are_rejected(case, tmp_path):
    jsonschema = _jsonschema()
    validator = jsonschema.Draft202012Validator(SCHEMA)
    assert validator.is_valid(BASE), list(validator.iter_errors(BASE))
    doc = INVALID[case]()
    assert not validator.is_valid(doc), f"the schema accepts a spec with a {case}"
    # and codagen rejects it too: the schema is never stricter than the language
    spec = tmp_path / "k1.yaml"
    spec.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    with pytest.raises(ValidationFailed):
        api.load([spec])


def test_base_document_is_a_valid_kernel(tmp_path):
    spec = tmp_path / "k1.yaml"
    spec.write_text(yaml.safe_dump(BASE, sort_keys=False), encoding="utf-8")
    assert len(api.load([spec])) == 1
