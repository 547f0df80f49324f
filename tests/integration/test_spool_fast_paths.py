"""The ingester's fast paths do exactly what the slow, general ones did.

:func:`ingestion.submissions.conforms` stands in for ``jsonschema`` on valid documents, and
``parse`` skips the walk for NUL characters and lone surrogates when the raw bytes hold no
``\\u`` escape. Each is held here to the rule it replaces, on many variations of a
submission (no database needed). The monitor hands names out in lists: all, once.
"""

from __future__ import annotations

import copy
import itertools
import json
from typing import Any

import pytest

from ingestion.ingester import HANDOUT_FILES, handouts
from ingestion.submissions import (
    SCHEMA,
    InvalidSubmission,
    Limits,
    _validator,
    conforms,
    parse,
)

VALID: dict[str, Any] = {
    "schema": "holdfast.submission/v1",
    "lab": "lab-berlin-3",
    "submitted_at": "2026-11-30T10:00:00Z",
    "facts": [
        {"entity": "run", "key": "run-42", "attributes": {"status": "passed"}},
        {"entity": "run", "key": "run-43", "attributes": {}},
    ],
    "log_excerpt": "ok",
}

# Values of every JSON type, including the edges of the schema's length limits.
VALUES: list[Any] = [
    None,
    True,
    0,
    1.5,
    "",
    "x",
    "x" * 9,
    "x" * 10,
    "x" * 64,
    "x" * 65,
    "x" * 200,
    "x" * 201,
    "x" * 500,
    "x" * 501,
    [],
    [1],
    {},
    {"a": 1},
    "holdfast.submission/v1",
    "holdfast.submission/v2",
]
MISSING = object()


def variations() -> list[Any]:
    """Documents that differ from VALID in one place (or two), and some that are not
    objects at all."""
    documents: list[Any] = [VALID, *VALUES]
    for field in [*SCHEMA["properties"], "colour"]:
        for value in [MISSING, *VALUES]:
            document = copy.deepcopy(VALID)
            if value is MISSING:
                document.pop(field, None)
            else:
                document[field] = value
            documents.append(document)
    for field in ["entity", "key", "attributes", "extra"]:
        for value in [MISSING, *VALUES]:
            document = copy.deepcopy(VALID)
            if value is MISSING:
                document["facts"][1].pop(field, None)
            else:
                document["facts"][1][field] = value
            documents.append(document)
    for fact in VALUES:
        document = copy.deepcopy(VALID)
        document["facts"].append(fact)
        documents.append(document)
    for first, second in itertools.combinations(["lab", "submitted_at", "facts"], 2):
        document = copy.deepcopy(VALID)
        document[first], document[second] = document[second], document[first]
        documents.append(document)
    return documents


@pytest.mark.parametrize("document", variations())
def test_the_fast_check_agrees_with_jsonschema(document: Any) -> None:
    assert conforms(document) == _validator.is_valid(document)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a\x00b", "NUL"),
        ("l\ud800", "surrogate"),
    ],
)
@pytest.mark.parametrize("where", ["lab", "key", "attribute name", "attribute value"])
def test_nul_and_lone_surrogates_are_found_wherever_they_are(
    text: str, message: str, where: str
) -> None:
    document = copy.deepcopy(VALID)
    fact = document["facts"][0]
    if where == "lab":
        document["lab"] = text
    elif where == "key":
        fact["key"] = text
    elif where == "attribute name":
        fact["attributes"] = {text: 1}
    else:
        fact["attributes"] = {"nested": [{"deep": text}]}
    raw = json.dumps(document).encode()  # ensure_ascii: written as \\u escapes
    assert b"\\u" in raw
    with pytest.raises(InvalidSubmission, match=message) as raised:
        parse(raw, Limits())
    assert raised.value.stage == "semantic"


def test_text_without_escapes_is_parsed_without_the_walk() -> None:
    raw = json.dumps(VALID, ensure_ascii=False).encode()
    assert b"\\u" not in raw
    submission = parse(raw, Limits())
    assert [fact.key for fact in submission.facts] == ["run-42", "run-43"]


def test_names_are_handed_out_in_short_lists_that_every_reader_shares() -> None:
    assert handouts([], 2) == []
    assert handouts(["a", "b", "c"], 2) == [["a", "b"], ["c"]]
    names = [f"s{i}.json" for i in range(100)]
    lists = handouts(names, 2)
    assert [name for chunk in lists for name in chunk] == names  # all, once, in order
    assert max(len(chunk) for chunk in lists) == HANDOUT_FILES


def test_a_refused_string_is_named_by_its_path() -> None:
    for text, says in (("a\x00b", "a NUL character"), ("a\udcffb", "a lone surrogate")):
        document = copy.deepcopy(VALID)
        document["facts"][1]["attributes"] = {"runs": [{"ok": "x"}, {"log": ["y", text]}]}
        with pytest.raises(InvalidSubmission) as raised:
            parse(json.dumps(document).encode(), Limits())
        assert str(raised.value).endswith(
            f"$.facts[1].attributes.runs[1].log[1] contains {says}"
        ) or f"$.facts[1].attributes.runs[1].log[1] contains {says}" in str(raised.value)
        document["facts"][1]["attributes"] = {f"name{text}": 1}
        with pytest.raises(InvalidSubmission, match=r"\$\.facts\[1\]\.attributes contains"):
            parse(json.dumps(document).encode(), Limits())


def test_the_string_walk_does_not_grow_with_the_values_behind_one_long_name() -> None:
    """Long attribute names over many values: a path string per value cost the path's
    length times their number (200 MB for this 250 KB file)."""
    import tracemalloc

    document = copy.deepcopy(VALID)
    document["facts"][0]["key"] = "\\u0041"
    nested: Any = [0] * 20_000
    for level in range(10):
        nested = {str(level) * 1000: nested}  # names of the longest length allowed
    document["facts"][0]["attributes"] = nested
    raw = json.dumps(document).replace("\\\\u0041", "\\u0041").encode()
    assert b"\\u" in raw
    tracemalloc.start()
    try:
        parse(raw, Limits())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 20_000_000, peak  # a path a value: 20,000 x 10,000 characters


def test_an_identity_no_unique_index_could_hold_is_a_limits_error() -> None:
    """200 + 500 characters of four UTF-8 bytes each pass the schema's lengths, and
    PostgreSQL's unique index over (lab, entity, key) refuses them (2,800 bytes past its
    2,704): the submission is refused alike on both databases, naming the limit."""
    document = copy.deepcopy(VALID)
    document["facts"][0].update(entity="\U00010000" * 200, key="\U00010000" * 500)
    with pytest.raises(InvalidSubmission) as raised:
        parse(json.dumps(document).encode(), Limits())
    assert raised.value.stage == "limits" and "entity and key are 2800 bytes" in str(raised.value)
    document["facts"][0].update(entity="e" * 200, key="\U00010000" * 450)  # 2,000 bytes
    assert parse(json.dumps(document).encode(), Limits()).facts[0].entity == "e" * 200
