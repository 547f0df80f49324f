"""The full-text index's vendor-specific statements, kept together (schema: migration 0005).

write_document
    PostgreSQL only: set ``artifact_texts.document`` from the row's title (weight A) and
    text (weight B), as :func:`searchable` gives them, with the configured text-search
    configuration. On SQLite the FTS5 table follows ``artifact_texts`` through triggers,
    so there is nothing to do.

matches
    The best ``limit`` artifacts for a query, best first, as ``Match(artifact_id, rank,
    title, snippet)``. ``rank`` is higher for a better match on both databases (PostgreSQL:
    ``ts_rank_cd``; SQLite: ``bm25`` negated, as bm25 is lower for better matches); the
    figures of the two databases are not comparable. Snippets mark matched terms with
    ``[`` and ``]``.

Both databases answer the same query the same way because neither reads the user's
text: :func:`parse_query` reads the web-search syntax once (words, ``"phrases"``,
``-word`` / ``-"phrase"`` to exclude, ``or`` between alternatives; ``or`` binds loosest,
as in ``websearch_to_tsquery``), drops what one side would ignore (stop words of the
English configuration; alternatives with nothing left to require), and each side is
built from that: PostgreSQL combines ``phraseto_tsquery`` terms with ``&&``, ``!!`` and
``||``, SQLite writes an FTS5 expression with ``AND``, ``NOT`` and ``OR`` over quoted
strings (so FTS5's own operators and column filters in the text mean nothing).
"""

from __future__ import annotations

import functools
import re
import unicodedata
from dataclasses import dataclass

from django.conf import settings
from django.db import connection

from .models import Artifact, ArtifactText

TEXTS = ArtifactText._meta.db_table
ARTIFACTS = Artifact._meta.db_table
FTS_TABLE = "artifact_search"

MARK_START, MARK_END, ELLIPSIS = "[", "]", "…"
TITLE_WEIGHT = 4.0  # SQLite bm25 column weight of the title (the text weighs 1)

# The title and text as :func:`searchable` gives them, not the columns: PostgreSQL's parser
# would keep ``docs.example.com``, ``ops@example.org``, ``3.14`` and paths as one token
# each, and keep ``café`` apart from ``cafe``, where FTS5 finds each word of them.
POSTGRES_WRITE = (
    f"UPDATE {TEXTS} SET document = "
    "setweight(to_tsvector(%s::regconfig, %s), 'A') || "
    "setweight(to_tsvector(%s::regconfig, %s), 'B') "
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
        CROSS JOIN (SELECT {{tsquery}}) AS q(query)
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

# An optional "-", then a double-quoted phrase (closed or not) or a run of other characters.
QUERY_PART = re.compile(r'(-?)(?:"([^"]*)"?|([^\s"]+))')
# What splits words: anything but letters, combining marks and decimal digits. Python's \w
# also takes "_" and "²", which SQLite's unicode61 tokenizer or PostgreSQL's parser drop: a
# query word made of them was an empty phrase on one database and nothing on the other.
WORD_CATEGORIES = frozenset({"Lu", "Ll", "Lt", "Lm", "Lo", "Mn", "Mc", "Nd"})
ASCII_SEPARATORS = re.compile(r"[^A-Za-z0-9]+")  # WORD_CATEGORIES' complement, in ASCII
# The combining marks FTS5's remove_diacritics drops (read off SQLite 3.40: "a" + mark +
# "b" is one token "ab"); the block's other marks split words there (OTHER_MARKS).
FTS5_DIACRITICS = frozenset(
    chr(code)
    for span in (
        (0x300, 0x304),
        (0x306, 0x30C),
        (0x30F, 0x30F),
        (0x311, 0x311),
        (0x31B, 0x31B),
        (0x323, 0x328),
        (0x32D, 0x32E),
        (0x330, 0x331),
    )
    for code in range(span[0], span[1] + 1)
)
OTHER_MARKS = frozenset(chr(code) for code in range(0x300, 0x370)) - FTS5_DIACRITICS
# PostgreSQL's english.stop (Snowball): the words the english configuration ignores.
_STOP_TEXT = """i me my myself we our ours ourselves you your yours yourself yourselves he him his
    himself she her hers herself it its itself they them their theirs themselves what which
    who whom this that these those am is are was were be been being have has had having do
    does did doing a an the and but if or because as until while of at by for with about
    against between into through during before after above below to from up down in out on
    off over under again further then once here there when where why how all any both each
    few more most other some such no nor not only own same so than too very s t can will
    just don should now"""
ENGLISH_STOP_WORDS = frozenset(_STOP_TEXT.split())


@dataclass(frozen=True)
class Term:
    words: tuple[str, ...]  # one word, or a phrase
    excluded: bool


Query = list[list[Term]]  # alternatives (joined by "or"), each a list of terms (all needed)


@dataclass(frozen=True)
class Match:
    artifact_id: int
    rank: float
    title: str
    snippet: str


def write_document(artifact_id: int, title: str, text: str) -> None:
    """Bring the vendor index up to date with the ``artifact_texts`` row just written
    (``title`` and ``text`` are that row's)."""
    if connection.vendor != "postgresql":
        return  # the FTS5 triggers have done it
    config = settings.HOLDFAST_SEARCH_CONFIG
    with connection.cursor() as cursor:
        cursor.execute(
            POSTGRES_WRITE, [config, searchable(title), config, searchable(text), artifact_id]
        )


def matches(query: str, source_id: int | None, limit: int) -> list[Match]:
    """The best ``limit`` matches of the user's ``query``, best first."""
    source_filter = "" if source_id is None else "AND a.source_id = %s"
    source_params = [] if source_id is None else [source_id]
    parsed = parse_query(query)
    if not parsed:
        return []
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            config = settings.HOLDFAST_SEARCH_CONFIG
            tsquery, tsquery_params = postgres_tsquery(parsed, config)
            cursor.execute(
                POSTGRES_MATCHES.format(source_filter=source_filter, tsquery=tsquery),
                [config, POSTGRES_HEADLINE_OPTIONS, *tsquery_params, *source_params, limit],
            )
        else:
            cursor.execute(
                SQLITE_MATCHES.format(source_filter=source_filter),
                [fts5_query(parsed), *source_params, limit],
            )
        return [
            Match(int(pk), float(rank), title or "", snippet or "")
            for pk, rank, title, snippet in cursor
        ]


def parse_query(text: str) -> Query:
    """The user's text in the web-search syntax, as alternatives of required terms.

    A term left without a word (punctuation, or stop words only) is dropped, as
    PostgreSQL drops it; an alternative with no term left to require (``-dogs`` alone)
    matches nothing, on both databases. Empty when nothing is left to search for.
    """
    alternatives: Query = [[]]
    for minus, phrase, bare in QUERY_PART.findall(text):
        if not minus and not phrase and bare.lower() == "or":
            alternatives.append([])
            continue
        words = significant(words_of(phrase or bare))
        if words:
            alternatives[-1].append(Term(words, excluded=bool(minus)))
    return [terms for terms in alternatives if any(not term.excluded for term in terms)]


def words_of(text: str) -> list[str]:
    """The words of a query part, as both databases' tokenizers read a document's."""
    return searchable(text).split()


def searchable(text: str) -> str:
    """``text`` as FTS5's ``unicode61 remove_diacritics 2`` tokenizer reads it: words
    (letters, marks, digits) between spaces, Latin letters without their diacritics
    (``Café`` is ``Cafe``; Greek ``ά`` and Cyrillic ``й`` keep theirs, as FTS5 does).

    PostgreSQL indexes and queries this text, so both databases find the same words:
    its parser alone keeps hosts, e-mail addresses, numbers with dots and paths whole
    (``example`` did not find ``docs.example.com``) and ``café`` apart from ``cafe``.
    """
    if text.isascii():
        return ASCII_SEPARATORS.sub(" ", text)
    return "".join(map(_folded, text))


@functools.cache
def _folded(ch: str) -> str:
    """One character as :func:`searchable` gives it (a text has few distinct ones)."""
    if ch in FTS5_DIACRITICS:
        return ""  # a combining diacritic: FTS5 drops it, whatever letter it follows
    decomposed = unicodedata.normalize("NFD", ch)
    base, marks = decomposed[0], decomposed[1:]
    if marks and base.isascii() and all(mark in FTS5_DIACRITICS for mark in marks):
        return base  # é, ừ, ǹ: an ASCII letter with diacritics FTS5 removes
    return ch if unicodedata.category(ch) in WORD_CATEGORIES and ch not in OTHER_MARKS else " "


def significant(words: list[str]) -> tuple[str, ...]:
    """The words without the stop words at either end (PostgreSQL ignores those); stop
    words inside a phrase stay, as positions PostgreSQL keeps (``keeps the lighthouse``)."""
    stop = stop_words()
    while words and words[0].lower() in stop:
        words = words[1:]
    while words and words[-1].lower() in stop:
        words = words[:-1]
    return tuple(words)


def stop_words() -> frozenset[str]:
    return ENGLISH_STOP_WORDS if settings.HOLDFAST_SEARCH_CONFIG == "english" else frozenset()


def postgres_tsquery(query: Query, config: str) -> tuple[str, list[str]]:
    """A tsquery expression for ``query`` and its parameters."""
    params: list[str] = []
    groups = []
    for terms in query:
        parts = []
        for term in sorted(terms, key=lambda term: term.excluded):
            params += [config, " ".join(term.words)]
            tsquery = "phraseto_tsquery(%s::regconfig, %s)"
            parts.append(f"!! {tsquery}" if term.excluded else tsquery)
        groups.append("(" + " && ".join(parts) + ")")
    return " || ".join(groups), params


def fts5_query(query: Query) -> str:
    """An FTS5 expression for ``query``: every word a quoted string, so nothing the user
    typed is FTS5 syntax (``NEAR``, ``*``, column filters, parentheses)."""
    groups = []
    for terms in query:
        required = " AND ".join(quoted(t.words) for t in terms if not t.excluded)
        excluded = "".join(f" NOT {quoted(t.words)}" for t in terms if t.excluded)
        groups.append(f"(({required}){excluded})")
    return " OR ".join(groups)


def quoted(words: tuple[str, ...]) -> str:
    text = " ".join(words)
    return '"' + text.replace('"', '""') + '"'
