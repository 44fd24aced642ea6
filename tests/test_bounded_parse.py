"""Parsing within a budget (models/bounded_parse.py, issue 43): YAML aliases, nesting, and the
values messages echo. The commands that read these files are run by the hostile corpus
(tests/hostile_inputs.py: run-*, tune-alias-bomb, transform-deep-json) and their memory measured
by tests/test_memory_bounds.py; these are the parser's own rules, in milliseconds."""

from __future__ import annotations

import time

import pytest
import yaml
from hostile_inputs import alias_bomb

from models.bounded_parse import (
    MAX_DEPTH,
    MAX_VALUES,
    SHOWN_CHARS,
    DocumentBudgetError,
    JsonNestingError,
    parse_json,
    parse_yaml,
    shown,
)


def test_an_alias_bomb_is_refused_at_its_first_anchor_over_the_budget() -> None:
    started = time.monotonic()
    with pytest.raises(DocumentBudgetError) as refused:
        parse_yaml(alias_bomb(levels=30))  # 9 ** 30 values
    assert time.monotonic() - started < 1
    assert refused.value.problem_mark.line + 1 == 6  # bomb:, then l1..l5: l5 is 66,430 nodes
    assert f"more than {MAX_VALUES:,} values" in str(refused.value)


def test_anchors_and_aliases_within_the_budget_read_as_plain_yaml() -> None:
    text = "base: &b {lr: 0.1, momentum: 0.9}\nrun: {<<: *b, lr: 0.2}\nboth: [*b, *b]\n"
    assert parse_yaml(text) == yaml.safe_load(text)
    assert parse_yaml(alias_bomb(levels=3)) == yaml.safe_load(alias_bomb(levels=3))


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("a: &a [1, *a]", "names a list or mapping that contains it"),
        ("a:\n" + "- " * 2_000 + "x", f"nest more than {MAX_DEPTH} deep"),
        ("[" + "1, " * (MAX_VALUES + 1) + "]", f"more than {MAX_VALUES:,} values"),
        ("n: " + "9" * 5000, "an integer of 5,000 digits"),
    ],
    ids=["self-containing", "deep", "long-list", "huge-int"],
)
def test_what_no_reader_could_walk_is_a_yaml_error(text: str, problem: str) -> None:
    """Each was a RecursionError, a ValueError or a structure no repr() ends on."""
    with pytest.raises(yaml.YAMLError, match=problem):
        parse_yaml(text)


def test_json_nesting_is_refused_before_json_loads_recurses() -> None:
    assert parse_json(b'{"a": [[1]]}') == {"a": [[1]]}
    assert parse_json('{"a": "[[[[[["}') == {"a": "[[[[[["}  # brackets in strings do not count
    with pytest.raises(JsonNestingError, match="nested 100,000 deep"):
        parse_json("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError):
        parse_json(b"\xff not utf-8")


def test_a_shown_value_is_short_however_large_it_is() -> None:
    shared: list = ["lol"] * 9
    for _ in range(30):  # 9 ** 31 items if anything walked it all
        shared = [shared] * 9
    looped: list = [1]
    looped.append(looped)
    for value in (shared, looped, "x" * 10**7, 10**5000, {str(i): i for i in range(10**5)}):
        assert len(shown(value)) <= SHOWN_CHARS
    assert shown("epochs") == "'epochs'" and shown([1, 2]) == "[1, 2]"


def test_validation_messages_cut_an_echoed_value_short() -> None:
    from flows.config import PipelineConfig
    from tasks.shared.errors import InvalidParameterError
    from tasks.shared.validation import checked
    from tasks.train.params import TrainParams

    for values in ({"epochs": "9" * 100_000}, {"no_such": ["x" * 1000] * 1000}):
        with pytest.raises(InvalidParameterError) as refused:
            checked(TrainParams, values, "training parameter")
        assert len(refused.value.message) < 300, refused.value.message[:300]
    with pytest.raises(InvalidParameterError) as refused:
        PipelineConfig.checked({"bomb": "x" * 100_000}, "params.yaml", "Fix it.")
    assert len(refused.value.message) < 200, refused.value.message[:300]
