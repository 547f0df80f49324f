"""What a spool submission is (``holdfast.submission/v1``, DESIGN §10) and how one is judged.

:func:`parse` turns a file's raw bytes into a :class:`Submission` or raises
:class:`InvalidSubmission`, the error of the submission itself: retrying cannot help, so
the file is quarantined. Nothing here touches the database or the file system, so
**every** exception raised while decoding, parsing or validating the bytes is the
submission's own (``OverflowError``, ``RecursionError``, anything: it is a function of the
bytes alone), except ``MemoryError``, which is the host's.

The checks, in order, each naming its ``stage`` in the error:

* ``limits``: the file is larger than ``max_file_bytes`` (checked before parsing);
* ``json``: not UTF-8 JSON; NaN or infinities; a non-integer number longer than
  ``max_number_chars``, outside a double's finite range, or with more than
  ``max_decimals`` digits after the point (``1e-20000``: PostgreSQL's numeric holds no
  more than 16,383); an integer of more than 4,300 digits; an object that names a key
  twice;
* ``schema``: the JSON Schema below (validated with ``jsonschema``); every error is kept
  (the first :data:`MAX_ERRORS` of them, and their count);
* ``limits``: more facts than ``max_facts``, an excerpt over ``max_excerpt_bytes``,
  nesting deeper than ``max_depth``, an attribute name over ``max_key_chars``, a string
  value over ``max_string_bytes``;
* ``semantic``: ``submitted_at`` is not an ISO 8601 time with an offset, or is outside
  :data:`EARLIEST` .. :data:`LATEST`; a string holds a NUL character or a lone surrogate
  (no database can store those, so retrying the insert could never succeed); one (entity,
  key) appears twice in the same submission.

The limits sit below what either database refuses (PostgreSQL: jsonb nesting ~12,000,
numeric digits, 1 GB values; SQLite: JSON nesting 2,000 before 3.45, 1,000 after), so a
valid submission is one both databases store. Numbers are kept exactly: a number a
double cannot hold exactly (``12345678901234567890.5``) is carried as a ``Decimal`` and
written with all its digits (:func:`encode`); PostgreSQL's jsonb (numeric) and SQLite's
JSON text both keep them.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from django.conf import settings
from jsonschema import Draft202012Validator  # type: ignore[import-untyped]

from jobs import timestamps

SCHEMA_ID = "holdfast.submission/v1"
MIB = 1024 * 1024

SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": "https://holdfast.invalid/schemas/submission-v1.json",
    "title": SCHEMA_ID,
    "type": "object",
    "required": ["schema", "lab", "submitted_at", "facts"],
    "additionalProperties": False,
    "properties": {
        "schema": {"const": SCHEMA_ID},
        "lab": {"type": "string", "minLength": 1, "maxLength": 200},
        "submitted_at": {"type": "string", "minLength": 10, "maxLength": 64},
        "facts": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["entity", "key", "attributes"],
                "additionalProperties": False,
                "properties": {
                    "entity": {"type": "string", "minLength": 1, "maxLength": 200},
                    "key": {"type": "string", "minLength": 1, "maxLength": 500},
                    "attributes": {"type": "object"},
                },
            },
        },
        "log_excerpt": {"type": "string"},
    },
}

_validator = Draft202012Validator(SCHEMA)

_FIELDS = frozenset(SCHEMA["properties"])
_REQUIRED = frozenset(SCHEMA["required"])
_FACT_FIELDS = frozenset(SCHEMA["properties"]["facts"]["items"]["required"])


def _text(value: Any, shortest: int, longest: int) -> bool:
    return isinstance(value, str) and shortest <= len(value) <= longest


def conforms(document: Any) -> bool:
    """True when ``document`` certainly satisfies :data:`SCHEMA`, checked in plain Python.

    The general validator costs about 0.6 ms for a 10-fact submission, most of a reader's
    time; this check of the same rules costs a few microseconds. It only ever says "valid":
    on False, :func:`parse` asks ``jsonschema``, which names the error and has the last
    word. (``tests/integration/test_spool_fast_paths.py`` holds the two to agreement.)
    """
    if not isinstance(document, dict) or not _REQUIRED <= document.keys() <= _FIELDS:
        return False
    if (
        document["schema"] != SCHEMA_ID
        or not _text(document["lab"], 1, 200)
        or not _text(document["submitted_at"], 10, 64)
        or not isinstance(document["facts"], list)
        or ("log_excerpt" in document and not isinstance(document["log_excerpt"], str))
    ):
        return False
    for fact in document["facts"]:
        if (
            not isinstance(fact, dict)
            or fact.keys() != _FACT_FIELDS
            or not _text(fact["entity"], 1, 200)
            or not _text(fact["key"], 1, 500)
            or not isinstance(fact["attributes"], dict)
        ):
            return False
    return True


#: Defaults of the limits (docs/ingestion.md, "Limits").
DEFAULT_MAX_DEPTH = 64
DEFAULT_MAX_KEY_CHARS = 1000
DEFAULT_MAX_STRING_BYTES = MIB
DEFAULT_MAX_NUMBER_CHARS = 100

#: A quarantine reason keeps this many validation errors (and the count of all of them).
MAX_ERRORS = 50
#: Counting stops here (the reason then says "at least").
MAX_COUNTED_ERRORS = 10_000
#: Each kept error message is cut to this many characters.
MAX_ERROR_CHARS = 500

#: ``submitted_at`` must fall in this range (after conversion to UTC).
EARLIEST = datetime(1970, 1, 1, tzinfo=UTC)
LATEST = datetime(9999, 12, 30, tzinfo=UTC)


MAX_DECIMALS = 16_383


@dataclass(frozen=True)
class Limits:
    """Size limits; each one exceeded is a reason to quarantine the submission."""

    max_file_bytes: int = 4 * MIB
    max_facts: int = 10_000
    max_excerpt_bytes: int = MIB
    max_depth: int = DEFAULT_MAX_DEPTH
    max_key_chars: int = DEFAULT_MAX_KEY_CHARS
    max_string_bytes: int = DEFAULT_MAX_STRING_BYTES
    max_number_chars: int = DEFAULT_MAX_NUMBER_CHARS
    # Digits after the point of a number kept exactly (a Decimal): PostgreSQL's numeric
    # holds at most 16,383 (1e-400 fits; 1e-20000, eight characters, does not).
    max_decimals: int = MAX_DECIMALS

    @classmethod
    def from_settings(cls) -> Limits:
        def setting(name: str, default: int) -> int:
            return int(getattr(settings, name, default))

        return cls(
            max_file_bytes=setting("HOLDFAST_SPOOL_MAX_FILE_BYTES", 4 * MIB),
            max_facts=setting("HOLDFAST_SPOOL_MAX_FACTS", 10_000),
            max_excerpt_bytes=setting("HOLDFAST_SPOOL_MAX_EXCERPT_BYTES", MIB),
            max_depth=setting("HOLDFAST_SPOOL_MAX_DEPTH", DEFAULT_MAX_DEPTH),
            max_key_chars=setting("HOLDFAST_SPOOL_MAX_KEY_CHARS", DEFAULT_MAX_KEY_CHARS),
            max_string_bytes=setting("HOLDFAST_SPOOL_MAX_STRING_BYTES", DEFAULT_MAX_STRING_BYTES),
            max_number_chars=setting("HOLDFAST_SPOOL_MAX_NUMBER_CHARS", DEFAULT_MAX_NUMBER_CHARS),
        )


class InvalidSubmission(Exception):
    """The submission itself is wrong (``stage``: limits, json, schema, semantic, parse).

    ``message`` is one line; ``errors`` every error found (at most :data:`MAX_ERRORS`),
    ``error_count`` how many there were in all (schema errors can be many).
    """

    def __init__(
        self,
        stage: str,
        message: str,
        errors: list[str] | None = None,
        error_count: int | None = None,
    ) -> None:
        super().__init__(f"{stage}: {message}")
        self.stage = stage
        self.message = message
        self.errors = errors if errors is not None else [message]
        self.error_count = error_count if error_count is not None else len(self.errors)


@dataclass(frozen=True)
class FactRow:
    """One fact, its attributes already encoded as JSON text (all digits kept)."""

    entity: str
    key: str
    attributes: str


@dataclass
class Submission:
    """A valid submission, ready to apply. ``excerpt`` is dropped once it is in the blob store."""

    hash: str
    lab: str
    submitted_at: datetime
    facts: list[FactRow]
    excerpt: bytes | None = None
    excerpt_hash: str = ""
    size: int = field(default=0)  # bytes of the file


def digest(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


class _NumberError(ValueError):
    pass


class _DuplicateKey(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook`` for ``json.loads``: an object that names a key twice is
    refused. Parsers disagree on which value wins (RFC 8259, 4); here the last one did,
    so a second ``"lab"`` sent the facts to another lab without a word."""
    document = dict(pairs)
    if len(document) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKey(f"an object names the key {key[:100]!r} twice")
            seen.add(key)
    return document


def _float_hook(limit: int, decimals: int) -> Any:
    """``parse_float`` for ``json.loads``: bounded, and exact.

    A number whose shortest float repr is the same number as its text stays a float
    (written back the same); any other (more digits than a double holds) becomes a
    ``Decimal``, which keeps every digit. Integers are exact as Python ints (Python refuses
    more than 4,300 digits: invalid JSON).
    """

    def parse_float(text: str) -> float | Decimal:
        if len(text) > limit:
            raise _NumberError(f"number {text[:20]}... is longer than {limit} characters")
        value = float(text)
        if not math.isfinite(value):
            raise _NumberError(f"number {text} is out of range")
        shortest = repr(value)
        exact = Decimal(text)
        if shortest == text or Decimal(shortest) == exact:
            return value
        if -exact.as_tuple().exponent > decimals:  # type: ignore[operator]  # finite: an int
            raise _NumberError(
                f"number {text[:20]} has more than {decimals} digits after the point "
                "(PostgreSQL's numeric holds no more)"
            )
        return exact

    return parse_float


def _no_constants(name: str) -> Any:
    raise _NumberError(f"{name} is not valid JSON")


_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def encode(value: Any) -> str:
    """JSON text of ``value`` (parsed by :func:`parse`), every number with all its digits."""
    try:
        return _ENCODER.encode(value)
    except TypeError:  # a Decimal inside: the exact, slower encoder
        return _encode_exact(value)


def _encode_exact(value: Any) -> str:
    if isinstance(value, Decimal):
        return str(value)
    if isinstance(value, dict):
        return (
            "{"
            + ",".join(
                f"{json.dumps(k, ensure_ascii=False)}:{_encode_exact(v)}" for k, v in value.items()
            )
            + "}"
        )
    if isinstance(value, list):
        return "[" + ",".join(_encode_exact(v) for v in value) + "]"
    return json.dumps(value, ensure_ascii=False, allow_nan=False)


def _check_strings(value: Any, where: str = "$") -> None:
    """Reject strings no database can store: NUL characters and lone surrogates.

    A walk with one iterator per level of nesting, each value's path a link to its
    parent's: memory grows with the depth, not with the values (a path string built for
    every value cost the path's length times their number: 541 MB for a 70 KB file with
    one long attribute name over 10,000 values). The path is spelled out only to name a
    refused string."""
    stack: list[tuple[Iterator[tuple[Any, Any]], _Link | None]] = [(iter([(where, value)]), None)]
    while stack:
        entry = next(stack[-1][0], None)
        if entry is None:
            stack.pop()
            continue
        key, item = entry
        link = (stack[-1][1], key)
        if isinstance(item, str):
            _check_text(item, link)
        elif isinstance(item, dict):
            for name in item:
                _check_text(name, link)
            stack.append((iter(item.items()), link))
        elif isinstance(item, list):
            stack.append((iter(enumerate(item)), link))


# A value's path: its parent's link and its own key (the root's is the path's start).
_Link = tuple[Any, str | int]


def _check_text(text: str, link: _Link) -> None:
    if "\x00" in text:
        raise InvalidSubmission("semantic", f"{_path(link)} contains a NUL character")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidSubmission(
            "semantic", f"{_path(link)} contains a lone surrogate (not valid Unicode)"
        ) from None


def _path(link: _Link | None) -> str:
    keys: list[str | int] = []
    while link is not None:
        link, key = link
        keys.append(key)
    root, *rest = reversed(keys)
    return str(root) + "".join(f"[{key}]" if isinstance(key, int) else f".{key}" for key in rest)


def _check_shape(document: dict[str, Any], raw: bytes, limits: Limits) -> None:
    """Depth, attribute names and string sizes, below what either database refuses.

    Each check runs only when the bytes do not already prove it holds: nesting needs at
    least ``max_depth`` brackets, a name longer than ``max_key_chars`` a longer file, and a
    string over ``max_string_bytes`` a larger file (an escape is never shorter in JSON than
    in UTF-8).
    """
    depth = raw.count(b"{") + raw.count(b"[") >= limits.max_depth
    strings = len(raw) > limits.max_string_bytes
    if not (depth or strings or len(raw) > limits.max_key_chars):
        return
    stack: list[tuple[Any, int, int]] = [
        (fact["attributes"], 4, i) for i, fact in enumerate(document["facts"])
    ]
    while stack:
        item, level, fact = stack.pop()
        if level > limits.max_depth:
            raise InvalidSubmission(
                "limits",
                f"$.facts[{fact}].attributes: nested deeper than the limit of {limits.max_depth}",
            )
        if isinstance(item, dict):
            if item and max(map(len, item)) > limits.max_key_chars:
                longest = max(map(len, item))
                raise InvalidSubmission(
                    "limits",
                    f"$.facts[{fact}].attributes: an attribute name of {longest} characters, "
                    f"more than the limit of {limits.max_key_chars}",
                )
            values: Any = item.values()
        else:
            values = item
        for value in values:
            kind = type(value)
            if kind is dict or kind is list:
                stack.append((value, level + 1, fact))
            elif strings and kind is str:
                _check_string(value, f"$.facts[{fact}].attributes", limits)


def _check_string(value: str, path: str, limits: Limits) -> None:
    if len(value) <= limits.max_string_bytes // 4:  # too short to be too large
        return
    size = len(value.encode("utf-8", "surrogatepass"))
    if size > limits.max_string_bytes:
        raise InvalidSubmission(
            "limits",
            f"{path}: a string of {size} bytes, more than the limit of {limits.max_string_bytes}",
        )


# A fact's entity and key, in UTF-8 bytes together: PostgreSQL's unique index over (lab,
# entity, key) refuses an entry past 2,704 bytes, which 200 + 500 characters of four bytes
# each would pass. Below it, a valid submission is one both databases store.
MAX_IDENTITY_BYTES = 2000


def _check_identity_size(index: int, entity: str, key: str) -> None:
    size = len(entity.encode("utf-8", "surrogatepass")) + len(key.encode("utf-8", "surrogatepass"))
    if size > MAX_IDENTITY_BYTES:
        raise InvalidSubmission(
            "limits",
            f"$.facts[{index}]: entity and key are {size} bytes of UTF-8 together, more than "
            f"the limit of {MAX_IDENTITY_BYTES}",
        )


def parse_time(text: str) -> datetime:
    try:
        moment = timestamps.parse(text)
    except timestamps.NaiveTime:
        raise InvalidSubmission(
            "semantic", f"submitted_at {text!r} has no UTC offset (add Z or +hh:mm)"
        ) from None
    except timestamps.OutOfRange:
        moment = None
    except timestamps.InvalidTime:
        raise InvalidSubmission(
            "semantic", f"submitted_at {text!r} is not an ISO 8601 time"
        ) from None
    if moment is None or not EARLIEST <= moment <= LATEST:
        raise InvalidSubmission(
            "semantic",
            f"submitted_at {text!r} is outside {EARLIEST:%Y-%m-%d} .. {LATEST:%Y-%m-%d} (UTC)",
        )
    return moment


def _where(path: Any) -> str:
    return "$" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)


def _schema_errors(document: Any) -> InvalidSubmission | None:
    if conforms(document):
        return None
    found = itertools.islice(_validator.iter_errors(document), MAX_COUNTED_ERRORS + 1)
    errors = sorted(found, key=lambda e: [str(p) for p in e.absolute_path])
    if not errors:
        return None
    count = len(errors)
    texts = [
        f"{_where(error.absolute_path)}: {error.message}"[:MAX_ERROR_CHARS]
        for error in errors[:MAX_ERRORS]
    ]
    more = ""
    if count > 1:
        counted = f"at least {MAX_COUNTED_ERRORS}" if count > MAX_COUNTED_ERRORS else str(count)
        more = f" ({counted} errors in all; the reason lists the first {len(texts)})"
    return InvalidSubmission(
        "schema", f"{texts[0]}{more}", texts, min(count, MAX_COUNTED_ERRORS + 1)
    )


def _all_of(problems: list[InvalidSubmission]) -> InvalidSubmission:
    """One refusal listing every fact's problem (the first :data:`MAX_ERRORS`), in the
    first one's stage, as a schema refusal lists its errors."""
    if len(problems) == 1:
        return problems[0]
    texts = [problem.message[:MAX_ERROR_CHARS] for problem in problems[:MAX_ERRORS]]
    more = f" ({len(problems)} errors in all; the reason lists the first {len(texts)})"
    return InvalidSubmission(problems[0].stage, f"{texts[0]}{more}", texts, len(problems))


def parse(raw: bytes, limits: Limits, hash: str | None = None) -> Submission:
    """Judge ``raw`` (a whole file); return the submission or raise InvalidSubmission.

    Any exception but ``MemoryError`` is the submission's own: it becomes an
    InvalidSubmission of stage ``parse`` naming the exception.
    """
    try:
        return _parse(raw, limits, hash)
    except (InvalidSubmission, MemoryError):
        raise
    except Exception as exc:
        raise InvalidSubmission("parse", f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]) from None


def _parse(raw: bytes, limits: Limits, hash: str | None) -> Submission:
    if len(raw) > limits.max_file_bytes:
        raise InvalidSubmission(
            "limits", f"file is {len(raw)} bytes, more than the limit of {limits.max_file_bytes}"
        )
    try:
        document = json.loads(
            raw.decode("utf-8"),
            parse_float=_float_hook(limits.max_number_chars, limits.max_decimals),
            parse_constant=_no_constants,
            object_pairs_hook=_unique_keys,
        )
    except UnicodeDecodeError as exc:
        raise InvalidSubmission("json", f"not UTF-8: {exc}") from None
    except (_NumberError, _DuplicateKey) as exc:
        raise InvalidSubmission("json", str(exc)) from None
    except (ValueError, RecursionError) as exc:
        raise InvalidSubmission("json", f"invalid JSON: {exc}") from None

    invalid = _schema_errors(document)
    if invalid is not None:
        raise invalid

    facts = document["facts"]
    if len(facts) > limits.max_facts:
        raise InvalidSubmission(
            "limits", f"{len(facts)} facts, more than the limit of {limits.max_facts}"
        )
    excerpt_text = document.get("log_excerpt")
    # The limits first: the walk below must not be the first to meet a hostile shape.
    _check_shape(document, raw, limits)
    # Raw JSON cannot hold a NUL or a lone surrogate: both must be written as \u escapes
    # (a raw control character is invalid JSON; UTF-8 cannot encode a surrogate). Without
    # a "\u" in the bytes there is nothing to look for, so skip the walk over every string.
    if b"\\u" in raw:
        _check_strings(document)
    excerpt = excerpt_text.encode("utf-8") if excerpt_text is not None else None
    if excerpt is not None and len(excerpt) > limits.max_excerpt_bytes:
        raise InvalidSubmission(
            "limits",
            f"log_excerpt is {len(excerpt)} bytes, more than the limit of "
            f"{limits.max_excerpt_bytes}",
        )
    submitted_at = parse_time(document["submitted_at"])

    rows: list[FactRow] = []
    seen: set[tuple[str, str]] = set()
    problems: list[InvalidSubmission] = []  # every fact's, so one fix-up round is enough
    for index, fact in enumerate(facts):
        identity = (fact["entity"], fact["key"])
        if identity in seen:
            problems.append(
                InvalidSubmission(
                    "semantic",
                    f"$.facts[{index}]: entity {identity[0]!r} key {identity[1]!r} appears twice",
                )
            )
            continue
        seen.add(identity)
        if len(identity[0]) + len(identity[1]) > MAX_IDENTITY_BYTES // 4:  # else surely fits
            try:
                _check_identity_size(index, *identity)
            except InvalidSubmission as problem:
                problems.append(problem)
                continue
        rows.append(FactRow(fact["entity"], fact["key"], encode(fact["attributes"])))
    if problems:
        raise _all_of(problems)
    return Submission(
        hash=hash or digest(raw),
        lab=document["lab"],
        submitted_at=submitted_at,
        facts=rows,
        excerpt=excerpt,
        size=len(raw),
    )
