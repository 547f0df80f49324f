"""A worker SIGKILLed in the middle of a multi-page discovery: the continuation resumes
from the committed cursor, repeats at most the page in flight, and ends with exactly the
items an uninterrupted run finds. Real ``runworker`` processes, a real HTTP server."""

from __future__ import annotations

import json
import signal
from collections import Counter
from pathlib import Path

import pytest

from demo.site import FixtureSite, w3c
from ingestion import discovery
from ingestion.discovery import normalize_lastmod, start_discovery
from ingestion.models import Artifact, DiscoveryRun, ReconciliationIssue, Source
from ingestion.sources import add_source
from jobs import engine
from jobs.models import Job, Lease, Outcome, State
from tests.process.helpers import job_summary
from tests.support.workers import WorkerPool, wait_until

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]

# Discovery gets a lane of its own, and the workers serve only it: the artifact side's
# fetches (enqueued by discovery's hooks) wait in `default` and stay out of this test.
LANES = {"default": {}, "discovery": {"kinds": ["ingestion.discover_source"]}}
LEASE_SECONDS = 3


def listed(name: str) -> dict[str, str]:
    return dict(Artifact.objects.filter(source__name=name).values_list("url", "lastmod"))


def finished_run(name: str, pool: WorkerPool) -> DiscoveryRun:
    def done() -> DiscoveryRun | None:
        run = DiscoveryRun.objects.filter(source__name=name).first()
        return run if run is not None and run.state != "running" else None

    return wait_until(done, 30, interval=0.1, message=lambda: f"{job_summary()}\n{pool.describe()}")


def discovery_lanes(settings) -> dict[str, str]:
    """The discovery lane and short lease, here and in the workers' environment."""
    settings.HOLDFAST_LANES = LANES
    settings.HOLDFAST_LEASE_SECONDS = LEASE_SECONDS
    return {"HOLDFAST_TEST_LANES": json.dumps(LANES), "HOLDFAST_LEASE_SECONDS": str(LEASE_SECONDS)}


def test_sigkill_mid_discovery_resumes_from_the_committed_cursor(
    workers: WorkerPool, settings, tmp_path: Path
) -> None:
    env = discovery_lanes(settings)
    with FixtureSite(per_sitemap=2) as site:
        for n in range(1, 11):
            site.add(f"/docs/{n}.html", f"Document {n}", f"text number {n}")
        # The index and five sitemaps, two listing pages per job: three jobs.
        add_source(
            "victim",
            "sitemap",
            site.url("/sitemap.xml"),
            spacing=0,
            max_pages_per_run=2,
            allow_private=True,
        )
        held = site.hold("/sitemaps/3.xml")  # the second page of the second job
        first, _ = start_discovery(Source.objects.get(name="victim"))
        assert first is not None

        victim = workers.start("victim", "--lanes", "discovery", env=env)
        wait_until(
            lambda: site.requests_to("/sitemaps/3.xml"),
            30,
            message=lambda: f"/sitemaps/3.xml never requested\n{workers.describe()}",
        )
        assert victim.kill() == -signal.SIGKILL
        held.set()

        run = DiscoveryRun.objects.get(source__name="victim")
        assert (run.state, run.pages) == ("running", 3)  # index, sitemaps 1 and 2 committed
        head = run.page_rows.filter(state="pending").order_by("pk").first()
        assert head is not None and head.url == site.url("/sitemaps/3.xml")
        assert len(listed("victim")) == 4  # the two committed sitemaps' documents
        interrupted = Job.objects.get(unique_key=f"discover:victim:run{run.pk}:job2")
        assert interrupted.state == State.RUNNING

        rescuer = workers.start("rescuer", "--lanes", "discovery", env=env)
        run = finished_run("victim", workers)
        requests = Counter(request.path for request in site.requests)

        # An uninterrupted discovery of the same site, for comparison.
        add_source(
            "control",
            "sitemap",
            site.url("/sitemap.xml"),
            spacing=0,
            max_pages_per_run=2,
            allow_private=True,
        )
        start_discovery(Source.objects.get(name="control"))
        control = finished_run("control", workers)
        assert rescuer.alive

    assert (run.state, run.pages, run.items, run.jobs) == ("completed", 6, 10, 3), job_summary()
    assert listed("victim") == listed("control")
    assert listed("victim") == {
        site.url(p): normalize_lastmod(w3c(d.lastmod)) for p, d in site.documents.items()
    }
    assert (control.pages, control.items, control.jobs) == (6, 10, 3)
    # Only the page in flight was read twice.
    assert requests["/sitemaps/3.xml"] == 2
    for page in ("/sitemap.xml", "/sitemaps/1.xml", "/sitemaps/2.xml", "/sitemaps/4.xml"):
        assert requests[page] == 1, requests
    interrupted.refresh_from_db()
    assert interrupted.state == State.SUCCEEDED and interrupted.attempts == 2
    outcomes = list(
        Lease.objects.filter(job=interrupted).order_by("lease_token").values_list("outcome")
    )
    assert outcomes == [(Outcome.LEASE_EXPIRED,), (Outcome.SUCCEEDED,)]
    assert interrupted.result["pages"] == 2  # sitemaps 3 and 4, then a continuation
    discovery_jobs = Job.objects.filter(kind="ingestion.discover_source")
    assert set(discovery_jobs.values_list("state", flat=True)) == {State.SUCCEEDED}


# A worker whose reading of one page kills it, every time (an out-of-memory kill, a crash in
# C code): the page is fetched, then the process ends at once with no outcome recorded.
POISON = """
import os
from ingestion import http
real = http.get
def get(source, url, *args, **kwargs):
    response = real(source, url, *args, **kwargs)
    if url.endswith("/sitemaps/2.xml"):
        os._exit(137)
    return response
http.get = get
from django.core.management import call_command
call_command("runworker", "--worker-id", %r, "--lanes", "discovery")
"""


def test_a_page_that_kills_its_worker_every_time_is_given_up_the_run_goes_on(
    workers: WorkerPool, settings
) -> None:
    """It wedged the run: each attempt (and each later run) died on the page at the
    cursor's head, the job ended dead, the run stayed ``running`` and no page behind it
    was ever read (audit). Now after ``PAGE_CRASHES`` reads with no outcome it is failed
    with an issue, as a page that cannot be read, and the run completes without it."""
    env = discovery_lanes(settings)
    with FixtureSite(per_sitemap=2) as site:
        for n in range(1, 7):
            site.add(f"/docs/{n}.html", f"Document {n}", f"text {n}")
        add_source("docs", "sitemap", site.url("/sitemap.xml"), spacing=0, allow_private=True)
        job, _ = start_discovery(Source.objects.get(name="docs"))
        assert job is not None
        started = 0
        current = None

        def settled() -> bool:
            nonlocal started, current
            job.refresh_from_db()
            if job.state != State.QUEUED and job.state != State.RUNNING:
                return True
            Job.objects.filter(pk=job.pk, state=State.QUEUED).update(run_at=engine.db_now())
            if current is None or not current.alive:  # restarted, as systemd would
                started += 1
                current = workers.spawn_python(f"p{started}", POISON % f"p{started}", env=env)
            return False

        wait_until(
            settled, 90, interval=0.2, message=lambda: f"{job_summary()}\n{workers.describe()}"
        )
        if current is not None and current.alive:
            current.stop()
        run = DiscoveryRun.objects.get(source__name="docs")
        requests = Counter(request.path for request in site.requests)

    assert job.state == State.SUCCEEDED, job_summary()
    assert (run.state, run.failed_pages) == ("completed", 1)
    assert requests["/sitemaps/2.xml"] == discovery.PAGE_CRASHES
    assert requests["/sitemaps/3.xml"] == 1  # the page behind it is read
    assert Artifact.objects.filter(source__name="docs").count() == 4  # all but page 2's
    issue = ReconciliationIssue.objects.get(kind="listing_failed")
    assert issue.subject == site.url("/sitemaps/2.xml")
    assert "with no outcome" in issue.details["error"]
