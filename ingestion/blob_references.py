"""Every reference to the blob store, for ``gc_blobs`` (``ingestion.blobs.collect``).

A blob is in use while any of these names it: an artifact's last good body, the body an
artifact's indexed text came from, a spool submission's log excerpt. A new table that
keeps blob digests adds its query here.
"""

from __future__ import annotations

from collections.abc import Iterator

from . import blobs
from .models import Artifact, ArtifactText, IngestedSubmission


def referenced(prefix: str) -> Iterator[str]:
    """The digests starting with ``prefix`` that some row references (repeats possible)."""
    yield from (
        Artifact.objects.filter(sha256__startswith=prefix)
        .values_list("sha256", flat=True)
        .iterator(chunk_size=10_000)
    )
    yield from (
        ArtifactText.objects.filter(sha256__startswith=prefix)
        .values_list("sha256", flat=True)
        .iterator(chunk_size=10_000)
    )
    yield from (
        IngestedSubmission.objects.filter(log_excerpt__startswith=prefix)
        .values_list("log_excerpt", flat=True)
        .iterator(chunk_size=10_000)
    )


if referenced not in blobs.references:
    blobs.references.append(referenced)
