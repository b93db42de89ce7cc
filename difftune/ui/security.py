"""Who may talk to the app and which files it may touch.

Bound to a loopback address the app answers only requests addressed to a loopback host name
(a web page elsewhere cannot reach it by DNS rebinding). Bound to any other address, every
request, websocket included, must carry the token printed at start: as `?token=` once (the
app then sets a cookie), as the cookie, or as `Authorization: Bearer <token>` for scripts.
Every path a request names is resolved (symbolic links included) and must lie under one of
the configured roots.
"""

from __future__ import annotations

import hmac
import ipaddress
import secrets
from dataclasses import dataclass
from http.cookies import SimpleCookie
from pathlib import Path
from typing import Any, Awaitable, Callable
from urllib.parse import parse_qs

COOKIE = "difftune_token"
LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1", "[::1]"}
APP_FOLDER = ".difftune-ui"  # the app's own state (job database, lock file), in the first root


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
        if "\x00" in text:
            raise PathOutsideRoots(f"{text!r} is not a valid path")
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
                               "or start `difftune ui --root` with its folder")

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
    """ASGI middleware: the token check (when `token` is set) or the loopback Host check."""

    def __init__(self, app: ASGIApp, token: str | None) -> None:
        self.app = app
        self.token = token

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers", [])}
        if self.token is None:
            host = headers.get("host", "").rsplit(":", 1)[0] if headers.get("host") else ""
            if host and not is_loopback(host):
                await _refuse(scope, send, 403, "this app is bound to localhost; open it as "
                              "http://127.0.0.1 or start it with --host and use its token")
                return
            await self.app(scope, receive, send)
            return
        given, from_query = _given_token(scope, headers)
        if given is None or not hmac.compare_digest(given, self.token):
            await _refuse(scope, send, 401, "missing or wrong token: open the address "
                          "`difftune ui` printed (it ends in ?token=...) or send "
                          "'Authorization: Bearer <token>'")
            return
        if from_query and scope["type"] == "http":
            send = _with_cookie(send, self.token)
        await self.app(scope, receive, send)


def _given_token(scope: dict, headers: dict[str, str]) -> tuple[str | None, bool]:
    """The token a request carries, and whether it came in the query string."""
    auth = headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip(), False
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    if query.get("token"):
        return query["token"][0], True
    cookie = SimpleCookie(headers.get("cookie", ""))
    if COOKIE in cookie:
        return cookie[COOKIE].value, False
    return None, False


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
