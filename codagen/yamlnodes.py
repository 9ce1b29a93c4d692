"""Safe YAML to a tree of located nodes. Only plain scalars, sequences and mappings; no tags, anchors or
aliases, no duplicate keys; bounded in size and depth. Nothing is ever constructed as a Python object."""
from __future__ import annotations

from dataclasses import dataclass

import yaml

from .errors import SpecError
from .model import Location

MAX_BYTES = 256 * 1024
MAX_DEPTH = 16
MAX_NODES = 20_000

_PLAIN_TAGS = {
    "tag:yaml.org,2002:str": "str",
    "tag:yaml.org,2002:int": "int",
    "tag:yaml.org,2002:float": "float",
    "tag:yaml.org,2002:bool": "bool",
    "tag:yaml.org,2002:null": "null",
    "tag:yaml.org,2002:map": "map",
    "tag:yaml.org,2002:seq": "seq",
}


@dataclass
class Node:
    value: object  # dict[str, Node] | list[Node] | str | int | float | bool | None
    loc: Location
    key_locs: dict | None = None  # for mappings: key -> Location of the key

    @property
    def type_name(self) -> str:
        v = self.value
        if isinstance(v, dict):
            return "a mapping"
        if isinstance(v, list):
            return "a list"
        if v is None:
            return "nothing (null)"
        if isinstance(v, bool):
            return f"a boolean ({str(v).lower()})"
        if isinstance(v, (int, float)):
            return f"a number ({v!r})"
        return f"'{v}'"


def _loc(path: str, mark) -> Location:
    return Location(path, mark.line + 1, mark.column + 1)


def load(text: str, path: str) -> Node:
    """Parse one YAML document into located nodes; raises SpecError on anything unsafe or malformed."""
    if len(text.encode("utf-8", "surrogatepass")) > MAX_BYTES:
        raise SpecError(Location(path, 1, 1), f"spec is larger than {MAX_BYTES // 1024} KiB; is this the right file?")
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        loc = _loc(path, mark) if mark else Location(path, 1, 1)
        raise SpecError(loc, f"YAML syntax error: {e.problem or e.context}") from None
    except yaml.YAMLError as e:  # e.g. a second document
        raise SpecError(Location(path, 1, 1), f"YAML error: {e}") from None
    except RecursionError:
        raise SpecError(Location(path, 1, 1), f"YAML nesting is too deep (more than {MAX_DEPTH} levels)") from None
    if root is None:
        raise SpecError(Location(path, 1, 1), "spec is empty; expected a mapping with 'kernel:' or 'block:'")
    return _Walker(path).walk(root, 0)


class _Walker:
    def __init__(self, path: str):
        self.path = path
        self.seen: set[int] = set()

    def walk(self, node: yaml.Node, depth: int) -> Node:
        loc = _loc(self.path, node.start_mark)
        if depth > MAX_DEPTH:
            raise SpecError(loc, f"YAML nesting is too deep (more than {MAX_DEPTH} levels)")
        if id(node) in self.seen:
            raise SpecError(loc, "YAML anchors and aliases are not allowed in specs; write the value out")
        self.seen.add(id(node))
        if len(self.seen) > MAX_NODES:
            raise SpecError(loc, f"spec has more than {MAX_NODES} YAML nodes; is this the right file?")
        kind = _PLAIN_TAGS.get(node.tag)
        if kind is None:
            raise SpecError(loc, f"YAML tag '{node.tag}' is not allowed; specs hold plain values only")
        if isinstance(node, yaml.MappingNode):
            out: dict[str, Node] = {}
            key_locs: dict[str, Location] = {}
            for k, v in node.value:
                kloc = _loc(self.path, k.start_mark)
                if not isinstance(k, yaml.ScalarNode) or _PLAIN_TAGS.get(k.tag) != "str":
                    raise SpecError(kloc, "mapping keys must be plain names")
                if k.value in out:
                    raise SpecError(kloc, f"duplicate key '{k.value}' (first at line {key_locs[k.value].line})")
                key_locs[k.value] = kloc
                out[k.value] = self.walk(v, depth + 1)
            return Node(out, loc, key_locs)
        if isinstance(node, yaml.SequenceNode):
            return Node([self.walk(v, depth + 1) for v in node.value], loc)
        return Node(_scalar(node, kind, loc), loc)


def _scalar(node: yaml.ScalarNode, kind: str, loc: Location):
    constructor = yaml.SafeLoader.__new__(yaml.SafeLoader)  # only its plain-scalar constructors are used
    if kind == "str":
        return node.value
    if kind == "null":
        return None
    if kind == "bool":
        return yaml.SafeLoader.construct_yaml_bool(constructor, node)
    if kind == "int":
        return yaml.SafeLoader.construct_yaml_int(constructor, node)
    value = yaml.SafeLoader.construct_yaml_float(constructor, node)
    if value != value or value in (float("inf"), float("-inf")):
        raise SpecError(loc, "numbers must be finite")
    return value
