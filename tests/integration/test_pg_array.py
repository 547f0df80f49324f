"""The claim passes a worker's lanes, limits and kinds as PostgreSQL array literals built
once (``jobs.sql._pg_array``): any lane or kind name reads back as itself, whatever it
holds (quotes, backslashes, commas, braces, the word NULL, spaces, other scripts)."""

from __future__ import annotations

import pytest
from django.db import connection
from hypothesis import given, settings
from hypothesis import strategies as st

from jobs.sql import _pg_array

pytestmark = [pytest.mark.postgres, pytest.mark.django_db]

NAMES = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"))


@pytest.fixture(autouse=True)
def _postgres_only() -> None:
    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL array literals")


@settings(max_examples=200, deadline=None)
@given(values=st.lists(NAMES, max_size=12))
def test_any_names_read_back_as_themselves(values: list[str]) -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT %s::text[]", [_pg_array(tuple(values))])
        assert cursor.fetchone()[0] == values


def test_limits_read_back_as_integers() -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT %s::int[]", [_pg_array(("2", "10"))])
        assert cursor.fetchone()[0] == [2, 10]
