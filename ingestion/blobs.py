"""The content-addressed blob store: bytes kept under their sha256 in ``HOLDFAST_BLOB_DIR``.

A blob lives at ``<root>/<h[:2]>/<h[2:4]>/<h>``. Storing writes a temporary file in the
same directory, fsyncs it, renames it into place and fsyncs the directory, so a reader
never sees a partial blob and a crash leaves at most a stray temporary file. Storing the
same bytes twice is harmless (the second store finds the blob and does nothing), which is
what lets a retried spool batch upload its log excerpts again safely.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

from django.conf import settings


def root() -> Path:
    return Path(settings.HOLDFAST_BLOB_DIR)


def path_for(digest: str, base: Path | None = None) -> Path:
    """Where the blob with this sha256 (hex) lives."""
    if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise ValueError(f"not a sha256 hex digest: {digest!r}")
    return (base or root()) / digest[:2] / digest[2:4] / digest


def exists(digest: str, base: Path | None = None) -> bool:
    return path_for(digest, base).is_file()


def read(digest: str, base: Path | None = None) -> bytes:
    return path_for(digest, base).read_bytes()


def store(data: bytes, base: Path | None = None) -> str:
    """Keep ``data`` durably under its sha256 and return the digest (hex)."""
    digest = hashlib.sha256(data).hexdigest()
    target = path_for(digest, base)
    if target.is_file() and target.stat().st_size == len(data):
        return digest
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=".tmp-", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as tmp:
            tmp.write(data)
            tmp.flush()
            os.fsync(tmp.fileno())
        os.replace(tmp_name, target)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    fsync_dir(target.parent)
    return digest


def fsync_dir(directory: Path) -> None:
    """Make a rename or unlink in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
