"""Every reference to the blob store, for ``gc_blobs`` (``ingestion.blobs.collect``).

A blob is in use while any of these names it: an artifact's last good body, the body an
artifact's indexed text came from, a spool submission's log excerpt. A new table that
keeps blob digests adds its query here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from django.db.models import QuerySet

from . import blobs
from .models import Artifact, ArtifactText, IngestedSubmission


def referenced(prefix: str) -> Iterator[str]:
    """The digests starting with ``prefix`` (hex digits) that some row references
    (repeats possible), each table read through its index of them (migration 0011).

    A range, not ``LIKE 'prefix%'``: SQLite's ``LIKE`` is case-insensitive and uses no
    ordinary index, and PostgreSQL's uses one only under the C collation. Digests are
    lower-case hex, which sorts the same under every collation."""
    in_part = _part(prefix)
    yield from _digests(Artifact.objects.filter(**in_part("sha256")), "sha256")
    yield from _digests(ArtifactText.objects.filter(**in_part("sha256")), "sha256")
    excerpts = IngestedSubmission.objects.exclude(log_excerpt="")  # the index's condition
    yield from _digests(excerpts.filter(**in_part("log_excerpt")), "log_excerpt")


HEX = "0123456789abcdef"


def _part(prefix: str) -> Callable[[str], dict[str, str]]:
    """``field`` → the filter of the digests starting with ``prefix``: from ``prefix``
    up to the next prefix of its length (none after ``f…f``)."""
    if not prefix or any(digit not in HEX for digit in prefix):
        raise ValueError(f"a blob prefix is lower-case hex digits, not {prefix!r}")
    stripped = prefix.rstrip("f")
    upper = stripped[:-1] + HEX[HEX.index(stripped[-1]) + 1] if stripped else None

    def bounds(field: str) -> dict[str, str]:
        found = {f"{field}__gte": prefix}
        if upper is not None:
            found[f"{field}__lt"] = upper
        return found

    return bounds


def _digests(rows: QuerySet[Any], field: str) -> Iterator[str]:
    return rows.values_list(field, flat=True).iterator(chunk_size=10_000)


if referenced not in blobs.references:
    blobs.references.append(referenced)
