"""On SQLite the claim passes a worker's kinds as one text, the kinds between unit
separators (``jobs.sql._kind_filter``), so that the claim keeps one statement text and
does not build a ``json_each`` table on every claim. A job is claimable exactly when its
kind is one of the worker's: never for a kind that is a prefix, a part or a joining of
served kinds, nor for one that holds the separator itself (or a NUL). Served kinds are
printable: ``@handler`` refuses any other."""

from __future__ import annotations

import pytest
from django.db import connection
from hypothesis import given, settings
from hypothesis import strategies as st

from jobs.sql import _kind_filter

pytestmark = pytest.mark.django_db

# Few characters, so that kinds often overlap and join; stored ones may hold anything.
SERVED = st.text(st.sampled_from("ab."), min_size=1, max_size=4)
STORED = st.text(st.sampled_from("ab.\x1f\x00"), max_size=5)


@pytest.fixture(autouse=True)
def _sqlite_only() -> None:
    if connection.vendor != "sqlite":
        pytest.skip("the SQLite claim's kind filter")


def passes(kind: str, kinds: list[str]) -> bool:
    params: dict[str, object] = {"kind": kind}
    condition = _kind_filter(kinds, params)
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1 FROM (SELECT %(kind)s AS kind) WHERE 1" + condition, params)
        return cursor.fetchone() is not None


@settings(max_examples=300, deadline=None)
@given(kinds=st.lists(SERVED, min_size=1, max_size=4), kind=STORED)
def test_a_kind_passes_exactly_when_it_is_served(kinds: list[str], kind: str) -> None:
    assert passes(kind, kinds) == (kind in kinds)


@pytest.mark.parametrize(
    "kind",
    ["ingest", "ingest.fetch\x1fingest.parse", "fetch\x1fingest", "ingest.fetch\x1f", "", "\x1f"],
)
def test_parts_and_joinings_of_served_kinds_do_not_pass(kind: str) -> None:
    assert not passes(kind, ["ingest.fetch", "ingest.parse"])


def test_a_served_kind_holding_the_separator_is_refused() -> None:
    with pytest.raises(ValueError, match="no unit separator"):
        passes("a", ["a\x1fb"])
