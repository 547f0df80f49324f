"""The lease keeper's reclaim shares its connection with the worker's own renewals, so it
is bounded: a statement timeout of a quarter of the shortest lease the worker may hold,
and a smaller batch after a pass that ran out of time (jobs/worker.py)."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from django.db import OperationalError

from jobs import engine, sql, workers
from jobs.worker import MIN_RECLAIM_BATCH, MIN_RECLAIM_BUDGET_MS, WorkerProcess, _KeeperState


def _timed_out() -> OperationalError:
    error = OperationalError("canceling statement due to statement timeout")
    error.__cause__ = psycopg.errors.QueryCanceled("canceling statement due to statement timeout")
    return error


def test_the_reclaim_budget_is_a_quarter_of_the_shortest_lease() -> None:
    worker = WorkerProcess(worker_id="w")
    worker._min_lease = 8.0
    assert worker._reclaim_budget_ms() == 2000
    worker._min_lease = 0.1
    assert worker._reclaim_budget_ms() == MIN_RECLAIM_BUDGET_MS
    worker._min_lease = 10_000.0
    assert worker._reclaim_budget_ms() == sql.RECLAIM_STATEMENT_TIMEOUT_MS


def test_a_reclaim_that_runs_out_of_time_halves_its_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, int]] = []
    outcomes: list[Any] = [_timed_out(), _timed_out(), list(range(10))]

    def reclaim(limit: int, timeout_ms: int) -> list[int]:
        calls.append((limit, timeout_ms))
        outcome = outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    monkeypatch.setattr(engine, "reclaim_expired", reclaim)
    monkeypatch.setattr(workers, "prune_workers", lambda: 0)
    worker = WorkerProcess(worker_id="w")
    worker._min_lease = 4.0
    state = _KeeperState()
    for _ in range(3):
        worker._reclaim_pass(state)
    batch = sql.RECLAIM_BATCH
    assert calls == [(batch, 1000), (batch // 2, 1000), (batch // 4, 1000)]
    assert state.reclaim_limit == batch // 4 >= MIN_RECLAIM_BATCH
