"""SQLite under Holdfast's connection options: the -wal file grows while a read stays
open (a checkpoint cannot pass a reader's snapshot), and comes back to at most
``SQLITE_WAL_LIMIT`` once the reader is gone. Without ``journal_size_limit`` it kept its
largest size for as long as any process stayed connected (the soak audit: 70 MB beside a
3.7 MB database, for 20 minutes)."""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path

from config.settings import SQLITE_INIT, SQLITE_WAL_LIMIT


def connect(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.executescript(SQLITE_INIT)  # what Django runs on each new connection
    return conn


def test_the_wal_shrinks_back_once_a_long_reader_is_gone(tmp_path: Path) -> None:
    database = tmp_path / "holdfast.sqlite3"
    with (
        contextlib.closing(connect(database)) as writer,
        contextlib.closing(connect(database)) as reader,
    ):
        grow_and_shrink(database, writer, reader)


def grow_and_shrink(database: Path, writer: sqlite3.Connection, reader: sqlite3.Connection) -> None:
    writer.execute("CREATE TABLE t (x BLOB)")
    reader.execute("BEGIN")
    reader.execute("SELECT count(*) FROM t").fetchone()  # a snapshot checkpoints cannot pass
    blob = 8192
    for _ in range(SQLITE_WAL_LIMIT * 2 // blob):
        writer.execute("INSERT INTO t VALUES (randomblob(?))", [blob])
    wal = Path(f"{database}-wal")
    assert wal.stat().st_size > 2 * SQLITE_WAL_LIMIT  # grown past the limit meanwhile
    reader.execute("COMMIT")
    for _ in range(2000):  # the next automatic checkpoint completes; the WAL restarts
        writer.execute("INSERT INTO t VALUES (randomblob(100))")
    assert wal.stat().st_size <= SQLITE_WAL_LIMIT
