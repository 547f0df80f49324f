"""Sources: validation, the commands (DESIGN §8), and their discovery schedules (I5)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from django.core.management import CommandError

from ingestion import sources
from ingestion.models import Artifact, DiscoveryPage, DiscoveryRun, Source
from jobs import scheduler
from jobs.exceptions import InvalidJob
from jobs.models import Job, Schedule

from .helpers import exit_code, run, run_json

pytestmark = pytest.mark.django_db

URL = "https://example.org/sitemap.xml"


@pytest.fixture(autouse=True)
def quiet_refresh(settings):
    """Keep the built-in refresh schedule out of these ticks (see test_scheduler.py)."""
    settings.HOLDFAST_REFRESH_SECONDS = 10**9


def at(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)


def discovery_jobs() -> list[Job]:
    return list(Job.objects.filter(kind=sources.DISCOVER_KIND).order_by("pk"))


def test_add_source_prints_the_source_and_creates_its_schedule():
    data = run_json(
        "add_source", "docs", "--kind", "sitemap", "--url", URL, "--spacing", "0.5",
        "--max-pages-per-run", "3",
    )  # fmt: skip
    assert data["name"] == "docs" and data["kind"] == "sitemap" and data["url"] == URL
    assert (data["spacing_seconds"], data["max_pages_per_run"]) == (0.5, 3)
    assert data["schedule"] == sources.spread_schedule("docs")
    assert data["enabled"] is True and data["last_run"] is None
    row = Schedule.objects.get(name="discover:docs")
    assert (row.kind, row.cron, row.args, row.origin) == (
        sources.DISCOVER_KIND,
        data["schedule"],
        {"source": "docs"},
        "source",
    )
    assert "added source news" in run("add_source", "news", "--kind", "feed", "--url", URL)


def test_default_schedules_are_daily_stable_and_spread_over_the_day():
    crons = {sources.spread_schedule(f"source-{n}") for n in range(50)}
    assert len({cron.split()[1] for cron in crons}) > 10  # many different hours
    assert sources.spread_schedule("docs") == sources.spread_schedule("docs")
    minute, hour, *rest = sources.spread_schedule("docs").split()
    assert 0 <= int(minute) < 60 and 0 <= int(hour) < 24 and rest == ["*", "*", "*"]


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        (["bad name", "--kind", "feed", "--url", URL], "slug"),
        (["docs", "--kind", "feed", "--url", "ftp://example.org/"], "http(s) URL"),
        (["docs", "--kind", "feed", "--url", "not a url"], "http(s) URL"),
        (["docs", "--kind", "feed", "--url", URL, "--schedule", "61 * * * *"], "cron"),
        (["docs", "--kind", "feed", "--url", URL, "--schedule", "0 3 * * * *"], "five fields"),
        (["docs", "--kind", "feed", "--url", "https://u:secret@example.org/"], "password"),
        (["docs", "--kind", "feed", "--url", "https://token@example.org/feed"], "user name"),
        (["docs", "--kind", "feed", "--url", URL, "--spacing", "-1"], "spacing"),
        (["docs", "--kind", "feed", "--url", URL, "--spacing", "nan"], "spacing"),
        (["docs", "--kind", "feed", "--url", URL, "--spacing", "1e308"], "3600 seconds"),
        (["docs", "--kind", "feed", "--url", URL, "--spacing", "3600.5"], "3600 seconds"),
        (["docs", "--kind", "feed", "--url", URL, "--spacing", "inf"], "spacing"),
        (["docs", "--kind", "feed", "--url", URL, "--max-pages-per-run", "0"], "pages"),
        # 1,900 characters but 5,700 bytes: a page row PostgreSQL cannot index (audit).
        (["docs", "--kind", "feed", "--url", f"{URL}?q={'語' * 1900}"], "2000 bytes"),
        (["docs", "--kind", "feed", "--url", "https://example.org/a\x00b"], "control character"),
        (["docs", "--kind", "feed", "--url", "https://example.org/\x1b[0m"], "control character"),
        (["docs", "--kind", "feed", "--url", "https://example.org/\udcff"], "UTF-8"),
    ],
)
def test_bad_input_is_refused_with_a_reason(args, reason):
    with pytest.raises(CommandError) as refused:
        run("add_source", *args)
    assert refused.value.returncode == 2
    assert reason in str(refused.value) and "\n" not in str(refused.value)
    assert not Source.objects.exists()


def test_spacing_may_be_up_to_an_hour():
    assert sources.add_source("slow", "sitemap", URL, spacing=3600).spacing_seconds == 3600
    assert sources.add_source("fast", "sitemap", URL, spacing=0).spacing_seconds == 0


def test_names_are_unique():
    sources.add_source("docs", "sitemap", URL)
    with pytest.raises(InvalidJob, match="already exists"):
        sources.add_source("docs", "feed", URL)
    assert exit_code("add_source", "docs", "--kind", "feed", "--url", URL) == 2


def test_list_sources_text_and_json():
    sources.add_source("docs", "sitemap", URL, schedule="15 4 * * *", spacing=0)
    sources.add_source("news", "feed", "https://example.org/feed.xml")
    source = Source.objects.get(name="docs")
    DiscoveryRun.objects.create(source=source, pages=4, items=7, state="completed")
    data = run_json("list_sources")
    assert data["count"] == 2
    assert [row["name"] for row in data["sources"]] == ["docs", "news"]
    docs = data["sources"][0]
    assert docs["schedule"] == "15 4 * * *" and docs["spacing_seconds"] == 0
    assert docs["last_run"]["state"] == "completed" and docs["last_run"]["items"] == 7
    text = run("list_sources")
    assert "docs" in text and "news" in text and "completed, 4 pages, 7 items" in text
    assert "(2 sources)" in text


def test_list_sources_reads_in_a_fixed_number_of_queries(django_assert_max_num_queries):
    """Three queries a source (its artifacts, last run, pending pages) were 150 for 50
    sources (scale audit): the figures are read for all of them at once."""
    for n in range(30):
        Source.objects.create(name=f"s{n}", kind="sitemap", url=URL, schedule="@daily")
    for source in Source.objects.order_by("pk")[:10]:
        DiscoveryRun.objects.create(source=source, state="completed")
        run = DiscoveryRun.objects.create(source=source, pages=2, items=3, state="running")
        DiscoveryPage.objects.create(run=run, url=URL)
        Artifact.objects.create(source=source, url=f"{URL}?{source.pk}")
    with django_assert_max_num_queries(6):
        data = sources.source_dicts(list(Source.objects.order_by("name")))
    listed = {row["name"]: row for row in data}
    busy = listed[Source.objects.order_by("pk").first().name]
    assert busy["artifacts"] == 1
    assert (busy["last_run"]["state"], busy["last_run"]["pending_pages"]) == ("running", 1)
    assert listed["s29"]["last_run"] is None and listed["s29"]["artifacts"] == 0


def test_disable_source_removes_its_schedule_and_is_idempotent():
    sources.add_source("docs", "sitemap", URL)
    assert "disabled source docs" in run("disable_source", "docs")
    assert Source.objects.get(name="docs").enabled is False
    assert Schedule.objects.get(name="discover:docs").declared is False
    assert "already disabled" in run("disable_source", "docs")
    assert run_json("disable_source", "docs")["enabled"] is False


def test_unknown_sources_are_bad_input():
    assert exit_code("disable_source", "nope") == 2
    assert exit_code("enqueue_discovery", "nope") == 2
    with pytest.raises(sources.SourceNotFound, match="no source named 'nope'"):
        sources.get_source("nope")


def test_enqueue_discovery_enqueues_once_while_one_is_queued():
    sources.add_source("docs", "sitemap", URL)
    first = run_json("enqueue_discovery", "docs")
    assert first["enqueued"] is True
    assert first["job"]["kind"] == sources.DISCOVER_KIND
    assert first["job"]["args"] == {"source": "docs"}
    again = run_json("enqueue_discovery", "docs")
    assert again["enqueued"] is False and again["job"] is None
    assert "already queued" in again["message"]
    assert "already queued" in run("enqueue_discovery", "docs")
    assert len(discovery_jobs()) == 1


def test_enqueue_discovery_of_a_disabled_source_fails():
    sources.add_source("docs", "sitemap", URL)
    sources.disable_source("docs")
    assert exit_code("enqueue_discovery", "docs") == 1
    assert discovery_jobs() == []


def test_restarting_the_scheduler_neither_starts_a_discovery_early_nor_twice():
    sources.add_source("docs", "sitemap", URL, schedule="0 3 * * *")
    Schedule.objects.all().delete()  # add_source synced at today's time: start the clock anew
    scheduler.sync(now=at(2026, 11, 30, 10))  # a fresh scheduler: waits for the next slot
    assert Schedule.objects.get(name="discover:docs").next_due_at == at(2026, 12, 1, 3)
    for minutes in range(0, 17 * 60, 37):  # restarts all day long before the slot
        now = at(2026, 11, 30, 10) + timedelta(minutes=minutes)
        scheduler.sync(now=now)
        assert scheduler.tick(now) == []
    [job_id] = scheduler.tick(at(2026, 12, 1, 3, 0, 5))
    for minutes in range(1, 30):  # a crash loop just after the slot
        now = at(2026, 12, 1, 3) + timedelta(minutes=minutes)
        scheduler.sync(now=now)
        assert scheduler.tick(now) == []
    [job] = discovery_jobs()
    assert job.pk == job_id and job.args == {"source": "docs"}
    assert job.unique_key == "schedule:discover:docs:2026-12-01T03:00:00+00:00"


def test_disabled_sources_are_not_scheduled():
    sources.add_source("docs", "sitemap", URL, schedule="0 3 * * *")
    Schedule.objects.all().delete()
    scheduler.sync(now=at(2026, 11, 30, 10))
    sources.disable_source("docs")
    scheduler.sync(now=at(2026, 11, 30, 11))
    assert scheduler.tick(at(2026, 12, 1, 3, 0, 5)) == []
    assert discovery_jobs() == []


def test_adding_a_source_syncs_only_the_sources_schedules(settings):
    """``add_source`` from a shell whose settings differ from the schedulers' (no
    HOLDFAST_SCHEDULES, another refresh interval) leaves every other schedule as the
    schedulers declared it: undeclaring or retiming them would skip their runs."""
    settings.HOLDFAST_SCHEDULES = {"nightly": {"kind": "test.echo", "cron": "0 3 * * *"}}
    scheduler.sync()
    before = {
        row.name: (row.declared, row.every, row.next_due_at) for row in Schedule.objects.all()
    }
    settings.HOLDFAST_SCHEDULES = {}
    settings.HOLDFAST_REFRESH_SECONDS = 60
    sources.add_source("docs", "sitemap", URL)
    sources.disable_source("docs")
    after = {row.name: (row.declared, row.every, row.next_due_at) for row in Schedule.objects.all()}
    assert {name: after[name] for name in before} == before
    assert after["discover:docs"][0] is False


def test_a_source_whose_stored_schedule_is_refused_stops_alone(settings):
    """A six-field cron stored by an earlier release: that source's schedule is left out
    (logged), and the scheduler still syncs and runs every other schedule."""
    settings.HOLDFAST_SCHEDULES = {"nightly": {"kind": "test.echo", "cron": "0 3 * * *"}}
    sources.add_source("good", "sitemap", URL)
    sources.add_source("old", "sitemap", URL)
    Source.objects.filter(name="old").update(schedule="0 3 * * * *")
    scheduler.sync()
    assert Schedule.objects.get(name="discover:good").declared
    assert Schedule.objects.get(name="nightly").declared
    assert not Schedule.objects.get(name="discover:old").declared


@pytest.mark.parametrize(
    ("url", "stored"),
    [
        ("https://exa\u200bmple.com/feed", "https://example.com/feed"),  # a zero-width space
        ("https://\uff45\uff58\uff41\uff4d\uff50\uff4c\uff45.com/", "https://example.com/"),
        ("https://b\u00fccher.de:8443/x?y", "https://xn--bcher-kva.de:8443/x?y"),
        ("https://example.com/feed", "https://example.com/feed"),
    ],
)
def test_a_source_url_is_stored_with_the_host_that_is_fetched(url, stored):
    """The host as typed could hide what is fetched: both above resolve as example.com
    (audit). It is stored as its IDNA A-label, as the fetch sends it."""
    source = sources.add_source("docs", "feed", url)
    assert source.url == stored


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("https://example.com:0/", "port must be a number from 1 to 65535"),
        ("https://example.com:99999/", "port must be a number from 1 to 65535"),
        ("https://xn--zz.com/", "is not a valid domain name"),
    ],
)
def test_a_source_url_that_could_never_be_fetched_is_refused(url, reason):
    """Port 0 was accepted (and checked against 443 for private addresses), an invalid
    A-label too; a port out of range said Python's 'Port out of range 0-65535' (audit)."""
    with pytest.raises(InvalidJob, match=reason):
        sources.add_source("docs", "feed", url)
    assert not Source.objects.exists()
