"""``manage.py demo_sources``: the pull side of ingestion on a local site, in one command.

It serves the fixture site (``demo/site.py``) on 127.0.0.1 inside this process, adds it
as a sitemap source, and runs each cycle through the real engine: discovery is enqueued
as ``enqueue_discovery`` would, and a burst worker (the one ``runworker --burst`` runs)
works until no runnable job remains, so discovery, fetches and indexing all happen as
jobs, with leases, fencing and retries. Then it searches, takes one document off the site
and runs a second cycle, which reports it ``missing_from_source``.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import CommandParser
from django.db.models import Count

from demo.site import FixtureSite
from ingestion import reconciliation
from ingestion.discovery import start_discovery
from ingestion.models import Source
from ingestion.search import hit_dict, search
from ingestion.sources import add_source
from jobs.management.base import JobsCommand, bad_input
from jobs.models import Job
from jobs.worker import WorkerProcess

REMOVED = "/docs/tides.html"  # one of the site's samples, taken off before cycle 2


class Command(JobsCommand):
    help = (
        "Serve a local fixture site, add it as a source, discover, fetch and index it through "
        "the real engine, search it, then remove a page and show the reconciliation issue."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        super().add_arguments(parser)
        parser.add_argument("--name", default="demo-site", help="the source's name")
        parser.add_argument("--query", default="lighthouse keeper", help="what to search for")

    def handle(self, *args: Any, **options: Any) -> None:
        name, as_json = options["name"], options["as_json"]
        if Source.objects.filter(name=name).exists():
            raise bad_input(
                f"a source named {name!r} already exists: pass another --name, or run "
                "`make demo-sources`, which uses a fresh database"
            )
        self.say = (lambda text: None) if as_json else self.stdout.write
        with FixtureSite() as site:
            site.add_samples()
            self.say(f"fixture site at {site.base_url}/ with {len(site.documents)} documents")
            source = add_source(
                name, "sitemap", site.url("/sitemap.xml"), spacing=0, allow_private=True
            )
            self.say(f"added source {name!r}: sitemap {source.url}, spacing 0 s")
            cycles = [self.cycle(source, 1)]
            hits = search(options["query"], source=name, limit=1)
            hit = hit_dict(hits[0]) if hits else None
            self.show_hit(options["query"], hit)
            site.remove(REMOVED)
            self.say(f"removed {REMOVED} from the site")
            cycles.append(self.cycle(source, 2))
        found = [
            reconciliation.issue_dict(issue)
            for issue in reconciliation.issues(status="open", source=name)
        ]
        self.show_issues(found)
        if as_json:
            self.emit_json({"site": site.base_url, "cycles": cycles, "hit": hit, "issues": found})

    def cycle(self, source: Source, number: int) -> dict[str, Any]:
        """Enqueue a discovery, then work until nothing is runnable; the jobs run, by kind."""
        before = Job.objects.order_by("-pk").values_list("pk", flat=True).first() or 0
        start_discovery(source)
        WorkerProcess(worker_id=f"demo-sources-{source.name}", burst=True).run()
        ran = dict(
            Job.objects.filter(pk__gt=before)
            .values_list("kind")
            .annotate(n=Count("pk"))
            .order_by("kind")
        )
        states = dict(
            Job.objects.filter(pk__gt=before)
            .values_list("state")
            .annotate(n=Count("pk"))
            .order_by("state")
        )
        summary = ", ".join(f"{n} {kind}" for kind, n in ran.items())
        self.say(f"cycle {number}: {summary} ({', '.join(f'{n} {s}' for s, n in states.items())})")
        return {"cycle": number, "jobs": ran, "states": states}

    def show_hit(self, query: str, hit: dict[str, Any] | None) -> None:
        if hit is None:
            self.say(f"search {query!r}: no hit")
            return
        self.say(f"search {query!r}, best hit:")
        self.say(f"    {hit['title']}  <{hit['url']}>  rank {hit['rank']}")
        self.say(f"    {hit['snippet']}")

    def show_issues(self, found: list[dict[str, Any]]) -> None:
        self.say(f"open reconciliation issues of this source: {len(found)}")
        for issue in found:
            self.say(f"    #{issue['id']} {issue['kind']}: {issue['subject']}")
