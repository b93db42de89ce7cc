"""The /api/lora routes: a LoRA file's reports, convert and resize beside it, and every
refusal as an HTTP status naming the path or the reason."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from difftune.adapters.formats import save_lora
from difftune.ui.api import lora as lora_api
from difftune.ui.context import UiContext
from difftune.ui.security import Roots
from tests.lora_files import diffusers_lora, linear_modules


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A root with a Z-Image LoRA in a run folder, a text file, and a file outside it."""
    run = tmp_path / "root" / "runs" / "z"
    run.mkdir(parents=True)
    save_lora(run / "z.safetensors", diffusers_lora("z_image", linear_modules(
        "z_image", r"attention\.to_[qk]$")), {})
    (run / "notes.txt").write_text("x")
    save_lora(tmp_path / "outside.safetensors", diffusers_lora("z_image", linear_modules(
        "z_image", r"to_q$")), {})
    return tmp_path / "root"


@pytest.fixture
def client(root: Path) -> TestClient:
    app = FastAPI()
    ctx = UiContext(roots=Roots.of([root]), queue=None)  # type: ignore[arg-type]
    app.include_router(lora_api.router(ctx), prefix="/api")
    return TestClient(app)


def test_report_convert_resize(client: TestClient, root: Path) -> None:
    path = "runs/z/z.safetensors"
    got = client.get("/api/lora/report", params={"path": path})
    assert got.status_code == 200
    body = got.json()
    assert body["inspect"]["family"] == "z_image"
    assert [r["dropped"] for r in body["verify"]["results"]] == [[], []]
    made = client.post("/api/lora/convert", json={"path": path, "to": "comfy"})
    assert made.status_code == 201 and Path(made.json()["path"]).is_file()
    again = client.post("/api/lora/convert", json={"path": path, "to": "comfy"})
    assert again.status_code == 409 and "exists" in again.json()["detail"]
    kohya = client.post("/api/lora/convert", json={"path": path, "to": "kohya"})
    assert kohya.status_code == 400 and "no kohya layout" in kohya.json()["detail"]
    resized = client.post("/api/lora/resize", json={"path": path, "rank": 2})
    assert resized.status_code == 201
    assert Path(resized.json()["path"]) == root / "runs" / "z" / "z-r2.safetensors"


def test_refusals(client: TestClient, root: Path) -> None:
    outside = client.get("/api/lora/report", params={"path": str(root.parent /
                                                                 "outside.safetensors")})
    assert outside.status_code == 403
    text = client.get("/api/lora/report", params={"path": "runs/z/notes.txt"})
    assert text.status_code == 404 and "runs/z/notes.txt" in text.json()["detail"]
    bad = client.post("/api/lora/resize", json={"path": "runs/z/z.safetensors"})
    assert bad.status_code == 400 and "--rank" in bad.json()["detail"]


def test_routes_are_documented(client: TestClient) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    assert paths["/api/lora/report"]["get"]["summary"]
    assert paths["/api/lora/convert"]["post"]["summary"]
    assert paths["/api/lora/resize"]["post"]["summary"]
