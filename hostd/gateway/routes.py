"""Which requests the public port passes to the engine, decided on one path.

One job: turn the request target a client sent into one decoded, normalized
path, and say whether that path is one of the engine's public routes (the
backend declares them: hostd/backends/<backend>.py, PUBLIC_ROUTES). The
gateway routes on the result and forwards the normalized path, never the raw
one, so what it checked is what the engine receives.

Trusts: nobody. Percent-escapes are decoded once (invalid UTF-8, NUL and
backslashes are refused), dot segments are removed and empty segments
collapsed the way RFC 3986 5.2.4 resolves them, so /v1/../health,
/v1/%2e%2e/health and //health all become /health, which is the gateway's
own route and never the engine's. Everything not in the backend's table is
404; the engine's internal endpoints (its /health details, raw /metrics,
admin verbs) are not in any table, whatever the spelling.
"""

from __future__ import annotations

import re
import urllib.parse
from dataclasses import dataclass
from typing import Iterable, Optional


class BadPath(Exception):
    """The request target cannot be routed (not an absolute path, bad escapes)."""


def normalize(target: str) -> str:
    """The decoded path of request TARGET (query and fragment dropped) with dot
    segments removed; BadPath when it is not one."""
    path = target.split("?", 1)[0].split("#", 1)[0]
    if not path.startswith("/"):
        raise BadPath(f"the request target {target[:100]!r} is not an absolute path")
    try:
        decoded = urllib.parse.unquote(path, errors="strict")
    except UnicodeDecodeError:
        raise BadPath("the path is not UTF-8 after percent-decoding") from None
    if "\x00" in decoded or "\\" in decoded:
        raise BadPath("the path holds a NUL or a backslash")
    segments: list[str] = []
    for segment in decoded.split("/"):
        if segment in ("", "."):
            continue
        if segment == "..":
            if segments:
                segments.pop()
            continue
        segments.append(segment)
    return "/" + "/".join(segments)


def quoted(path: str) -> str:
    """PATH (normalized) percent-encoded again for the request to the engine."""
    return urllib.parse.quote(path, safe="/:@!$&'()*+,;=-._~")


@dataclass(frozen=True)
class Route:
    method: str
    template: str  # "/v1/models/{model}": a {name} is one non-empty segment
    pattern: re.Pattern


def compile_routes(table: Iterable[tuple[str, str]]) -> list[Route]:
    routes = []
    for method, template in table:
        regex = re.sub(r"\\\{[a-z_]+\\\}", "[^/]+", re.escape(template))
        routes.append(Route(method, template, re.compile(regex + r"\Z")))
    return routes


class Table:
    """A backend's public routes, matched against normalized paths."""

    def __init__(self, table: Iterable[tuple[str, str]]):
        self.routes = compile_routes(table)

    def match(self, method: str, path: str) -> tuple[Optional[Route], list[str]]:
        """(the route, []) when METHOD PATH is public; (None, allowed methods)
        when the path is public for other methods; (None, []) when unknown."""
        allowed = []
        for route in self.routes:
            if route.pattern.match(path):
                if route.method == method or (method == "HEAD" and route.method == "GET"):
                    return route, []
                allowed.append(route.method)
        return None, allowed
