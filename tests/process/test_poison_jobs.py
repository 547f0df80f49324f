"""A job whose outcome the database refuses to store must not take its worker down.

PostgreSQL cannot store a NUL character in ``text`` or ``jsonb``; a handler that returns
one, or fails with one in its message, must still end in a terminal state while the
worker carries on (I3), instead of crashing every worker that claims it in turn.
"""

from __future__ import annotations

import pytest

from jobs.enqueueing import enqueue
from jobs.models import Job, Lease, Outcome, State
from tests.process.helpers import job_summary
from tests.support.workers import WorkerPool

pytestmark = [pytest.mark.process, pytest.mark.timeout(60)]


@pytest.mark.parametrize(
    "kind",
    ["test.nul_result", "test.nul_error", "test.surrogate_error", "test.unprintable_error"],
)
def test_a_job_whose_outcome_cannot_be_stored_does_not_crash_the_worker(
    workers: WorkerPool, kind: str
) -> None:
    poison = enqueue(kind)
    after = enqueue("test.echo", {"after": "poison"}, priority=-1)

    burst = workers.command("runworker", "--burst", "--worker-id", "burst", timeout=30)
    assert burst.returncode == 0, burst.describe()
    assert "Traceback" not in burst.stderr, burst.describe()

    poison.refresh_from_db()
    assert poison.state in (State.SUCCEEDED, State.DEAD), job_summary([poison.pk])
    recorded = Lease.objects.filter(job_id=poison.pk)  # its attempts ended, and say how
    assert recorded.exists() and not recorded.filter(outcome=Outcome.RUNNING).exists()
    # The worker went on to the next job.
    assert Job.objects.get(pk=after.pk).state == State.SUCCEEDED, burst.describe()


def test_an_error_that_cannot_describe_itself_is_still_recorded(workers: WorkerPool) -> None:
    """The operator sees why it failed: the class, and the message as far as it can be
    told (a lone surrogate escaped; a ``__str__`` that raises named as such)."""
    surrogate, unprintable = enqueue("test.surrogate_error"), enqueue("test.unprintable_error")
    burst = workers.command("runworker", "--burst", "--worker-id", "burst", timeout=30)
    assert burst.returncode == 0, burst.describe()
    for job in (surrogate, unprintable):
        job.refresh_from_db()
        assert job.state == State.DEAD, job_summary([job.pk])
    assert Job.objects.get(pk=surrogate.pk).last_error == (
        "ValueError: cannot read report-\\udcff.json"
    )
    lease = Lease.objects.filter(job_id=unprintable.pk).latest("lease_token")
    assert lease.error_class == "tests.testapp.handlers.Unprintable"
    assert (
        lease.error_message
        == "(its str() raised RuntimeError: this exception cannot describe itself)"
    )
    assert "raise Unprintable()" in lease.traceback
