"""Request bodies and run files are read only up to what a run file can be: larger ones are
answered 413 before they are read into memory."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from difftune.ui.limits import MAX_BODY_BYTES, MAX_TEXT_BYTES, BodyLimit, TooLarge, read_text

CHUNK = 64 * 1024


class Peer:
    """The client side of one ASGI HTTP request: hands out the body in chunks (`chunks`, or
    without end), counting what the app takes, and keeps what it is sent."""

    def __init__(self, chunks: int | None) -> None:
        self.left = chunks
        self.taken = 0
        self.sent: list[dict] = []

    async def receive(self) -> dict:
        self.taken += 1
        more = self.left is None or self.taken < self.left
        return {"type": "http.request", "body": b"x" * CHUNK, "more_body": more}

    async def send(self, message: dict) -> None:
        self.sent.append(message)

    @property
    def status(self) -> int:
        return next(m["status"] for m in self.sent if m["type"] == "http.response.start")


def _scope(headers: list[tuple[bytes, bytes]]) -> dict:
    return {"type": "http", "method": "POST", "path": "/api/config/save", "headers": headers,
            "query_string": b""}


async def _echo(scope: dict, receive: Any, send: Any) -> None:
    """An app that reads the whole body and answers its length."""
    size, more = 0, True
    while more:
        message = await receive()
        size += len(message.get("body", b""))
        more = message.get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": str(size).encode()})


def test_an_announced_large_body_is_refused_unread() -> None:
    peer = Peer(chunks=None)
    asyncio.run(BodyLimit(_echo)(_scope([(b"content-length", b"268435456")]), peer.receive,
                                 peer.send))
    assert peer.status == 413 and peer.taken == 0
    assert b"256.0 MiB" in peer.sent[1]["body"] and b"at most 4.0 MiB" in peer.sent[1]["body"]


def test_a_streamed_large_body_is_refused_once_it_passes_the_limit() -> None:
    peer = Peer(chunks=None)  # chunked, no Content-Length, no end
    asyncio.run(BodyLimit(_echo)(_scope([(b"transfer-encoding", b"chunked")]), peer.receive,
                                 peer.send))
    assert peer.status == 413 and peer.taken == MAX_BODY_BYTES // CHUNK + 1


def test_a_body_within_the_limit_reaches_the_app_whole() -> None:
    peer = Peer(chunks=3)
    asyncio.run(BodyLimit(_echo)(_scope([(b"content-length", str(3 * CHUNK).encode())]),
                                 peer.receive, peer.send))
    assert peer.status == 200 and peer.sent[1]["body"] == str(3 * CHUNK).encode()


def test_through_an_app_the_limit_answers_413() -> None:
    app = FastAPI()

    @app.post("/api/echo")
    async def echo(request: Request) -> dict[str, int]:
        return {"size": len(await request.body())}

    app.add_middleware(BodyLimit)
    client = TestClient(app)
    assert client.post("/api/echo", content=b"x" * 1000).json() == {"size": 1000}
    big = client.post("/api/echo", content=b"x" * (MAX_BODY_BYTES + 1))
    assert big.status_code == 413 and "larger than this app reads" in big.text


def test_a_file_larger_than_a_run_file_is_not_read(tmp_path: Path) -> None:
    big = tmp_path / "big.toml"
    with big.open("wb") as f:
        f.truncate(1 << 30)  # 1 GiB, sparse: reading it whole would take the memory
    with pytest.raises(TooLarge, match=r"big.toml is 1024.0 MiB, too large for a run file"):
        read_text(big)
    (tmp_path / "ok.toml").write_text("a = 1\n")
    assert read_text(tmp_path / "ok.toml") == "a = 1\n"
    assert MAX_TEXT_BYTES < MAX_BODY_BYTES
