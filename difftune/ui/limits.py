"""How much the app reads: request bodies and text files are bounded by what a run file or a
caption can be.

A run file is a few KiB and a caption less; `MAX_TEXT_BYTES` (1 MiB) leaves a wide margin for
either, and `MAX_BODY_BYTES` (4 MiB) for one sent as JSON with escapes. A larger body is
answered 413 before the app reads it: at once from its Content-Length, else as soon as the
bytes counted while it streams pass the limit; it is never held in memory whole. A larger file
named as a run file is refused from its size, before it is read.

The upload routes (`UPLOAD_PATHS`: the dataset page's and /api/datasets/upload) take one
image of up to `MAX_UPLOAD_BYTES` per file: there a body must announce its Content-Length
(411 otherwise), one over `MAX_UPLOAD_BODY` is refused 413 from it before any byte is read,
and the rest is passed on unbuffered (the server reads no more than announced), so the route
streams it to disk in chunks instead of holding it in memory.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from difftune.errors import ConfigError

MAX_TEXT_BYTES = 1 << 20
MAX_BODY_BYTES = 4 << 20
MAX_UPLOAD_BYTES = 64 << 20
# One file and its multipart framing (boundaries, part headers, the form's other fields).
MAX_UPLOAD_BODY = MAX_UPLOAD_BYTES + (1 << 20)
UPLOAD_PATHS = re.compile(r"^(/api/datasets/upload|/_nicegui/client/[^/]+/upload/[^/]+)$")


class TooLarge(ConfigError, ValueError):
    """A request body or a file larger than the app reads (HTTP 413)."""


def _mib(size: int) -> str:
    """`size` bytes in MiB, as messages show it."""
    return f"{size / (1 << 20):.1f} MiB"


def read_text(path: Path, what: str = "run file", limit: int = MAX_TEXT_BYTES) -> str:
    """The UTF-8 text of `path`, read only when it is at most `limit` bytes (TooLarge
    otherwise; ConfigError when it is not UTF-8 text). `what` names the file in messages."""
    size = path.stat().st_size
    if size > limit:
        raise TooLarge(f"{path} is {_mib(size)}, too large for a {what} (at most "
                       f"{_mib(limit)}); give the path of a {what}")
    with path.open("rb") as f:
        data = f.read(limit + 1)  # a file that grew since stat stops here too
    if len(data) > limit:
        raise TooLarge(f"{path} is over {_mib(limit)}, too large for a {what}; give the path "
                       f"of a {what}")
    return decode(data, f"{path}", what)


def decode(data: bytes, name: str, what: str = "run file") -> str:
    """`data` decoded as UTF-8; ConfigError naming `name` and the first bad byte otherwise."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{name} is not UTF-8 text (byte 0x{data[err.start]:02x} at offset "
                          f"{err.start}), so it is not a {what}; give the path of a {what}, "
                          "or save it as UTF-8") from None


def encode(text: str, name: str) -> bytes:
    """`text` encoded as UTF-8; ConfigError naming `name`, the line and the column of a
    character that has no UTF-8 form (a lone surrogate, as JSON's "\\ud800" gives)."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as err:
        line = text.count("\n", 0, err.start) + 1
        column = err.start - (text.rfind("\n", 0, err.start) + 1) + 1
        raise ConfigError(f"{name}: the text holds U+{ord(text[err.start]):04X} at line {line}, "
                          f"column {column}, a lone surrogate that is not a character and "
                          "cannot be written as UTF-8; remove it") from None


class BodyLimit:
    """ASGI middleware: HTTP request bodies over `limit` bytes are answered 413 unread."""

    def __init__(self, app: Any, limit: int = MAX_BODY_BYTES,
                 upload_limit: int = MAX_UPLOAD_BODY) -> None:
        self.app = app
        self.limit = limit
        self.upload_limit = upload_limit

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers", []))
        length = headers.get(b"content-length", b"").decode("latin-1").strip()
        if UPLOAD_PATHS.match(scope.get("path", "")) and scope.get("method") == "POST":
            await self._upload(scope, receive, send, length)
            return
        if length.isdigit() and int(length) > self.limit:
            await self._refuse(send, int(length))
            return
        if not length and b"transfer-encoding" not in headers:
            await self.app(scope, receive, send)  # no body
            return
        body, first = await self._read(receive)
        if body is None:
            await self._refuse(send, None)
            return
        await self.app(scope, _replay(body, first, receive), send)

    async def _upload(self, scope: dict, receive: Any, send: Any, length: str) -> None:
        """An upload: passed on unbuffered when it announces a length within the upload
        limit; refused (411 without a length, 413 over the limit) otherwise."""
        if not length.isdigit():
            await _answer(send, 411, "an upload must send its Content-Length")
        elif int(length) > self.upload_limit:
            await _answer(send, 413, f"the upload ({_mib(int(length))}) is larger than this app "
                                     f"takes (at most {_mib(MAX_UPLOAD_BYTES)} a file, one file "
                                     "a request)")
        else:
            await self.app(scope, receive, send)

    async def _read(self, receive: Any) -> tuple[bytes | None, dict | None]:
        """The whole body (None once it passes the limit), and a disconnect message that came
        instead of it (to pass on)."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"".join(chunks), message
            size += len(message.get("body", b""))
            if size > self.limit:
                return None, None
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                return b"".join(chunks), None

    async def _refuse(self, send: Any, size: int | None) -> None:
        """Answer 413 naming the limit (and the body's size when it was announced)."""
        told = f" ({_mib(size)})" if size is not None else ""
        await _answer(send, 413, f"the request body{told} is larger than this app reads (at "
                                 f"most {_mib(self.limit)}): run files and captions are far "
                                 "smaller")


async def _answer(send: Any, status: int, text: str) -> None:
    """Answer `status` with `text`, closing the connection (its body is left unread)."""
    body = text.encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"text/plain; charset=utf-8"),
                            (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


def _replay(body: bytes, first: dict | None, receive: Any) -> Any:
    """A `receive` that gives the app the body read ahead, then whatever comes next."""
    pending: list[dict] = [{"type": "http.request", "body": body, "more_body": False}]
    if first is not None:
        pending.append(first)

    async def replayed() -> dict:
        if pending:
            return pending.pop(0)
        return await receive()
    return replayed
