"""YAML and JSON a user hands imageops, parsed within a budget; values in messages cut short.

A few hundred bytes of YAML anchors and aliases (``&a [...]``, ``[*a, *a, ...]``) parse into a
small graph of shared objects that expands to billions of values as soon as anything walks it
(pydantic, ``repr`` in an error message, ``json.dumps``): a 487-byte params.yaml took
``imageops run`` to 8 GB. :class:`BoundedLoader` counts what every node expands to while the
document is composed, before any object exists, and refuses past ``MAX_VALUES`` (and past
``MAX_DEPTH`` levels, which would end in a RecursionError). JSON has no aliases: its cost is its
size, which its reader caps (the webhook's 64 KiB), and its nesting, one recursion per level,
refused here past ``MAX_DEPTH``. And whatever a message echoes goes through :func:`shown`: never
longer than ``SHOWN_CHARS``, whatever the value.
"""

from __future__ import annotations

import json
import re
import reprlib
from itertools import accumulate
from pathlib import Path
from typing import Any

import yaml

from models.errors import ImageOpsError

# The YAML files imageops reads (params.yaml, tuning.yaml, prefect.yaml, .dvc pointers) hold at
# most 200 values in 5 KB; these limits are 50 times that. They bound time too: PyYAML is pure
# Python, a few seconds per 10,000 values on a busy machine.
MAX_YAML_BYTES = 256 * 1024
MAX_VALUES = 10_000  # nodes after alias expansion: keys, values, lists and mappings
# Levels of lists and mappings, in YAML and in JSON: params.yaml needs 3, COCO classification 3
# (segmentation polygons 5); the parsers recurse once per level.
MAX_DEPTH = 64
SHOWN_CHARS = 80  # the most of a value an error message shows

_BUDGET_HINT = (
    "Write the values out plainly (no anchors and aliases, &name and *name, repeating them; no "
    "lists nested in lists) and remove keys imageops does not know: a file imageops reads holds "
    "a few hundred values."
)


class DocumentBudgetError(yaml.MarkedYAMLError):
    """A YAML document that expands past MAX_VALUES, nests past MAX_DEPTH or contains itself (a
    YAMLError, so callers that read a document as "YAML or not" treat it as not)."""


class JsonNestingError(ValueError):
    """JSON nested deeper than MAX_DEPTH (a ValueError, as ``json.loads`` raises for bad JSON)."""


class BoundedLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a document expanding to more than MAX_VALUES nodes.

    Each node's size is 1 plus its children's, an alias counting the whole node it names; sizes
    are kept per node, so a bomb is refused at the first node over the budget, in time linear in
    the text. An alias to a node still being composed (a document that contains itself) is
    refused too: nothing could walk it to the end.
    """

    def __init__(self, stream: str | bytes) -> None:
        super().__init__(stream)
        self._sizes: dict[int, int] = {}
        self._depth = 0
        self._composed = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark
            node = super().compose_node(parent, index)
            if id(node) not in self._sizes:
                raise DocumentBudgetError(
                    problem="an alias names a list or mapping that contains it", problem_mark=mark
                )
            return node
        mark = self.peek_event().start_mark
        self._depth += 1
        self._composed += 1  # a long flat list is refused as it is read, not once it is whole
        if self._composed > MAX_VALUES:
            raise _too_many(mark)
        if self._depth > MAX_DEPTH:
            raise DocumentBudgetError(
                problem=f"lists and mappings nest more than {MAX_DEPTH} deep", problem_mark=mark
            )
        node = super().compose_node(parent, index)
        self._depth -= 1
        size = 1 + sum(self._sizes[id(child)] for child in _children(node))
        if size > MAX_VALUES:
            raise _too_many(mark)
        self._sizes[id(node)] = size
        return node

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        """An integer, or a YAML error for one of more digits than Python converts (4,300)."""
        try:
            return super().construct_yaml_int(node)
        except ValueError as exc:
            raise yaml.constructor.ConstructorError(
                problem=f"an integer of {len(node.value):,} digits", problem_mark=node.start_mark
            ) from exc


BoundedLoader.add_constructor("tag:yaml.org,2002:int", BoundedLoader.construct_yaml_int)


def _too_many(mark: yaml.Mark) -> DocumentBudgetError:
    return DocumentBudgetError(
        problem=f"the document holds more than {MAX_VALUES:,} values, its aliases (*name) expanded",
        problem_mark=mark,
    )


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def parse_yaml(text: str | bytes, loader: type[BoundedLoader] = BoundedLoader) -> Any:
    """The YAML document ``text`` within the budget; raises a yaml.YAMLError otherwise.

    ``yaml.load``'s own body, with the loader checked at run time: a SafeLoader subclass only
    (tests/test_security.py cannot see which class a parameter holds).
    """
    if not issubclass(loader, BoundedLoader):
        raise TypeError(f"{loader.__name__} is not a BoundedLoader")
    reader = loader(text)
    try:
        return reader.get_single_data()
    finally:
        reader.dispose()


def read_yaml(
    path: Path,
    error: type[ImageOpsError],
    hint: str,
    loader: type[BoundedLoader] = BoundedLoader,
) -> Any:
    """The YAML document in ``path``; ``error`` naming the file when it cannot be read, is not
    YAML, or is over a limit (with ``hint`` for the first two, what to change for the last)."""
    try:
        with open(path, "rb") as fh:
            text = fh.read(MAX_YAML_BYTES + 1)
    except OSError as exc:
        raise error(f"Cannot read {path}: {exc}.", hint) from exc
    if len(text) > MAX_YAML_BYTES:
        raise error(
            f"{path} is over {MAX_YAML_BYTES:,} bytes, the most imageops reads of a YAML file.",
            f"Check that {Path(path).name} is the file you meant: the YAML files imageops reads "
            "(params.yaml, tuning.yaml) are a few KB.",
        )
    try:
        return parse_yaml(text, loader)
    except DocumentBudgetError as exc:
        line = exc.problem_mark.line + 1 if exc.problem_mark else 0
        raise error(f"{path}, line {line}: {exc.problem}.", _BUDGET_HINT) from exc
    except yaml.YAMLError as exc:
        raise error(f"Cannot read {path}: {exc}.", hint) from exc


# --- JSON ---------------------------------------------------------------------------------------

_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_BRACKET_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}


def json_depth(text: str) -> int:
    """How deep the arrays and objects of the JSON ``text`` nest, without parsing it.

    Strings are dropped first (a bracket inside one does not count); then a running sum over
    the brackets. Linear, no recursion, about as fast as ``json.loads`` itself.
    """
    brackets = _NOT_BRACKET.sub("", _JSON_STRING.sub("", text)).encode()
    return max(accumulate(_BRACKET_STEP[c] for c in brackets), default=0)


def parse_json(text: str | bytes) -> Any:
    """``json.loads(text)``, refusing nesting past MAX_DEPTH (JsonNestingError, a ValueError)
    before ``json.loads`` recurses into it (a RecursionError past about a thousand levels)."""
    if isinstance(text, bytes | bytearray):
        text = text.decode("utf-8")  # a UnicodeDecodeError is a ValueError too
    depth = json_depth(text)
    if depth > MAX_DEPTH:
        raise JsonNestingError(
            f"arrays and objects nested {depth:,} deep; imageops reads up to {MAX_DEPTH}"
        )
    return json.loads(text)


# --- messages -----------------------------------------------------------------------------------


class _ShortRepr(reprlib.Repr):
    def repr_int(self, x: int, level: int) -> str:
        """Python refuses to write an int of over 4,300 digits: say how big it is instead."""
        if x.bit_length() > 128:
            return f"<an integer of {x.bit_length():,} bits>"
        return super().repr_int(x, level)


_SHORT = _ShortRepr()
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxtuple, _SHORT.maxdict = 3, 6, 6, 4
_SHORT.maxset = _SHORT.maxfrozenset = _SHORT.maxdeque = _SHORT.maxarray = 6
_SHORT.maxstring, _SHORT.maxlong, _SHORT.maxother = SHOWN_CHARS, 40, SHOWN_CHARS


def shown(value: object) -> str:
    """``repr(value)`` for a message, at most SHOWN_CHARS long however large the value is.

    reprlib looks at a few items per level and a few levels only, so a value of a billion items
    (an alias bomb's) costs no more to show than one of ten.
    """
    text = _SHORT.repr(value)
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."
