"""``gc_blobs``'s look-up of the digests in use (``ingestion.blob_references``): each of
its 16 parts reads that part of an index, never a whole table. It had read all three
tables 16 times (``sha256 LIKE 'a%'``: no index): 6.7 s of SQL at 900,000 artifacts."""

from __future__ import annotations

import random

import pytest
from django.db import connection

from ingestion import blob_references

HEX = "0123456789abcdef"


def test_a_part_holds_exactly_the_digests_with_its_prefix() -> None:
    from ingestion.blob_references import _part

    rng = random.Random(16)
    digests = ["".join(rng.choice(HEX) for _ in range(64)) for _ in range(2000)]
    digests += ["0" * 64, "f" * 64, "", "f", "0"]
    for prefix in [*HEX, "00", "0f", "f0", "ff", "9f", "a", "fff"]:
        bounds = _part(prefix)("d")
        low, high = bounds["d__gte"], bounds.get("d__lt")
        for digest in digests:
            inside = low <= digest and (high is None or digest < high)
            assert inside == digest.startswith(prefix), (prefix, digest)


@pytest.mark.parametrize("prefix", ["", "A", "g", "0x"])
def test_a_prefix_is_hex_digits(prefix: str) -> None:
    from ingestion.blob_references import _part

    with pytest.raises(ValueError, match="lower-case hex"):
        _part(prefix)


@pytest.mark.django_db
@pytest.mark.parametrize("digit", ["0", "7", "f"])
def test_each_part_reads_an_index_of_each_table(digit: str) -> None:
    sent: list[tuple[str, tuple]] = []

    def record(execute, sql, params, many, context):
        sent.append((sql, params))
        return execute(sql, params, many, context)

    with connection.execute_wrapper(record):
        list(blob_references.referenced(digit))
    assert len(sent) == 3
    expected = ["artifact_sha256_idx", "artifact_text_sha256_idx", "submission_excerpt_idx"]
    for (sql, params), index in zip(sent, expected, strict=True):
        with connection.cursor() as cursor:
            if connection.vendor == "sqlite":
                cursor.execute("EXPLAIN QUERY PLAN " + sql, params)
                plan = "\n".join(row[3] for row in cursor.fetchall())
            else:
                cursor.execute("SET enable_seqscan = off")
                cursor.execute("EXPLAIN " + sql, params)
                plan = "\n".join(row[0] for row in cursor.fetchall())
                cursor.execute("RESET enable_seqscan")
        assert index in plan, f"{sql}\n{plan}"
