"""Who may talk to the app and which files it may touch.

Bound to a loopback address the app answers only requests addressed to a loopback host name
(a web page elsewhere cannot reach it by DNS rebinding). Bound to any other address, every
request, websocket included, must carry the token printed at start: as `?token=` once (the
app then sets a cookie), as the cookie, or as `Authorization: Bearer <token>` for scripts.
Every path a request names is resolved (symbolic links included) and must lie under one of
the configured roots.

Requests from other web sites are refused (403), token or loopback alike: a request whose
`Origin` names another host than the one it is addressed to, and a state-changing one (any
method but GET, HEAD, OPTIONS; every websocket) whose `Referer` names another host or that the
browser marks `Sec-Fetch-Site: cross-site`/`same-site`. Only the token sent as
`Authorization: Bearer` or `?token=` lets such a request through, never the cookie, which a
browser attaches to any request for this host. Requests that carry none of these headers
(curl, scripts) are not from a web page and are answered as before.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import secrets
from dataclasses import dataclass
from http.cookies import SimpleCookie
from pathlib import Path
from typing import Any, Awaitable, Callable
from urllib.parse import parse_qs, urlsplit

COOKIE = "difftune_token"
LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1", "[::1]"}
APP_FOLDER = ".difftune-ui"  # the app's own state (job database, lock file), in the first root
SAFE_METHODS = ("GET", "HEAD", "OPTIONS")  # methods that change nothing
DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}


class PathOutsideRoots(ValueError):
    """A path that resolves outside every configured root."""


@dataclass(frozen=True)
class Roots:
    """The folders the app may read and write under (resolved, absolute)."""

    folders: tuple[Path, ...]

    @classmethod
    def of(cls, folders: list[Path]) -> "Roots":
        """Roots from user-given folders (each must exist)."""
        resolved = []
        for folder in folders:
            path = Path(folder).expanduser().resolve()
            if not path.is_dir():
                raise ValueError(f"--root {folder} is not a folder; pass an existing folder")
            resolved.append(path)
        return cls(tuple(resolved))

    @property
    def main(self) -> Path:
        """The first root: new runs, the job database and relative paths live under it."""
        return self.folders[0]

    @property
    def app_folder(self) -> Path:
        """The app's own folder (`<first root>/.difftune-ui`): never a target of a write."""
        return self.main / APP_FOLDER

    def resolve(self, path: str | Path, *, write: bool = False) -> Path:
        """`path` made absolute (relative to the first root), symbolic links followed; raises
        PathOutsideRoots when it lies outside every root, or (`write`: a path something will
        be written to) inside the app's own folder, whose job database a save must not
        replace."""
        resolved = self._resolved(path)
        app = self.app_folder
        if write and (resolved == app or resolved.is_relative_to(app)):
            raise PathOutsideRoots(f"{path} is inside the app's own folder {app} (its job "
                                   "database and lock); pick a path outside it")
        return resolved

    def holds(self, path: str | Path) -> bool:
        """Whether `path` (absolute, or relative to the first root), symbolic links followed,
        lies under a root: the check for each file inside a folder a request names."""
        try:
            self._resolved(path)
        except PathOutsideRoots:
            return False
        return True

    def _resolved(self, path: str | Path) -> Path:
        """`path` resolved; PathOutsideRoots when it lies outside every root."""
        text = str(path)
        try:
            if "\x00" in text:
                raise ValueError(text)
            os.fsencode(text)  # UnicodeEncodeError for a lone surrogate: no file has one
        except ValueError:
            raise PathOutsideRoots(f"{text!r} is not a valid path") from None
        try:
            candidate = Path(text).expanduser()
            if not candidate.is_absolute():
                candidate = self.main / candidate
            resolved = candidate.resolve()
        except (OSError, RuntimeError) as err:  # (RuntimeError: a loop of links)
            raise PathOutsideRoots(f"{text} cannot be resolved ({err}); give a path without "
                                   "a loop of links") from None
        for root in self.folders:
            if resolved == root or resolved.is_relative_to(root):
                return resolved
        raise PathOutsideRoots(f"{text} is outside the folders this app serves "
                               f"({', '.join(map(str, self.folders))}); pick a path under them "
                               "(move the file or folder there) or start `difftune ui --root` "
                               "with its folder")

    def relative(self, path: Path) -> str:
        """`path` as shown to users: relative to the root holding it."""
        for root in self.folders:
            if path == root or path.is_relative_to(root):
                return str(path.relative_to(root)) or "."
        return str(path)


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or name the server binds to) is a loopback one."""
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def new_token() -> str:
    """A fresh random token (32 url-safe characters)."""
    return secrets.token_urlsafe(24)


ASGIApp = Callable[[dict, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]],
                   Awaitable[None]]


class Guard:
    """ASGI middleware: the token check (when `token` is set) or the loopback Host check, and
    the refusal of requests from other sites. `origin_token` (default: `token`) is the token
    that lets a request from another site through; on loopback the app makes one and prints it."""

    def __init__(self, app: ASGIApp, token: str | None, origin_token: str | None = None) -> None:
        self.app = app
        self.token = token
        self.origin_token = origin_token or token

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers", [])}
        given, source = _given_token(scope, headers)
        refusal = self._refusal(scope, headers, given, source)
        if refusal is not None:
            await _refuse(scope, send, *refusal)
            return
        if source == "query" and self.token is not None and scope["type"] == "http":
            send = _with_cookie(send, self.token)
        await self.app(scope, receive, send)

    def _refusal(self, scope: dict, headers: dict[str, str], given: str | None,
                 source: str | None) -> tuple[int, str] | None:
        """The status and message to refuse the request with, or None to answer it."""
        if self.token is None:
            host = headers.get("host", "").rsplit(":", 1)[0] if headers.get("host") else ""
            if host and not is_loopback(host):
                return 403, ("this app is bound to localhost; open it as http://127.0.0.1 or "
                             "start it with --host and use its token")
        elif not _matches(given, self.token):
            return 401, ("missing or wrong token: open the address `difftune ui` printed (it "
                         "ends in ?token=...) or send 'Authorization: Bearer <token>'")
        site = foreign_site(scope, headers)
        if site is not None and not (source != "cookie" and _matches(given, self.origin_token)):
            return 403, (f"refused: this request comes from another web site ({site}) and "
                         "this app takes no orders from other sites; use the app at its own "
                         "address, or from a script send no Origin header (or the token as "
                         "'Authorization: Bearer <token>')")
        return None


def foreign_site(scope: dict, headers: dict[str, str]) -> str | None:
    """What shows that a request comes from a web page of another site (its `Origin`, its
    `Referer`, or the browser's `Sec-Fetch-Site`), or None. A foreign Origin counts on every
    request (a page elsewhere must not read this app's answers either); Referer and
    Sec-Fetch-Site count on requests that may change something: other methods than GET, HEAD
    and OPTIONS, and every websocket (NiceGUI's page events travel over one)."""
    host = headers.get("host", "")
    origin = headers.get("origin")
    if origin is not None and not same_host(origin, host):
        return f"Origin: {origin}"
    if scope["type"] == "http" and scope.get("method", "GET") in SAFE_METHODS:
        return None
    fetch_site = headers.get("sec-fetch-site", "")
    if fetch_site in ("cross-site", "same-site"):
        return f"Sec-Fetch-Site: {fetch_site}"
    referer = headers.get("referer")
    if origin is None and referer and not same_host(referer, host):
        return f"Referer: {referer}"
    return None


def same_host(url: str, host: str) -> bool:
    """Whether `url` (an Origin or Referer) names the host and port the request was sent to
    (its Host header). A port left out is the default of the URL's scheme on both sides: the
    browser sent the Host header of the page's own scheme (behind a TLS proxy, too)."""
    try:
        given = urlsplit(url)
        here = urlsplit(f"//{host}")
        default = DEFAULT_PORTS.get(given.scheme)
        same_port = (given.port or default) == (here.port or default)
    except ValueError:  # a port that is not a number, a malformed IPv6 address
        return False
    return bool(given.hostname) and given.hostname == here.hostname and same_port


def _matches(given: str | None, token: str | None) -> bool:
    """Whether the token a request carries is `token` (compared in constant time)."""
    return given is not None and token is not None and hmac.compare_digest(
        given.encode(), token.encode())


def _given_token(scope: dict, headers: dict[str, str]) -> tuple[str | None, str | None]:
    """The token a request carries and where: "header", "query" or "cookie" (None, None when
    it carries none)."""
    auth = headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip(), "header"
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    if query.get("token"):
        return query["token"][0], "query"
    cookie = SimpleCookie(headers.get("cookie", ""))
    if COOKIE in cookie:
        return cookie[COOKIE].value, "cookie"
    return None, None


def _with_cookie(send: Any, token: str) -> Any:
    """`send` that adds the token cookie to the response's headers."""
    async def wrapped(message: dict) -> None:
        if message["type"] == "http.response.start":
            value = f"{COOKIE}={token}; Path=/; HttpOnly; SameSite=Strict"
            message = {**message, "headers": [*message.get("headers", []),
                                              (b"set-cookie", value.encode())]}
        await send(message)
    return wrapped


async def _refuse(scope: dict, send: Any, status: int, text: str) -> None:
    """Answer `status` with `text` (a websocket is closed before it opens)."""
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 4000 + status})
        return
    body = text.encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"text/plain; charset=utf-8"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
