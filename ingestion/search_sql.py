"""The full-text index's vendor-specific statements, kept together (schema: migration 0005).

write_document
    PostgreSQL only: set ``artifact_texts.document`` from the row's title (weight A) and
    text (weight B) with the configured text-search configuration. On SQLite the FTS5
    table follows ``artifact_texts`` through triggers, so there is nothing to do.

matches
    The best ``limit`` artifacts for a query, best first, as ``Match(artifact_id, rank,
    title, snippet)``. ``rank`` is higher for a better match on both databases (PostgreSQL:
    ``ts_rank_cd``; SQLite: ``bm25`` negated, as bm25 is lower for better matches); the
    figures of the two databases are not comparable. Snippets mark matched terms with
    ``[`` and ``]``. PostgreSQL takes the user's text through ``websearch_to_tsquery``,
    which accepts any input; SQLite takes an FTS5 query that ``fts5_query`` built.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from django.conf import settings
from django.db import connection

from .models import Artifact, ArtifactText

TEXTS = ArtifactText._meta.db_table
ARTIFACTS = Artifact._meta.db_table
FTS_TABLE = "artifact_search"

MARK_START, MARK_END, ELLIPSIS = "[", "]", "…"
TITLE_WEIGHT = 4.0  # SQLite bm25 column weight of the title (the text weighs 1)

POSTGRES_WRITE = (
    f"UPDATE {TEXTS} SET document = "
    "setweight(to_tsvector(%s::regconfig, title), 'A') || "
    "setweight(to_tsvector(%s::regconfig, text), 'B') "
    "WHERE artifact_id = %s"
)

# The inner query ranks and limits; ts_headline, the costly part, runs on the few kept.
POSTGRES_MATCHES = f"""
    SELECT hit.artifact_id, hit.rank, hit.title,
           ts_headline(%s::regconfig, hit.text, hit.query, %s)
    FROM (
        SELECT t.artifact_id, t.title, t.text, q.query, ts_rank_cd(t.document, q.query) AS rank
        FROM {TEXTS} t
        JOIN {ARTIFACTS} a ON a.id = t.artifact_id
        CROSS JOIN websearch_to_tsquery(%s::regconfig, %s) AS q(query)
        WHERE t.document @@ q.query {{source_filter}}
        ORDER BY rank DESC, t.artifact_id
        LIMIT %s
    ) AS hit
    ORDER BY hit.rank DESC, hit.artifact_id
"""
POSTGRES_HEADLINE_OPTIONS = (
    f"StartSel={MARK_START}, StopSel={MARK_END}, MinWords=8, MaxWords=24, "
    f'MaxFragments=2, FragmentDelimiter=" {ELLIPSIS} "'
)

SQLITE_MATCHES = f"""
    SELECT {FTS_TABLE}.rowid, -bm25({FTS_TABLE}, {TITLE_WEIGHT}, 1.0) AS rank, {FTS_TABLE}.title,
           snippet({FTS_TABLE}, 1, '{MARK_START}', '{MARK_END}', '{ELLIPSIS}', 16)
    FROM {FTS_TABLE}
    JOIN {ARTIFACTS} a ON a.id = {FTS_TABLE}.rowid
    WHERE {FTS_TABLE} MATCH %s {{source_filter}}
    ORDER BY rank DESC, {FTS_TABLE}.rowid
    LIMIT %s
"""

# A double-quoted phrase (closed or not), or a run of other non-space characters.
QUERY_PART = re.compile(r'"([^"]*)"?|([^\s"]+)')
WORD = re.compile(r"\w+")


@dataclass(frozen=True)
class Match:
    artifact_id: int
    rank: float
    title: str
    snippet: str


def write_document(artifact_id: int) -> None:
    """Bring the vendor index up to date with the ``artifact_texts`` row just written."""
    if connection.vendor != "postgresql":
        return  # the FTS5 triggers have done it
    config = settings.HOLDFAST_SEARCH_CONFIG
    with connection.cursor() as cursor:
        cursor.execute(POSTGRES_WRITE, [config, config, artifact_id])


def matches(query: str, source_id: int | None, limit: int) -> list[Match]:
    """The best ``limit`` matches of the user's ``query``, best first."""
    source_filter = "" if source_id is None else "AND a.source_id = %s"
    source_params = [] if source_id is None else [source_id]
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            config = settings.HOLDFAST_SEARCH_CONFIG
            cursor.execute(
                POSTGRES_MATCHES.format(source_filter=source_filter),
                [config, POSTGRES_HEADLINE_OPTIONS, config, query, *source_params, limit],
            )
        else:
            fts = fts5_query(query)
            if not fts:
                return []
            cursor.execute(
                SQLITE_MATCHES.format(source_filter=source_filter), [fts, *source_params, limit]
            )
        return [
            Match(int(pk), float(rank), title or "", snippet or "")
            for pk, rank, title, snippet in cursor
        ]


def fts5_query(text: str) -> str:
    """The user's text as an FTS5 query that cannot be a syntax error.

    Every word becomes a double-quoted FTS5 string, so operators (``AND``, ``NEAR``),
    column filters, ``*`` and parentheses lose their meaning; a ``"quoted phrase"`` stays
    a phrase. All parts must match (as with ``websearch_to_tsquery`` without ``or``).
    Empty when the text holds no word at all.
    """
    parts = []
    for phrase, bare in QUERY_PART.findall(text):
        words = WORD.findall(phrase) if phrase else []
        if words:
            parts.append(quoted(" ".join(words)))
        else:
            parts.extend(quoted(word) for word in WORD.findall(bare))
    return " ".join(parts)


def quoted(words: str) -> str:
    return '"' + words.replace('"', '""') + '"'
