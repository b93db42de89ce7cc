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


WS = "ws://127.0.0.1:8765/ws"  # in full: the test client's websockets default to another host


def _acting_app(token: str | None, origin_token: str | None = None) -> tuple[TestClient, list]:
    """An app behind the guard whose POST /api/act, and websocket, record that they acted."""
    acted: list[str] = []
    app = FastAPI()

    @app.post("/api/act")
    def act() -> dict[str, str]:
        acted.append("post")
        return {"ok": "yes"}

    @app.get("/api/ping")
    def ping() -> dict[str, str]:
        return {"ok": "yes"}

    @app.websocket("/ws")
    async def ws(socket: WebSocket) -> None:
        await socket.accept()
        acted.append("ws")
        await socket.send_text("hi")

    app.add_middleware(Guard, token=token, origin_token=origin_token)
    return TestClient(app, base_url="http://127.0.0.1:8765"), acted


@pytest.mark.parametrize("headers", [
    {"Origin": "http://evil.example"}, {"Origin": "null"},
    {"Origin": "http://127.0.0.1:9999"},  # another port is another site's page
    {"Origin": "http://localhost:8765"}, {"Origin": "http://127.0.0.1:notaport"},
    {"Referer": "http://evil.example/page"}, {"Sec-Fetch-Site": "cross-site"},
    {"Sec-Fetch-Site": "same-site", "Referer": "http://127.0.0.1:8765/"},
])
def test_on_loopback_a_request_from_another_site_changes_nothing(headers: dict) -> None:
    client, acted = _acting_app(None, origin_token="o-token")
    refused = client.post("/api/act", headers=headers)
    assert refused.status_code == 403 and "another web site" in refused.text
    wrong = client.post("/api/act", headers=headers | {"Authorization": "Bearer nope"})
    assert wrong.status_code == 403 and acted == []
    with pytest.raises(WebSocketDisconnect):
        with client.websocket_connect(WS, headers=headers) as socket:
            socket.receive_text()
    assert acted == []
    # The token lets it through (a browser page elsewhere cannot send it: it never sees it).
    assert client.post("/api/act", headers=headers | {"Authorization": "Bearer o-token"}) \
        .status_code == 200
    assert acted == ["post"]


def test_the_apps_own_pages_and_scripts_still_act() -> None:
    client, acted = _acting_app(None, origin_token="o-token")
    same = {"Origin": "http://127.0.0.1:8765", "Referer": "http://127.0.0.1:8765/prepare",
            "Sec-Fetch-Site": "same-origin"}
    assert client.post("/api/act", headers=same).status_code == 200
    assert client.post("/api/act").status_code == 200  # curl or a script: no Origin
    with client.websocket_connect(WS, headers={"Origin": "http://127.0.0.1:8765"}) as socket:
        assert socket.receive_text() == "hi"
    # A link from another site opens a page; only a foreign Origin is refused on reads.
    assert client.get("/api/ping", headers={"Sec-Fetch-Site": "cross-site",
                                            "Referer": "http://evil.example/"}).status_code == 200
    assert client.get("/api/ping", headers={"Origin": "http://evil.example"}).status_code == 403
    assert acted == ["post", "post", "ws"]


def test_with_a_token_the_cookie_does_not_carry_a_request_from_another_site() -> None:
    client, acted = _acting_app("s3cret")
    client.get("/api/ping?token=s3cret")  # the cookie is set, as the printed link does
    evil = {"Origin": "http://evil.example"}
    assert client.post("/api/act").status_code == 200
    refused = client.post("/api/act", headers=evil)
    assert refused.status_code == 403 and "Origin: http://evil.example" in refused.text
    client.cookies.clear()
    assert client.post("/api/act", headers=evil).status_code == 401
    assert client.post("/api/act", headers=evil | {"Authorization": "Bearer s3cret"}) \
        .status_code == 200
    assert acted == ["post", "post"]
