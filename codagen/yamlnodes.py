"""Safe YAML to a tree of located nodes. Only plain scalars, sequences and mappings; no tags, anchors or
aliases, no duplicate keys; bounded in size and depth. Nothing is ever constructed as a Python object."""
from __future__ import annotations

import re
from dataclasses import dataclass

import yaml

from .errors import SpecError
from .model import Location

MAX_BYTES = 256 * 1024
MAX_DEPTH = 16
MAX_NODES = 20_000
FLOAT32_MAX = 3.4028234663852886e38  # numbers are fp32 in kernels: larger ones would be inf
FLOAT32_TINY = 1.401298464324817e-45  # the smallest subnormal; nonzero numbers up to half of it round to 0

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
        return f"'{_one_line(v)}'"


def _loc(path: str, mark) -> Location:
    return Location(path, mark.line + 1, mark.column + 1)


def load(text: str, path: str) -> Node:
    """Parse one YAML document into located nodes; raises SpecError on anything unsafe or malformed."""
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_BYTES:
        raise SpecError(Location(path, 1, 1), too_large(size))
    try:
        _check_events(text, path)  # bounded and tag/anchor-free before the (recursive) composer runs
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        loc = _loc(path, mark) if mark else Location(path, 1, 1)
        problem = e.problem or e.context or "malformed YAML"
        context = ""
        if e.problem and e.context:
            cm = e.context_mark
            where = f" that starts at line {cm.line + 1}, column {cm.column + 1}" if cm and cm is not mark else ""
            context = f" ({e.context}{where})"
        hint = _SYNTAX_HINTS.get(problem, "")
        raise SpecError(loc, f"YAML syntax error: {problem}{context}{hint}") from None
    except yaml.reader.ReaderError as e:  # a control character in the text
        line = text.count("\n", 0, e.position) + 1
        col = e.position - (text.rfind("\n", 0, e.position) + 1) + 1
        raise SpecError(Location(path, line, col), f"the control character U+{e.character:04X} is not allowed in "
                                                   "a spec; remove it") from None
    except yaml.YAMLError as e:
        raise SpecError(Location(path, 1, 1), f"YAML error: {_one_line(str(e), 200)}") from None
    if root is None:
        raise SpecError(Location(path, 1, 1), "spec is empty; expected a mapping with 'kernel:' or 'block:'")
    return _Walker(path).walk(root, 0)


_SYNTAX_HINTS = {
    "mapping values are not allowed here": "; a ': ' inside unquoted text starts a mapping: put the text in "
                                           "quotes, or check the indentation of this line",
    "found character '\\t' that cannot start any token": "; indent with spaces, not tabs",
}


def too_large(size: int) -> str:
    return (f"spec is {size:,} bytes, more than the {MAX_BYTES // 1024} KiB a spec may have; "
            "is this the right file?")


def _check_events(text: str, path: str) -> None:
    """One flat pass over the parser's events (no recursion, nothing built): rejects anchors, aliases and
    explicit tags where they are written, and stops as soon as nesting or size exceeds the limits, so a
    hostile file fails fast with its location instead of exhausting the stack or memory."""
    depth = events = 0
    for ev in yaml.parse(text, Loader=yaml.SafeLoader):
        events += 1
        if events > MAX_NODES:
            raise SpecError(_loc(path, ev.start_mark),
                            f"spec has more than {MAX_NODES:,} YAML nodes; is this the right file?")
        if isinstance(ev, yaml.AliasEvent):
            raise SpecError(_loc(path, ev.start_mark), f"YAML alias '*{_one_line(ev.anchor)}' is not allowed: "
                                                       "specs have no anchors or aliases; write the value out")
        if isinstance(ev, yaml.NodeEvent) and ev.anchor is not None:
            raise SpecError(_loc(path, ev.start_mark), f"YAML anchor '&{_one_line(ev.anchor)}' is not allowed: "
                                                       "specs have no anchors or aliases; write the value out")
        tag = getattr(ev, "tag", None)
        if isinstance(ev, yaml.NodeEvent) and tag is not None and tag not in _PLAIN_TAGS and tag != "!":
            raise SpecError(_loc(path, ev.start_mark), f"YAML tag '{_one_line(_short_tag(tag))}' is not allowed: "
                                                       "specs hold plain text, numbers, lists and mappings only; "
                                                       "remove the tag")
        if isinstance(ev, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_DEPTH:
                raise SpecError(_loc(path, ev.start_mark),
                                f"YAML nesting is too deep: more than {MAX_DEPTH} levels of lists and mappings "
                                "(specs need only a few)")
        elif isinstance(ev, yaml.CollectionEndEvent):
            depth -= 1


def _short_tag(tag: str) -> str:
    return "!!" + tag[len("tag:yaml.org,2002:"):] if tag.startswith("tag:yaml.org,2002:") else tag


def _one_line(s: str, n: int = 60) -> str:
    s = s.encode("unicode_escape").decode("ascii")
    return s if len(s) <= n else s[:n] + "..."


class _Walker:
    def __init__(self, path: str):
        self.path = path
        self.seen: set[int] = set()

    def walk(self, node: yaml.Node, depth: int) -> Node:
        loc = _loc(self.path, node.start_mark)
        if depth > MAX_DEPTH + 1:  # _check_events counts collections; this counts scalars too
            raise SpecError(loc, f"YAML nesting is too deep: more than {MAX_DEPTH} levels of lists and mappings")
        if id(node) in self.seen:
            raise SpecError(loc, "YAML anchors and aliases are not allowed in specs; write the value out")
        self.seen.add(id(node))
        if len(self.seen) > MAX_NODES:
            raise SpecError(loc, f"spec has more than {MAX_NODES} YAML nodes; is this the right file?")
        kind = _PLAIN_TAGS.get(node.tag)
        if kind is None:  # an implicit type that _check_events cannot see, such as a date
            short = _short_tag(node.tag)
            what = "a YAML date/time" if short == "!!timestamp" else f"YAML type '{_one_line(short)}'"
            text = f" '{_one_line(node.value)}'" if isinstance(node, yaml.ScalarNode) else ""
            raise SpecError(loc, f"this value{text} reads as {what}, which specs do not use; "
                                 "put it in quotes if you mean text")
        if isinstance(node, yaml.MappingNode):
            out: dict[str, Node] = {}
            key_locs: dict[str, Location] = {}
            for k, v in node.value:
                kloc = _loc(self.path, k.start_mark)
                if not isinstance(k, yaml.ScalarNode):
                    raise SpecError(kloc, "mapping keys must be plain names, not lists or mappings")
                if _PLAIN_TAGS.get(k.tag) != "str":
                    raise SpecError(kloc, f"mapping key '{_one_line(k.value)}' reads as YAML "
                                          f"{_PLAIN_TAGS.get(k.tag, _short_tag(k.tag))}, not a name; "
                                          "put it in quotes or choose another name")
                if k.value in out:
                    first = key_locs[k.value]
                    raise SpecError(kloc, f"duplicate key '{_one_line(k.value)}' (first at line {first.line}, "
                                          f"column {first.col}); each key appears once in a mapping")
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
        try:
            return yaml.SafeLoader.construct_yaml_bool(constructor, node)
        except KeyError:  # an explicit tag on text that is no boolean: !!bool maybe
            raise SpecError(loc, f"'{_one_line(node.value)}' is tagged !!bool but is not true or false") from None
    # an explicit !!int or !!float tag reaches the constructors with any text ("", "0x", "abc"), which they
    # reject with ValueError or IndexError
    try:
        if kind == "int":
            value = yaml.SafeLoader.construct_yaml_int(constructor, node)
            as_float = float(value)  # numbers become float literals; this raises for ints beyond float range
        else:
            value = as_float = yaml.SafeLoader.construct_yaml_float(constructor, node)
    except (ValueError, IndexError):
        if kind == "int" and re.fullmatch(r"[-+]?[0-9][0-9_]*", node.value):  # too many digits to convert
            as_float = float("inf")
        else:
            raise SpecError(loc, f"'{_one_line(node.value)}' is tagged !!{kind} but is not a number") from None
    except OverflowError:
        as_float = float("inf")
    if not abs(as_float) <= FLOAT32_MAX:
        raise SpecError(loc, f"number '{_one_line(node.value)}' is not a finite float32; numbers in specs are "
                             f"fp32 values, at most {FLOAT32_MAX:.7g} in magnitude")
    if as_float != 0 and abs(as_float) <= FLOAT32_TINY / 2:
        raise SpecError(loc, f"number '{_one_line(node.value)}' is 0 in float32 (the smallest nonzero float32 is "
                             f"{FLOAT32_TINY:.3g}); write 0.0 if you mean it")
    return value
