"""The internal operator API (DESIGN §9): thin views over the engine's own functions.

Every view answers JSON. Reading needs a ``read`` or ``write`` token, changing anything a
``write`` token (``ops.authentication``); ``health/`` also answers without a token, with
up/down only. A POST runs the same engine function as the matching command, inside one
transaction, with the token's name as the actor the engine logs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, ClassVar
from urllib.parse import parse_qsl

from django.conf import settings
from django.db import connection, transaction
from django.db.models import QuerySet
from django.http import HttpResponse
from drf_spectacular.renderers import OpenApiJsonRenderer, OpenApiJsonRenderer2
from drf_spectacular.utils import OpenApiExample, OpenApiResponse, extend_schema
from drf_spectacular.views import SpectacularAPIView
from prometheus_client.exposition import choose_encoder
from rest_framework import serializers
from rest_framework.exceptions import NotAuthenticated, NotFound, ValidationError
from rest_framework.permissions import AllowAny
from rest_framework.renderers import BaseRenderer, JSONRenderer
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.utils.urls import replace_query_param
from rest_framework.views import APIView

from ingestion import reconciliation, search
from ingestion.spool import Spool
from jobs import operations
from jobs.exceptions import InvalidJob
from jobs.log import get_logger
from jobs.models import Job
from jobs.serialization import job_detail_dict, job_dict
from jobs.status import queue_status

from . import metrics, schema
from .authentication import BearerTokenAuthentication
from .exceptions import database_down
from .messages import one_line
from .serializers import (
    PAGE_SIZE_DEFAULT,
    DeadJobsQuery,
    DeadJobsResponse,
    HealthResponse,
    IssueResponse,
    IssuesQuery,
    IssuesResponse,
    JobDetailResponse,
    JobResponse,
    QueueResponse,
    RequeueDead,
    RequeueRefusedResponse,
    RequeueResponse,
    Resolve,
    SearchQuery,
    SearchResponse,
)
from .tokens import Principal

log = get_logger("ops.api")


class OpsView(APIView):
    """Base of the API's views: validates the query string against ``query_serializer``.

    A parameter the endpoint does not know, or one given twice, is bad input: a typo in a
    filter must not silently widen what an operator acts on.
    """

    query_serializer: ClassVar[type[serializers.Serializer] | None] = None
    query: dict[str, Any]

    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        # The token before content negotiation (DRF's order is the other way round): a
        # refused token must be logged whatever the Accept header, not answered 406 unseen.
        self.perform_authentication(request)
        super().initial(request, *args, **kwargs)  # scope next
        self.query = self.validated_query(request)

    def validated_query(self, request: Request) -> dict[str, Any]:
        known = list(self.query_serializer().fields) if self.query_serializer else []
        try:  # Django decodes with replacement characters: %ff would read as "\ufffd"
            parse_qsl(request.META.get("QUERY_STRING", ""), errors="strict")
        except UnicodeDecodeError:
            raise ValidationError({"query": ["the query string is not valid UTF-8"]}) from None
        errors: dict[str, list[str]] = {}
        for name in request.query_params:
            if name not in known:
                takes = f"it takes {', '.join(known)}" if known else "it takes none"
                errors[name] = [f"unknown parameter for this endpoint ({takes})"]
            elif len(request.query_params.getlist(name)) > 1:
                errors[name] = ["given more than once"]
        if errors:
            raise ValidationError(errors)
        if self.query_serializer is None:
            return {}
        found = self.query_serializer(data=request.query_params.dict())
        found.is_valid(raise_exception=True)
        return dict(found.validated_data)


def principal(request: Request) -> Principal:
    """The token behind an authenticated request (the permission class guarantees one)."""
    user: object = request.user
    if not isinstance(user, Principal):
        raise NotAuthenticated()
    return user


def refuse_body(request: Request) -> None:
    """An action that takes no body refuses one (an empty JSON object aside), as the others
    refuse a bad one: parsed first, so a body that is not JSON (415), not valid JSON (400)
    or too large (413) is refused before anything is done."""
    data = request.data  # {} (or an empty QueryDict) when there is no body
    if not isinstance(data, Mapping) or data:
        raise ValidationError({"body": ["this action takes no body (send none, or {})"]})


def paginate(
    request: Request,
    query: dict[str, Any],
    found: QuerySet[Any],
    key: str,
    shape: Callable[[Any], dict[str, Any]],
) -> dict[str, Any]:
    """One page of ``found`` (already in a stable order) as ``{count, page, …, key: […]}``."""
    page: int = query.get("page", 1)
    size: int = query.get("page_size", PAGE_SIZE_DEFAULT)
    count = found.count()
    last = max(1, math.ceil(count / size))
    offset = (page - 1) * size
    rows = operations.rows_by_id(found, offset, offset + size) if offset < count else []
    items = [shape(item) for item in rows]
    url = request.build_absolute_uri()

    def link(number: int) -> str:
        return replace_query_param(url, "page", number)

    return {
        "count": count,
        "page": page,
        "page_size": size,
        "next": link(page + 1) if page < last else None,
        "previous": link(min(page - 1, last)) if page > 1 else None,
        key: items,
    }


def check_filters(kind: str | None, lane: str | None) -> None:
    """``operations.check_filters`` for a query or body: a kind or lane that nothing knows
    is a 404 naming it, as an unknown source is (not an empty answer, not a 400: the
    request is well formed, what it names does not exist)."""
    try:
        operations.check_filters(kind, lane)
    except InvalidJob as exc:  # an unknown lane (an unknown kind is a 404 already)
        raise NotFound(str(exc)) from None


class QueueView(OpsView):
    """The figures of ``queue_status --json``."""

    @extend_schema(
        operation_id="queue_status",
        tags=["queue"],
        summary="The queue's figures (queue_status --json)",
        responses={200: QueueResponse, **schema.READ_ERRORS},
    )
    def get(self, request: Request) -> Response:
        return Response(queue_status())


class DeadJobsView(OpsView):
    """Dead jobs, filtered by lane, kind and time of death, newest first."""

    query_serializer = DeadJobsQuery

    @extend_schema(
        operation_id="list_dead_jobs",
        tags=["jobs"],
        summary="Dead jobs, newest first, with their last error",
        parameters=[DeadJobsQuery],
        responses={
            200: DeadJobsResponse,
            404: schema.error(schema.UNKNOWN_FILTER),
            **schema.READ_ERRORS,
        },
    )
    def get(self, request: Request) -> Response:
        kind, lane = self.query.get("kind"), self.query.get("lane")
        found = operations.dead_jobs(kind=kind, lane=lane, since=self.query.get("since"))
        page = paginate(request, self.query, found.order_by("-pk"), "jobs", job_dict)
        if not page["count"]:  # none: a kind or lane nothing knows is a typo, not "no jobs"
            check_filters(kind, lane)
        return Response(page)


class RequeueDeadView(OpsView):
    """``requeue_dead`` over HTTP: each chosen dead job requeued on its own."""

    @extend_schema(
        operation_id="requeue_dead_jobs",
        tags=["jobs"],
        summary="Requeue dead jobs (requeue_dead --json)",
        description="Each chosen dead job goes back to `queued` on its own, with a fresh "
        "attempt budget. The body chooses them as `requeue_dead` does (`ids`, `kind`, `lane`, "
        "or `all`; one that names none chooses no job). A job that cannot be requeued (its "
        "unique key is held by a live job, or it is not dead) is listed in `conflicts` with "
        "the reason, and the others are requeued all the same: 200. Only when there were "
        "conflicts and nothing could be requeued: 409, with the same fields. `dry_run` "
        "changes nothing. A filter (`kind`, `lane`, `all`) requeues at most `limit` jobs "
        "(default 1,000) a request, oldest first: while `more` is true, ask again with "
        "`after` set to the answer's `last_id`.",
        request=RequeueDead,
        examples=[OpenApiExample("by kind", value={"kind": "photo.resize"}, request_only=True)],
        responses={
            200: RequeueResponse,
            409: OpenApiResponse(RequeueRefusedResponse, description="nothing requeued"),
            **schema.WRITE_ERRORS,
            404: schema.error("no job has an id given in `ids`, or " + schema.UNKNOWN_FILTER),
        },
    )
    def post(self, request: Request) -> Response:
        body = RequeueDead(data=request.data)
        body.is_valid(raise_exception=True)
        chosen = body.validated_data
        ids = chosen.get("ids") or []
        kind, lane = chosen.get("kind"), chosen.get("lane")
        selected: list[Job] = []
        more = False
        if ids or kind or lane or chosen["all"]:  # a body that names nothing chooses no job
            dead = operations.dead_jobs(ids, kind=kind, lane=lane).only(*operations.REQUEUE_FIELDS)
            if not ids:  # a filter: one bounded batch, oldest first, from `after` on
                limit = chosen["limit"]
                selected = operations.rows_by_id(
                    dead.filter(pk__gt=chosen.get("after", 0)), 0, limit + 1
                )
                more, selected = len(selected) > limit, selected[:limit]
            else:
                selected = list(dead)
            if not selected:  # an unknown kind or lane is bad input, also past `after`
                check_filters(kind, lane)
        if ids:
            known = set(Job.objects.filter(pk__in=ids).values_list("pk", flat=True))
            missing = sorted(set(ids) - known)
            if missing:
                raise NotFound(f"no job with id {', '.join(map(str, missing))}")
        actor = principal(request).name
        report = operations.requeue_each(selected, actor=actor, dry_run=chosen["dry_run"])
        conflicts = report.conflicts
        if ids:  # named jobs not selected: not dead, or outside the kind or lane given
            found = {job.pk for job in selected}
            conflicts = sorted(
                conflicts + operations.left_out(ids, found, kind, lane, actor),
                key=lambda c: c["id"],
            )
        data: dict[str, Any] = {
            "requeued": report.requeued,
            "dry_run": chosen["dry_run"],
            "conflicts": conflicts,
            "more": more,
            "last_id": selected[-1].pk if selected else None,
        }
        if conflicts and not report.requeued:
            reasons = "; ".join(conflict["reason"] for conflict in conflicts[:3])
            refused = {"error": f"nothing requeued: {reasons}", "code": "conflict", **data}
            return Response(refused, status=409)
        return Response(data)


class JobView(OpsView):
    """One job and the record of each attempt (``show_job --json``)."""

    @extend_schema(
        operation_id="get_job",
        tags=["jobs"],
        summary="One job with every attempt and its error",
        parameters=[schema.id_parameter("job_id", "job")],
        responses={200: JobDetailResponse, 404: schema.NOT_FOUND, **schema.READ_ERRORS},
    )
    def get(self, request: Request, job_id: int) -> Response:
        return Response(job_detail_dict(operations.get_job(job_id)))


class RequeueView(OpsView):
    """``requeue_dead ID`` over HTTP."""

    @extend_schema(
        operation_id="requeue_job",
        tags=["jobs"],
        summary="Requeue a dead job (requeue_dead ID)",
        description="Back to `queued`, runnable now, with a fresh attempt budget. Only a dead "
        "job can be requeued: any other state is a 409.",
        parameters=[schema.id_parameter("job_id", "job")],
        request=None,
        responses={200: JobResponse, 409: schema.CONFLICT, **schema.WRITE_ERRORS},
    )
    def post(self, request: Request, job_id: int) -> Response:
        refuse_body(request)
        with transaction.atomic():
            job = operations.requeue_one(job_id, actor=principal(request).name)
        return Response(job_dict(job))


class CancelView(OpsView):
    """``cancel_job ID`` over HTTP."""

    @extend_schema(
        operation_id="cancel_job",
        tags=["jobs"],
        summary="Cancel a job (cancel_job ID)",
        description="A queued job is cancelled at once (`state` is `cancelled`). A running job is "
        "asked to stop (`cancel_requested` is true, `state` still `running`): its handler sees "
        "the request at once on PostgreSQL (NOTIFY), else within 5 seconds, and ends "
        "`cancelled` if it honours it. A finished "
        "job is a 409.",
        parameters=[schema.id_parameter("job_id", "job")],
        request=None,
        responses={200: JobResponse, 409: schema.CONFLICT, **schema.WRITE_ERRORS},
    )
    def post(self, request: Request, job_id: int) -> Response:
        refuse_body(request)
        # No transaction around it: ``cancel`` bounds its own lock wait (on SQLite an
        # outer one would wait the busy timeout, 20 s, for the write lock first).
        job = operations.cancel(job_id, actor=principal(request).name)
        return Response(job_dict(job))


class IssuesView(OpsView):
    """Reconciliation issues, filtered by status, kind and source, newest first."""

    query_serializer = IssuesQuery

    @extend_schema(
        operation_id="list_reconciliation_issues",
        tags=["reconciliation"],
        summary="Reconciliation issues, newest first",
        parameters=[IssuesQuery],
        responses={200: IssuesResponse, 404: schema.NOT_FOUND, **schema.READ_ERRORS},
    )
    def get(self, request: Request) -> Response:
        try:
            found = reconciliation.issues(
                status=self.query.get("status"),
                kind=self.query.get("kind"),
                source=self.query.get("source"),
            )
        except InvalidJob as exc:  # status and kind are checked above: an unknown source
            raise NotFound(str(exc)) from None  # as search/ answers an unknown source
        page = paginate(request, self.query, found, "issues", reconciliation.issue_dict)
        return Response(page)


class ResolveView(OpsView):
    """Resolve one reconciliation issue, with a comment saying why."""

    @extend_schema(
        operation_id="resolve_reconciliation_issue",
        tags=["reconciliation"],
        summary="Resolve an issue, saying why",
        description="`resolved_by` becomes the token's name. An issue resolves once: a second "
        "resolve is a 409.",
        parameters=[schema.id_parameter("issue_id", "issue")],
        request=Resolve,
        examples=[
            OpenApiExample("resolve", value={"comment": "re-sent by the lab"}, request_only=True)
        ],
        responses={
            200: IssueResponse,
            409: schema.CONFLICT,
            **schema.WRITE_ERRORS,
        },
    )
    def post(self, request: Request, issue_id: int) -> Response:
        body = Resolve(data=request.data)
        body.is_valid(raise_exception=True)
        with transaction.atomic():
            issue = reconciliation.resolve(
                issue_id, by=principal(request).name, comment=body.validated_data["comment"]
            )
        return Response(reconciliation.issue_dict(issue))


class SearchView(OpsView):
    """Full-text search over the fetched artifacts (``manage.py search``)."""

    query_serializer = SearchQuery

    @extend_schema(
        operation_id="search_artifacts",
        tags=["search"],
        summary="Full-text search over artifacts, best match first",
        description="Any text is a valid query: it is never parsed as query syntax that could "
        "fail. A missing or blank `q` or a `limit` outside 1 to 100 is a 400 naming the "
        "parameter; an unknown `source` is a 404.",
        parameters=[SearchQuery],
        responses={
            200: SearchResponse,
            404: schema.error("no source has the name given as `source`"),
            **schema.READ_ERRORS,
        },
    )
    def get(self, request: Request) -> Response:
        hits = search.search(
            self.query["q"],
            source=self.query.get("source"),
            limit=self.query.get("limit", search.DEFAULT_LIMIT),
        )
        return Response({"count": len(hits), "hits": [search.hit_dict(hit) for hit in hits]})


class MetricsView(OpsView):
    """Prometheus's scrape target: every figure read from the database (``ops.metrics``)."""

    @extend_schema(
        operation_id="metrics",
        tags=["health"],
        summary="Prometheus metrics (text exposition format)",
        description="Read scope. Prometheus text format, or OpenMetrics when the `Accept` "
        "header asks for it. Counters are kept in the database: they only grow, across API "
        'restarts and job pruning. See docs/operations.md, "Metrics".',
        responses={
            (200, "text/plain"): OpenApiResponse(str, description="the metrics"),
            **{status: error for status, error in schema.READ_ERRORS.items() if status != 406},
        },
    )
    def get(self, request: Request) -> HttpResponse:
        encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
        return HttpResponse(encoder(metrics.registry()), content_type=content_type)

    def perform_content_negotiation(
        self, request: Request, force: bool = False
    ) -> tuple[BaseRenderer, str]:
        # The body is Prometheus's format whatever was asked (get() picks the variant);
        # errors (401, 403, 503) are JSON like every other error of the API.
        return JSONRenderer(), "application/json"


class HealthView(OpsView):
    """200 ``ok``, or 503 when something needs a human; details for a token holder."""

    authentication_classes = [BearerTokenAuthentication]
    permission_classes = [AllowAny]

    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        # The database first: when it is down, that is the answer whatever the token
        # (even one too malformed to need the database to refuse it).
        with connection.cursor() as cursor:  # raises if the database is unreachable
            cursor.execute("SELECT 1")
        super().initial(request, *args, **kwargs)

    @extend_schema(
        operation_id="health",
        tags=["health"],
        summary="Liveness and readiness",
        description="200 `ok`; 503 `failing` when no worker is live, the spool is overdue or "
        "the ingester is stuck (not taking files), 503 `down` when the database is "
        "unreachable. Without a token: only `status`. With a valid token (read or write): "
        "also `reasons` (each with a `code` and a one-line `detail`), the database, worker "
        "heartbeats and the spool's backlog. A bad token is a 401 here too. When the "
        'database is unreachable: 503 with only `{"status": "down"}`.',
        responses={
            200: HealthResponse,
            400: schema.BAD_INPUT,
            401: schema.UNAUTHENTICATED,
            405: schema.NOT_ALLOWED,
            406: schema.NOT_ACCEPTABLE,
            503: OpenApiResponse(
                HealthResponse, description="failing (see `reasons`), or down: no database"
            ),
        },
    )
    def get(self, request: Request) -> Response:
        workers, spool = worker_health(), spool_health()
        reasons = health_reasons(workers, spool)
        if not reasons:
            status, code = "ok", 200
        else:
            status, code = "failing", 503
            # Logged here, at warning, with the reasons: Django would log each probe's 503
            # as an error ("Service Unavailable"), without them.
            log.warning("api_health_failing", reasons=[reason["code"] for reason in reasons])
        if not isinstance(request.user, Principal):
            response = Response({"status": status}, status=code)
        else:
            body = {
                "status": status,
                "reasons": reasons,
                "database": "ok",
                "workers": workers,
                "spool": spool,
            }
            response = Response(body, status=code)
        response._has_been_logged = True  # type: ignore[attr-defined]  # see above
        return response

    def handle_exception(self, exc: Exception) -> Response:
        # Also when the token could not be checked (that needs the database): down is all
        # anyone learns then.
        if database_down(exc):
            log.warning("api_database_unavailable", error=f"{type(exc).__name__}: {exc}")
            return Response({"status": "down"}, status=503)
        return super().handle_exception(exc)


def health_reasons(workers: dict[str, Any], spool: dict[str, Any]) -> list[dict[str, str]]:
    """Why ``health/`` is failing (empty: it is not), each ``{code, detail}``."""
    reasons = []
    if not workers["live"]:
        reasons.append(
            {
                "code": "no_live_worker",
                "detail": f"no worker has sent a heartbeat in the last "
                f"{workers['stale_after_s']:g} s ({workers['stale']} registered worker(s) gone)",
            }
        )
    age = spool.get("oldest_age_s")
    if spool.get("stale"):
        reasons.append(
            {
                "code": "spool_overdue",
                "detail": f"the oldest submission in incoming/ has waited {age:.0f} s, longer "
                f"than the grace period of {spool['grace_s']:g} s: the ingester stops on it",
            }
        )
    stuck_after = float(settings.HOLDFAST_SPOOL_STUCK_SECONDS)
    if stuck_after and age is not None and age > stuck_after:
        reasons.append(
            {
                "code": "ingester_stuck",
                "detail": f"{spool['pending']} submission(s) wait in incoming/, the oldest for "
                f"{age:.0f} s (HOLDFAST_SPOOL_STUCK_SECONDS is {stuck_after:g}): no ingester "
                "is taking them",
            }
        )
    if spool.get("error"):
        reasons.append({"code": "spool_unreadable", "detail": one_line(spool["error"])})
    return reasons


def worker_health() -> dict[str, Any]:
    """Workers not stopped, live or gone by their heartbeat (the rule of queue_status)."""
    counts = metrics.worker_counts()
    return {
        "live": counts["live"],
        "gone": counts["gone"],
        "stale": counts["gone"],  # the older name of gone
        "stale_after_s": counts["stale_after_s"],
    }


def spool_health() -> dict[str, Any]:
    """How many submissions wait in ``incoming/`` and the age of the oldest, in seconds,
    measured from its arrival as the ingester's grace alert measures it
    (``Spool.backlog``); ``stale`` and ``grace_s`` only when the oldest is past the grace
    period."""
    backlog = Spool.from_settings().backlog()
    if backlog.get("error"):
        return {"pending": None, "oldest_age_s": None, "error": backlog["error"]}
    health = {"pending": backlog["pending"], "oldest_age_s": backlog["oldest_age_s"]}
    if backlog["stale"]:  # the ingester stops on it: alert
        health.update(stale=True, grace_s=backlog["grace_s"])
    return health


class SchemaView(OpsView, SpectacularAPIView):
    """The OpenAPI 3 schema of this API, as JSON, for anyone: it describes, it holds no data.

    It reads no token, so a bad one is not refused here. It takes no query parameter, as
    ``OpsView`` checks: drf-spectacular would copy ``?version=`` into the schema and into
    the ``Content-Disposition`` header (a newline there was a 500), and ``?lang=``.
    """

    renderer_classes = [OpenApiJsonRenderer2, OpenApiJsonRenderer]
    authentication_classes = []
    permission_classes = [AllowAny]

    def _get_version_parameter(self, request: Request) -> None:
        return None  # one version: the path's v1
