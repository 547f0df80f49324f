"""The worker's handler call: its quick path for args that plainly fit agrees with
``inspect.Signature.bind`` on every shape of handler and args (no database)."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from jobs import PermanentError
from jobs.worker import _call


def keywords(ctx: Any, *, source: str, pages: int = 1) -> Any:
    return ("keywords", ctx, source, pages)


def positional(ctx: Any, source: str, pages: int = 1) -> Any:
    return ("positional", ctx, source, pages)


def open_ended(ctx: Any, source: str = "", **rest: Any) -> Any:
    return ("open_ended", ctx, source, rest)


def first_positional_only(ctx: Any, /, **rest: Any) -> Any:
    return ("first_positional_only", ctx, rest)


def star_args(ctx: Any, *more: Any, **rest: Any) -> Any:
    return ("star_args", ctx, more, rest)


def no_ctx_slot(*, ctx: Any) -> Any:
    return ("no_ctx_slot", ctx)


HANDLERS = [keywords, positional, open_ended, first_positional_only, star_args, no_ctx_slot]
ARGS: list[dict[str, Any]] = [
    {},
    {"source": "s"},
    {"source": "s", "pages": 3},
    {"pages": 3},
    {"source": "s", "other": 1},
    {"ctx": 1},
    {"ctx": 1, "source": "s"},
    {"rest": 2},
]


def _spec(func: Any) -> Any:
    """A stand-in for the registry's HandlerSpec: the two fields ``_call`` reads."""

    class Spec:
        kind = f"test.{func.__name__}"

    Spec.func = staticmethod(func)  # type: ignore[attr-defined]
    return Spec()


@pytest.mark.parametrize("func", HANDLERS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("args", ARGS, ids=repr)
def test_the_quick_path_agrees_with_bind(func: Any, args: dict[str, Any]) -> None:
    ctx = object()
    try:
        bound = inspect.signature(func).bind(ctx, **args)
    except TypeError:
        with pytest.raises(PermanentError, match="args do not match handler"):
            _call(_spec(func), ctx, args)  # type: ignore[arg-type]
        return
    expected = func(*bound.args, **bound.kwargs)
    assert _call(_spec(func), ctx, args) == expected  # type: ignore[arg-type]
