"""/api/datasets/captioning and /api/datasets/findings: a folder captioned in the background
by a tiny ONNX tagger (started, its state read, a second start refused while it runs, stopped),
the refusals with their status codes, and the report's findings as JSON."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from difftune.ui.api import captioning as captioning_api
from difftune.ui.context import UiContext
from difftune.ui.security import Roots
from tests import captioners
from tests.ui.browser import wait_for
from tests.ui.opened import opened_under


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A root holding a folder of uncaptioned images and a tagger."""
    out = tmp_path / "root"
    captioners.images_folder(out / "data", {f"im{i}": (255, 0, 0) for i in range(6)})
    captioners.tagger_folder(out / "tagger")
    return out


@pytest.fixture
def client(root: Path) -> TestClient:
    app = FastAPI()
    ctx = UiContext(roots=Roots.of([root]), queue=None)  # type: ignore[arg-type]
    app.include_router(captioning_api.router(ctx), prefix="/api")
    return TestClient(app)


def test_caption_in_the_background_and_refusals(client: TestClient, root: Path,
                                                tmp_path: Path) -> None:
    body = {"folder": "data", "model": "tagger", "style": "tags", "trigger": "ohwx"}
    started = client.post("/api/datasets/captioning", json=body)
    assert started.status_code == 202, started.text
    again = client.post("/api/datasets/captioning", json=body)
    assert again.status_code == 409 and "already" in again.json()["detail"]
    done = wait_for("the captions", lambda: (s := client.get(
        "/api/datasets/captioning", params={"folder": "data"}).json())["state"] == "finished"
        and s, timeout=90)
    assert done["done"] == done["total"] == 6
    assert (root / "data" / "im0.txt").read_text() == "ohwx, red hair, hatsune miku\n"
    assert client.delete("/api/datasets/captioning", params={"folder": "data"}).status_code == 409
    for change, code, says in (({"model": "data"}, 422, "not a captioning model"),
                               ({"style": "poem"}, 422, "style"),
                               ({"folder": str(tmp_path)}, 403, ""),
                               ({"model": str(tmp_path)}, 403, "")):
        refused = client.post("/api/datasets/captioning", json={**body, **change})
        assert refused.status_code == code and says in refused.json()["detail"]


def test_findings_name_each_image(client: TestClient, root: Path) -> None:
    (root / "data" / "im0.txt").write_text("", encoding="utf-8")
    found = client.get("/api/datasets/findings", params={"path": "data", "resolution": 64})
    assert found.status_code == 200
    rep = found.json()
    assert rep["images"] == 6 and rep["counts"]["caption_empty"] == 1
    assert rep["counts"]["near_duplicate"] == 15  # six copies of one image: every pair
    assert client.get("/api/datasets/findings", params={"path": "absent"}).status_code == 404
    assert client.get("/api/datasets/findings", params={"path": "/"}).status_code == 403


def test_findings_read_nothing_outside_the_roots(client: TestClient, root: Path,
                                                 tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    captioners.images_folder(outside, {"secret": (0, 0, 255)})
    (outside / "secret.txt").write_text("a secret caption")
    (root / "run.toml").write_text(f'[model]\nflavor = "tiny"\n\n[[datasets]]\npath = '
                                   f'"{outside}"\n\n[save]\ndir = "out"\n')
    (root / "data" / "im0.txt").symlink_to(outside / "secret.txt")
    with opened_under(outside) as opened:
        for path, named in (("run.toml", f"datasets.0.path = {outside} in the run file"),
                            ("data", f"{root / 'data' / 'im0.txt'} is outside the folders")):
            answer = client.get("/api/datasets/findings", params={"path": path})
            assert answer.status_code == 403 and named in answer.json()["detail"], answer.text
            assert "a secret caption" not in answer.text
    assert opened == []
