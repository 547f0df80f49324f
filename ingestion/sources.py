"""Sources: named places to discover documents, each with its own discovery schedule.

Every enabled source contributes one schedule, ``discover:<name>``, through the
``sources`` schedule provider; adding or disabling a source syncs the schedule rows at
once. A source without an explicit cron runs daily at a minute derived from its name, so
many sources spread over the day instead of all firing at midnight.
"""

from __future__ import annotations

import hashlib
import ipaddress
import math
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import idna
from django.core.exceptions import ImproperlyConfigured, ValidationError
from django.core.validators import URLValidator, validate_slug
from django.db import IntegrityError, transaction
from django.db.models import Count, Max
from django.db.models.functions import Now

from jobs import scheduler
from jobs.exceptions import HoldfastError, InvalidJob
from jobs.log import get_logger
from jobs.options import cron_problem
from jobs.schedules import Declared, schedule_provider
from jobs.serialization import timestamp

from . import egress, listings
from .models import Artifact, DiscoveryPage, DiscoveryRun, PageState, Source, SourceKind

log = get_logger("ingestion.sources")

DISCOVER_KIND = "ingestion.discover_source"
NAME_MAX_LENGTH = 100
URL_MAX_LENGTH = 2000
MAX_PAGES_PER_RUN = 100_000
MAX_SPACING_SECONDS = 3600.0  # an hour between requests is as polite as any site asks


class SourceNotFound(HoldfastError, LookupError):
    """No source has this name."""


def spread_schedule(name: str) -> str:
    """A daily cron at a minute of the day that depends only on the name (stable, spread)."""
    digest = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big")
    minute_of_day = digest % (24 * 60)
    return f"{minute_of_day % 60} {minute_of_day // 60} * * *"


def schedule_name(source_name: str) -> str:
    return f"discover:{source_name}"


def add_source(
    name: str,
    kind: str,
    url: str,
    schedule: str | None = None,
    spacing: float = 1.0,
    max_pages_per_run: int = 10,
    allow_private: bool = False,
) -> Source:
    """Create a source and its discovery schedule; bad input raises ``InvalidJob``.

    Without ``allow_private`` a URL whose host resolves to a loopback, private,
    link-local or metadata address is refused here, naming the address (every request is
    checked again when it connects: this is only the early answer).
    """
    _validate(name, kind, url, schedule, spacing, max_pages_per_run)
    url = _with_ascii_host(url)
    _check_egress(url, allow_private)
    cron = schedule or spread_schedule(name)
    if Source.objects.filter(name=name).exists():
        raise InvalidJob(f"a source named {name!r} already exists")
    try:
        with transaction.atomic():
            source = Source.objects.create(
                name=name,
                kind=kind,
                url=url,
                schedule=cron,
                spacing_seconds=spacing,
                max_pages_per_run=max_pages_per_run,
                allow_private=allow_private,
            )
    except IntegrityError:
        raise InvalidJob(f"a source named {name!r} already exists") from None
    log.info(
        "source_added",
        source=name,
        kind=kind,
        url=url,
        schedule=cron,
        spacing=spacing,
        allow_private=allow_private,
    )
    scheduler.sync(origin="source")
    return source


def _validate(
    name: str, kind: str, url: str, schedule: str | None, spacing: float, max_pages: int
) -> None:
    try:
        validate_slug(name)
    except ValidationError:
        raise InvalidJob(
            f"source name {name!r} must be a slug: letters, digits, '-' and '_'"
        ) from None
    if len(name) > NAME_MAX_LENGTH:
        raise InvalidJob(f"source name must be at most {NAME_MAX_LENGTH} characters")
    if kind not in SourceKind.values:
        raise InvalidJob(f"source kind must be one of {', '.join(SourceKind.values)}, not {kind!r}")
    try:
        URLValidator(schemes=["http", "https"])(url)
    except ValidationError:
        raise InvalidJob(f"not an http(s) URL: {url!r}") from None
    if listings.UNSTORABLE.search(url):
        # What a listing's URL may not hold either: no server serves it, and a NUL cannot
        # be stored by PostgreSQL (the run's first page row).
        raise InvalidJob(f"the URL holds a control character or invalid Unicode: {url!r}")
    if len(url.encode()) > URL_MAX_LENGTH:  # (no surrogate: refused above)
        # Bytes, as a listed URL's (listings.URL_LENGTH): the source URL is the run's first
        # page, and PostgreSQL cannot index a page row much longer (2,000 CJK characters
        # are 6,000 bytes), so every discovery of the source failed.
        raise InvalidJob(f"the URL must be at most {URL_MAX_LENGTH} bytes of UTF-8")
    parts = urlsplit(url)
    if parts.username is not None or parts.password is not None:
        # They would be stored and shown in clear: list_sources, logs, page rows, issues.
        raise InvalidJob(
            "the URL must not hold a user name or password (it is shown in listings, logs "
            "and issues); sources are fetched without credentials"
        )
    if schedule is not None and (problem := cron_problem(schedule)):
        raise InvalidJob(f"bad cron schedule {schedule!r}: {problem}")
    if not (math.isfinite(spacing) and 0 <= spacing <= MAX_SPACING_SECONDS):
        raise InvalidJob(
            f"spacing must be from 0 to {MAX_SPACING_SECONDS:g} seconds, not {spacing!r}"
        )
    if not 1 <= max_pages <= MAX_PAGES_PER_RUN:
        raise InvalidJob(f"max pages per run must be from 1 to {MAX_PAGES_PER_RUN}")


def _with_ascii_host(url: str) -> str:
    """``url`` with its host as the DNS name that is fetched (IDNA 2008 with UTS 46: the
    A-label, lower case) and a port from 1 to 65535. A host as typed could hide what is
    fetched (a zero-width space, full-width letters: both resolve as ``example.com``);
    one IDNA refuses (an invalid ``xn--`` label) could never be fetched, nor port 0."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = 0
    if port == 0:
        raise InvalidJob(f"the URL's port must be a number from 1 to 65535: {url!r}")
    host = parts.hostname or ""
    try:
        ipaddress.ip_address(host)
        return url  # an address literal: no name to encode
    except ValueError:
        pass
    try:
        ascii_host = idna.encode(host, uts46=True).decode("ascii")
    except idna.IDNAError as exc:
        raise InvalidJob(f"the URL's host {host!r} is not a valid domain name: {exc}") from None
    netloc = ascii_host if port is None else f"{ascii_host}:{port}"  # no user: refused
    return url if netloc == parts.netloc else urlunsplit(parts._replace(netloc=netloc))


def _check_egress(url: str, allow_private: bool) -> None:
    parts = urlsplit(url)
    host = parts.hostname or ""
    try:
        addresses = egress.resolve(host, parts.port or (443 if parts.scheme == "https" else 80))
    except egress.ResolutionError:
        return  # not resolvable now: every request is checked when it connects anyway
    bad = egress.refused(addresses, allow_private)
    if bad is None:
        return
    if allow_private:
        raise InvalidJob(
            f"{host} resolves to {bad}: metadata, unspecified, multicast and reserved"
            " addresses are refused even with --allow-private"
        )
    raise InvalidJob(
        f"{host} resolves to {bad}, a loopback, private, link-local or metadata address;"
        " add the source with --allow-private if it is one of your own hosts"
    )


def get_source(name: str) -> Source:
    try:
        return Source.objects.get(name=name)
    except Source.DoesNotExist:
        raise SourceNotFound(f"no source named {name!r}") from None


def disable_source(name: str) -> Source:
    """Stop discovering a source: its schedule goes; its artifacts and runs stay."""
    source = get_source(name)
    if not source.enabled:
        return source
    Source.objects.filter(pk=source.pk, enabled=True).update(enabled=False, disabled_at=Now())
    log.info("source_disabled", source=name)
    scheduler.sync(origin="source")
    return get_source(name)


def source_dict(source: Source) -> dict[str, Any]:
    """The JSON shape of a source, with its latest discovery run."""
    return source_dicts([source])[0]


def source_dicts(sources: list[Source]) -> list[dict[str, Any]]:
    """``sources`` as :func:`source_dict` gives each, in four queries whatever their number
    (one per source each for its artifacts, last run and pending pages was 150 queries
    for 50 sources in ``list_sources``)."""
    ids = [source.pk for source in sources]
    counts = dict(
        Artifact.objects.filter(source_id__in=ids)
        .values_list("source_id")
        .annotate(n=Count("id"))
        .order_by()
    )
    latest = (
        DiscoveryRun.objects.filter(source_id__in=ids)
        .values("source_id")
        .annotate(last=Max("id"))
        .values("last")
    )
    runs = {run.source_id: run for run in DiscoveryRun.objects.filter(pk__in=latest)}
    pending = dict(
        DiscoveryPage.objects.filter(run__in=list(runs.values()), state=PageState.PENDING)
        .values_list("run_id")
        .annotate(n=Count("id"))
        .order_by()
    )
    return [
        {
            "name": source.name,
            "kind": source.kind,
            "url": source.url,
            "schedule": source.schedule,
            "spacing_seconds": source.spacing_seconds,
            "max_pages_per_run": source.max_pages_per_run,
            "refresh_days": source.refresh_days,
            "enabled": source.enabled,
            "allow_private": source.allow_private,
            "created_at": timestamp(source.created_at),
            "disabled_at": timestamp(source.disabled_at),
            "robots_fetched_at": timestamp(source.robots_fetched_at),
            "artifacts": counts.get(source.pk, 0),
            "last_run": (
                run_dict(run, pending.get(run.pk, 0))
                if (run := runs.get(source.pk)) is not None
                else None
            ),
        }
        for source in sources
    ]


def run_dict(run: DiscoveryRun, pending: int) -> dict[str, Any]:
    """A run's JSON shape (``pending``: its pending pages)."""
    return {
        "id": run.pk,
        "state": run.state,
        "pages": run.pages,
        "items": run.items,
        "jobs": run.jobs,
        "pending_pages": pending,
        "failed_pages": run.failed_pages,
        "started_at": timestamp(run.started_at),
        "finished_at": timestamp(run.finished_at),
        "error": run.error or None,
    }


@schedule_provider("sources")
def source_schedules() -> list[Declared]:
    """One discovery schedule per enabled source (cron in UTC). A source whose stored
    schedule is no longer accepted (a six-field cron of an earlier release) is left out
    and logged, so that it alone stops: every other schedule still syncs and runs."""
    found = []
    for source in Source.objects.filter(enabled=True).order_by("name"):
        try:
            found.append(
                Declared(
                    name=schedule_name(source.name),
                    kind=DISCOVER_KIND,
                    cron=source.schedule,
                    args={"source": source.name},
                    origin="source",
                )
            )
        except ImproperlyConfigured as exc:
            log.error(
                "source_schedule_invalid",
                source=source.name,
                schedule=source.schedule,
                error=str(exc),
                hint=f"disable_source {source.name}, and add it again under a new name "
                "with a five-field --schedule",
            )
    return found
