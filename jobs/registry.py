"""The handler registry: which function runs each job kind, and with which options.

Handlers are registered with ``@handler(kind, ...)``. Each installed app's ``handlers.py``
is imported on first use (like ``admin.py`` autodiscovery), so a third-party app adds job
kinds without touching Holdfast.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from django.utils.module_loading import autodiscover_modules

from . import options
from .exceptions import InvalidJob, UnknownKind
from .retry import RetryPolicy, as_policy

DEFAULT_MAX_ATTEMPTS = 10
# The kind of every job of Django's Tasks API (jobs.tasks_backend); its args name the task
# function (``args["task"]``), and kind filters also take that path (operations.kind_filter).
TASK_KIND = "django.task"

HandlerFunc = Callable[..., Any]
LocksFunc = Callable[[dict[str, Any]], list[str]]


@dataclass(frozen=True)
class HandlerSpec:
    kind: str
    func: HandlerFunc
    lane: str | None = None
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    backoff: Callable[[int], float] = field(default=as_policy(None))
    lease_seconds: float | None = None
    locks: LocksFunc | None = None
    unique: bool = False
    schedule: str | int | None = None


@functools.cache
def signature(func: Callable[..., Any]) -> inspect.Signature:
    return inspect.signature(func)  # about 50 µs: once per handler, not once per job


@functools.cache
def _keywords(func: Callable[..., Any]) -> tuple[str, frozenset[str], frozenset[str], bool] | None:
    """For a handler ``(ctx, <keyword parameters>, **kwargs)``: the name of its first
    parameter (``ctx``), the names it takes by keyword, those without a default, and
    whether it takes any other keyword (``**``).
    None for any other shape (positional-only or ``*args`` parameters after ``ctx``)."""
    params = list(signature(func).parameters.values())
    if not params or params[0].kind not in (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
    ):
        return None
    named, required, var_keyword = set(), set(), False
    for param in params[1:]:
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            var_keyword = True
        elif param.kind in (
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
            inspect.Parameter.KEYWORD_ONLY,
        ):
            named.add(param.name)
            if param.default is inspect.Parameter.empty:
                required.add(param.name)
        else:
            return None
    return params[0].name, frozenset(named), frozenset(required), var_keyword


def fits(func: HandlerFunc, args: dict[str, Any]) -> bool:
    """Whether ``args`` plainly fit ``func(ctx, **args)``: every required keyword given,
    none it does not take. A few set operations, for the hot paths (each enqueue, each
    run); False also for shapes it does not decide, which ``bind`` decides."""
    shape = _keywords(func)
    if shape is None:
        return False
    first, named, required, var_keyword = shape
    keys = args.keys()
    return required <= keys and (var_keyword or keys <= named) and first not in keys


def bind(spec: HandlerSpec, ctx: Any, args: dict[str, Any]) -> inspect.BoundArguments:
    """``args`` bound to the handler of ``spec``, for args ``fits`` did not decide;
    InvalidJob saying why they cannot be (a required one missing, one it does not take).
    ``enqueue()`` refuses such args; the worker fails a job that still holds them."""
    try:
        return signature(spec.func).bind(ctx, **args)
    except TypeError as exc:
        raise InvalidJob(f"args do not match handler {spec.kind!r}: {exc}") from None


_handlers: dict[str, HandlerSpec] = {}
_discovered = False
_lock = threading.Lock()


def handler(
    kind: str,
    *,
    lane: str | None = None,
    max_attempts: int = DEFAULT_MAX_ATTEMPTS,
    backoff: RetryPolicy | Callable[[int], float] | float | None = None,
    lease_seconds: float | None = None,
    locks: LocksFunc | None = None,
    unique: bool = False,
    schedule: str | int | None = None,
) -> Callable[[HandlerFunc], HandlerFunc]:
    """Register the decorated function as the handler of ``kind``.

    Every option is checked here, at import, with the bounds ``enqueue()`` applies
    (``jobs.options``): a value the engine cannot store would otherwise fail each of the
    kind's jobs, or every worker that claims one (a ValueError naming the kind and option).
    """
    if not isinstance(kind, str) or not kind or len(kind) > 200 or not kind.isprintable():
        raise ValueError(
            f"a job kind is a non-empty string of at most 200 printable characters: {kind!r}"
        )
    problem = _options_problem(max_attempts, lease_seconds, backoff, lane, locks, schedule, unique)
    if problem:
        raise ValueError(f"handler {kind!r}: {problem}")

    def register(func: HandlerFunc) -> HandlerFunc:
        shape = _shape_problem(func)
        if shape:
            raise ValueError(f"handler {kind!r}: {shape}")
        spec = HandlerSpec(
            kind=kind,
            func=func,
            lane=lane,
            max_attempts=max_attempts,
            backoff=as_policy(backoff),
            lease_seconds=lease_seconds,
            locks=locks,
            unique=unique,
            schedule=schedule,
        )
        existing = _handlers.get(kind)
        # A module imported twice (as __main__ and by name) re-registers the same function.
        if existing is not None and not _same_origin(existing.func, func):
            raise ValueError(
                f"job kind {kind!r} already has a handler: "
                f"{existing.func.__module__}.{existing.func.__qualname__}"
            )
        _handlers[kind] = spec
        return func

    return register


def _shape_problem(func: Any) -> str | None:
    """A handler is a plain function the worker calls, with ``ctx``, and is done with: a
    coroutine or generator function returns an object that never runs (each job would be
    dead with "not JSON", its body never executed), also behind a decorator
    (``functools.wraps``) or as a callable object's ``__call__``; a function that takes no
    positional argument cannot take ``ctx`` (every enqueue of its kind would be refused)."""
    if not callable(func):
        return f"{func!r} is not callable"
    inner = inspect.unwrap(func)
    call = None if inspect.isroutine(func) else type(func).__call__
    shapes = [func, inner] + ([call] if call is not None else [])
    if any(inspect.iscoroutinefunction(f) or inspect.isasyncgenfunction(f) for f in shapes):
        return "an async function cannot be a handler: the worker runs handlers synchronously"
    if any(inspect.isgeneratorfunction(f) for f in shapes):
        return "a generator function cannot be a handler: its body would never run"
    try:
        signature(func).bind_partial(None)
    except TypeError:
        return "a handler takes the job's context as its first positional argument (ctx)"
    except ValueError:
        pass  # no signature to read (some built-ins): the worker's call will tell
    return None


def _options_problem(
    max_attempts: Any,
    lease_seconds: Any,
    backoff: Any,
    lane: Any,
    locks: Any,
    schedule: Any,
    unique: Any,
) -> str | None:
    if locks is not None and not callable(locks):
        return f"locks must be a function of the job's args returning lock names, not {locks!r}"
    if not isinstance(unique, bool):
        return f"unique must be True or False, not {unique!r}"
    return (
        (None if lane is None else options.lane_problem(lane))
        or options.max_attempts_problem(max_attempts)
        or (None if lease_seconds is None else options.lease_seconds_problem(lease_seconds))
        or options.backoff_problem(backoff)
        # A cron expression is checked where every schedule is (jobs.schedules.Declared).
        or (
            None
            if schedule is None or isinstance(schedule, str)
            else options.every_problem(schedule, "schedule (when not a cron expression)")
        )
    )


def _same_origin(a: HandlerFunc, b: HandlerFunc) -> bool:
    return (a.__module__, a.__qualname__) == (b.__module__, b.__qualname__)


def autodiscover() -> None:
    """Import every installed app's ``handlers`` module, once per process."""
    global _discovered
    if _discovered:
        return
    with _lock:
        if not _discovered:
            autodiscover_modules("handlers")
            _discovered = True


def get_handler(kind: str) -> HandlerSpec:
    autodiscover()
    try:
        return _handlers[kind]
    except KeyError:
        raise UnknownKind(f"no handler is registered for job kind {kind!r}") from None


def kinds() -> frozenset[str]:
    """The kinds this process has handlers for."""
    autodiscover()
    return frozenset(_handlers)


def all_handlers() -> list[HandlerSpec]:
    autodiscover()
    return [_handlers[kind] for kind in sorted(_handlers)]
