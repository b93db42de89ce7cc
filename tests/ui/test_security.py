"""The app's guard (token off loopback, Host check on loopback) and its path roots."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from fastapi import FastAPI, WebSocket
from fastapi.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from difftune.ui.security import COOKIE, Guard, PathOutsideRoots, Roots, is_loopback


@pytest.fixture()
def roots(tmp_path: Path) -> Roots:
    (tmp_path / "root" / "runs").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret.txt").write_text("no")
    return Roots.of([tmp_path / "root"])


@pytest.mark.parametrize("attempt", [
    "../outside/secret.txt", "runs/../../outside/secret.txt", "/etc/passwd", "~/.ssh/id_rsa",
    "runs/./../../outside", "/", "..",
])
def test_paths_outside_the_roots_are_refused(roots: Roots, attempt: str) -> None:
    with pytest.raises(PathOutsideRoots, match="outside the folders this app serves"):
        roots.resolve(attempt)


def test_a_symlink_out_of_the_roots_is_refused(roots: Roots, tmp_path: Path) -> None:
    os.symlink(tmp_path / "outside", roots.main / "runs" / "escape")
    with pytest.raises(PathOutsideRoots):
        roots.resolve("runs/escape/secret.txt")


def test_paths_inside_resolve_absolute(roots: Roots) -> None:
    assert roots.resolve("runs") == roots.main / "runs"
    assert roots.resolve(str(roots.main / "runs" / "new.toml")) == roots.main / "runs" / "new.toml"
    assert roots.resolve("runs/a/../b") == roots.main / "runs" / "b"
    with pytest.raises(PathOutsideRoots):
        roots.resolve("runs/\x00x")


def test_a_root_must_exist(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="is not a folder"):
        Roots.of([tmp_path / "missing"])


def test_loopback_addresses() -> None:
    assert all(map(is_loopback, ["127.0.0.1", "localhost", "::1", "127.0.0.2"]))
    assert not any(map(is_loopback, ["0.0.0.0", "192.168.1.4", "::", "example.com"]))


def _client(token: str | None, host: str = "127.0.0.1") -> TestClient:
    app = FastAPI()

    @app.get("/api/ping")
    def ping() -> dict[str, str]:
        return {"ok": "yes"}

    app.add_middleware(Guard, token=token)
    return TestClient(app, base_url=f"http://{host}:8765")


def test_with_a_token_every_request_needs_it() -> None:
    client = _client("s3cret", host="192.168.1.4")
    refused = client.get("/api/ping")
    assert refused.status_code == 401 and "token" in refused.text
    assert client.get("/api/ping", headers={"Authorization": "Bearer wrong"}).status_code == 401
    allowed = client.get("/api/ping", headers={"Authorization": "Bearer s3cret"})
    assert allowed.json() == {"ok": "yes"}


def test_the_query_token_sets_a_cookie_that_later_requests_carry() -> None:
    client = _client("s3cret", host="192.168.1.4")
    first = client.get("/api/ping?token=s3cret")
    assert first.status_code == 200 and COOKIE in first.headers["set-cookie"]
    assert client.get("/api/ping").status_code == 200  # the cookie jar carries it
    client.cookies.clear()
    assert client.get("/api/ping").status_code == 401


def test_a_websocket_without_the_token_is_closed() -> None:
    app = FastAPI()

    @app.websocket("/ws")
    async def ws(socket: WebSocket) -> None:
        await socket.accept()
        await socket.send_text("hi")

    app.add_middleware(Guard, token="s3cret")
    client = TestClient(app, base_url="http://10.0.0.2:8765")
    with pytest.raises(WebSocketDisconnect):
        with client.websocket_connect("/ws") as socket:
            socket.receive_text()
    with client.websocket_connect("/ws?token=s3cret") as socket:
        assert socket.receive_text() == "hi"


def test_on_loopback_only_loopback_host_names_are_answered() -> None:
    assert _client(None).get("/api/ping").status_code == 200
    assert _client(None, host="localhost").get("/api/ping").status_code == 200
    rebound = _client(None, host="evil.example.com").get("/api/ping")
    assert rebound.status_code == 403 and "bound to localhost" in rebound.text


def test_one_app_per_job_queue(tmp_path: Path) -> None:
    from difftune.ui.server import make_context

    first = make_context([tmp_path], None)
    with pytest.raises(ValueError, match=r"another difftune ui \(pid \d+\) already serves"):
        make_context([tmp_path], None)
    assert first.lock is not None
    first.lock.close()  # as when the first app ends
    make_context([tmp_path], None).lock.close()
