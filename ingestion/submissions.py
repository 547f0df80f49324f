"""What a spool submission is (``holdfast.submission/v1``, DESIGN §10) and how one is judged.

:func:`parse` turns a file's raw bytes into a :class:`Submission` or raises
:class:`InvalidSubmission`, the error of the submission itself: retrying cannot help, so
the file is quarantined. Nothing here touches the database or the file system.

The checks, in order, each naming its ``stage`` in the error:

* ``limits``: the file is larger than ``max_file_bytes`` (checked before parsing);
* ``json``: not UTF-8 JSON, or numbers JSON cannot round-trip (NaN, infinities);
* ``schema``: the JSON Schema below (validated with ``jsonschema``);
* ``limits``: more facts than ``max_facts``, an excerpt over ``max_excerpt_bytes``;
* ``semantic``: ``submitted_at`` is not an ISO 8601 time with an offset; a string holds a
  NUL character or a lone surrogate (no database can store those, so retrying the insert
  could never succeed); one (entity, key) appears twice in the same submission.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from django.conf import settings
from jsonschema import Draft202012Validator  # type: ignore[import-untyped]

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


@dataclass(frozen=True)
class Limits:
    """Size limits; each one exceeded is a reason to quarantine the submission."""

    max_file_bytes: int = 4 * MIB
    max_facts: int = 10_000
    max_excerpt_bytes: int = MIB

    @classmethod
    def from_settings(cls) -> Limits:
        return cls(
            max_file_bytes=int(getattr(settings, "HOLDFAST_SPOOL_MAX_FILE_BYTES", 4 * MIB)),
            max_facts=int(getattr(settings, "HOLDFAST_SPOOL_MAX_FACTS", 10_000)),
            max_excerpt_bytes=int(getattr(settings, "HOLDFAST_SPOOL_MAX_EXCERPT_BYTES", MIB)),
        )


#: A quarantine reason lists at most this many validation errors (each cut to
#: ``MAX_ERROR_CHARS``) and says how many there were in all.
MAX_REPORTED_ERRORS = 50
MAX_ERROR_CHARS = 500


class InvalidSubmission(Exception):
    """The submission itself is wrong (``stage``: limits, json, schema or semantic).

    ``message`` is one line (the first error, and how many more); ``errors`` lists them
    all up to ``MAX_REPORTED_ERRORS`` and ``count`` says how many there were.
    """

    def __init__(
        self, stage: str, message: str, errors: list[str] | None = None, count: int = 1
    ) -> None:
        super().__init__(f"{stage}: {message}")
        self.stage = stage
        self.message = message
        self.errors = errors if errors is not None else [message]
        self.count = count


@dataclass(frozen=True)
class FactRow:
    entity: str
    key: str
    attributes: dict[str, Any]


@dataclass
class Submission:
    """A valid submission, ready to apply. ``excerpt`` is dropped once it is in the blob store."""

    hash: str
    lab: str
    submitted_at: datetime
    facts: list[FactRow]
    excerpt: bytes | None = None
    excerpt_hash: str = ""


def digest(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text} is out of range")
    return value


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _check_strings(value: Any, where: str = "$") -> None:
    """Reject strings no database can store: NUL characters and lone surrogates."""
    stack: list[tuple[Any, str]] = [(value, where)]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            texts = [item]
        elif isinstance(item, dict):
            texts = list(item)
            stack.extend((v, f"{path}.{k}") for k, v in item.items())
        elif isinstance(item, list):
            texts = []
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(item))
        else:
            continue
        for text in texts:
            if "\x00" in text:
                raise InvalidSubmission("semantic", f"{path} contains a NUL character")
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise InvalidSubmission(
                    "semantic", f"{path} contains a lone surrogate (not valid Unicode)"
                ) from None


def parse_time(text: str) -> datetime:
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise InvalidSubmission(
            "semantic", f"submitted_at {text!r} is not an ISO 8601 time"
        ) from None
    if moment.tzinfo is None:
        raise InvalidSubmission(
            "semantic", f"submitted_at {text!r} has no UTC offset (add Z or +hh:mm)"
        )
    return moment.astimezone(UTC)


def _cut(text: str) -> str:
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 1] + "…"


def parse(raw: bytes, limits: Limits, hash: str | None = None) -> Submission:
    """Judge ``raw`` (a whole file); return the submission or raise InvalidSubmission."""
    if len(raw) > limits.max_file_bytes:
        raise InvalidSubmission(
            "limits", f"file is {len(raw)} bytes, more than the limit of {limits.max_file_bytes}"
        )
    try:
        document = json.loads(
            raw.decode("utf-8"), parse_float=_finite, parse_constant=_no_constants
        )
    except UnicodeDecodeError as exc:
        raise InvalidSubmission("json", f"not UTF-8: {exc}") from None
    except (ValueError, RecursionError) as exc:
        raise InvalidSubmission("json", f"invalid JSON: {exc}") from None

    errors = (
        []
        if conforms(document)
        else sorted(_validator.iter_errors(document), key=lambda e: list(e.absolute_path))
    )
    if errors:
        located = [
            _cut(
                "$"
                + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path)
                + f": {error.message}"
            )
            for error in errors[:MAX_REPORTED_ERRORS]
        ]
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise InvalidSubmission("schema", f"{located[0]}{more}", located, len(errors))

    facts = document["facts"]
    if len(facts) > limits.max_facts:
        raise InvalidSubmission(
            "limits", f"{len(facts)} facts, more than the limit of {limits.max_facts}"
        )
    excerpt_text = document.get("log_excerpt")
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
    for index, fact in enumerate(facts):
        identity = (fact["entity"], fact["key"])
        if identity in seen:
            raise InvalidSubmission(
                "semantic",
                f"$.facts[{index}]: entity {identity[0]!r} key {identity[1]!r} appears twice",
            )
        seen.add(identity)
        rows.append(FactRow(fact["entity"], fact["key"], fact["attributes"]))
    return Submission(
        hash=hash or digest(raw),
        lab=document["lab"],
        submitted_at=submitted_at,
        facts=rows,
        excerpt=excerpt,
    )
