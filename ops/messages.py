"""The API's one-line messages, shared by its DRF handlers and its middleware (which must
not import DRF: a settings module without it still loads the middleware list)."""

from __future__ import annotations

from django.urls import Resolver404, resolve


def one_line(text: str, limit: int = 1000) -> str:
    """``text`` on one line (messages may quote the caller's input), at most ``limit`` long.

    A lone surrogate the caller sent (JSON's ``"\\ud800"``, as a field name or a value)
    is written as its escape: UTF-8 cannot encode it, and the response would be a 500.
    """
    text = " ".join(text.encode("utf-8", "backslashreplace").decode("utf-8").split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def not_found_message(path: str) -> str:
    """The 404's one line, pointing at the path with its trailing slash if that exists."""
    message = f"no such endpoint: {path}"
    if not path.endswith("/"):
        try:
            resolve(path + "/")
        except Resolver404:
            pass
        else:
            message += f" (every path ends with a slash: {path}/)"
    return one_line(message)
