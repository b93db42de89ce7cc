"""The /api/runs routes on a real tiny run: list, summary, metrics, samples, files, downloads,
and every way of naming a path outside the roots answered 403."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from difftune.ui.api import runs as runs_api
from difftune.ui.context import UiContext
from difftune.ui.security import Roots
from tests.ui import tiny_run


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A root holding a copy of the tiny run (runs/tiny), and a secret file beside the root."""
    run = tiny_run.make(tmp_path_factory)
    base = tmp_path_factory.mktemp("api-runs")
    shutil.copytree(run, base / "root" / "runs" / "tiny",
                    ignore=shutil.ignore_patterns("tensorboard"))
    (base / "secret.txt").write_text("not yours")
    config = base / "root" / "runs" / "tiny" / "config.resolved.json"
    cfg = json.loads(config.read_text())  # its prompt file, copied under the root with it
    prompts = shutil.copy(cfg["sample"]["prompts"], base / "root" / "prompts.txt")
    config.write_text(json.dumps({**cfg, "sample": {**cfg["sample"], "prompts": str(prompts)}}))
    (base / "root" / "runs" / "tiny" / "leak.txt").symlink_to(base / "secret.txt")
    (base / "root" / "runs" / "linked").symlink_to(base, target_is_directory=True)
    return base / "root"


@pytest.fixture(scope="module")
def client(root: Path) -> TestClient:
    app = FastAPI()
    ctx = UiContext(roots=Roots.of([root]), queue=None)  # type: ignore[arg-type]
    app.include_router(runs_api.router(ctx), prefix="/api")
    return TestClient(app)


RUN = "runs/tiny"


def test_list_and_summary(client: TestClient, root: Path) -> None:
    listed = client.get("/api/runs").json()
    assert [r["path"] for r in listed] == [str(root / RUN)]
    # runs/linked leads out of the root (to the run again, deeper): links are not followed
    assert len(client.get("/api/runs", params={"depth": 8}).json()) == 1
    summary = client.get("/api/runs/summary", params={"path": RUN}).json()
    assert (summary["step"], summary["total_steps"], summary["finished"]) == (4, 4, True)
    assert summary["best_val_loss"] is not None
    assert client.get("/api/runs/summary", params={"path": str(root / RUN)}).json() == summary


def test_metrics_since(client: TestClient) -> None:
    rows = client.get("/api/runs/metrics", params={"path": RUN, "since": 2}).json()
    assert [r["step"] for r in rows] == [3, 4]
    assert {"loss", "loss_smoothed", "lr"} <= set(rows[0]) and "val_loss" in rows[1]


def test_samples_and_their_images(client: TestClient) -> None:
    samples = client.get("/api/runs/samples", params={"path": RUN}).json()
    assert [(s["step"], s["prompt"]) for s in samples[:2]] == [(0, p) for p in tiny_run.PROMPTS]
    image = client.get("/api/runs/image", params={"path": samples[0]["path"]})
    assert image.status_code == 200 and image.headers["content-type"] == "image/png"
    assert image.content == Path(samples[0]["path"]).read_bytes()
    not_sample = client.get("/api/runs/image", params={"path": f"{RUN}/config.resolved.json"})
    assert not_sample.status_code == 404


def test_a_sampled_clip_plays_as_its_animated_preview(client: TestClient, root: Path) -> None:
    """A clip sample (its animated WebP beside the first frame's PNG, sample/video.py) is
    listed with its preview, which /image serves inline and the run page shows (it plays in
    the <img>) in the PNG's place."""
    import numpy as np
    from PIL import Image

    from difftune.sample.video import write_clip
    from difftune.ui.pages.run_samples import image_url
    from difftune.ui.run_outputs import SampleImage

    png = root / RUN / "samples" / "step-000004_00_a-clip.png"
    write_clip(np.random.default_rng(0).random((5, 16, 16, 3)), png, 16.0)
    listed = {s["path"]: s for s in client.get("/api/runs/samples", params={"path": RUN}).json()}
    preview = listed[str(png)]["preview"]
    assert preview == str(png.with_suffix(".webp"))
    got = client.get("/api/runs/image", params={"path": preview})
    assert got.status_code == 200 and got.headers["content-type"] == "image/webp"
    with Image.open(png.with_suffix(".webp")) as webp:
        assert webp.n_frames == 5
    shown = SampleImage(**listed[str(png)])
    assert "a-clip.webp" in image_url(shown) and "a-clip.png" not in image_url(shown)
    assert all(s["preview"] is None for p, s in listed.items() if p != str(png))


def test_files_and_download(client: TestClient, root: Path) -> None:
    files = client.get("/api/runs/files", params={"path": RUN}).json()
    final = [f for f in files if f["final"]]
    assert [f["kind"] for f in final] == ["lora"] and final[0]["metadata"]["difftune.steps"] == "4"
    got = client.get("/api/runs/file", params={"path": final[0]["path"]})
    assert got.status_code == 200 and got.content == (root / RUN / "demo-lora.safetensors").read_bytes()
    assert "demo-lora.safetensors" in got.headers["content-disposition"]


def test_unknown_run_is_404(client: TestClient, root: Path) -> None:
    (root / "empty").mkdir(exist_ok=True)
    for route in ("summary", "metrics", "samples", "files"):
        assert client.get(f"/api/runs/{route}", params={"path": "empty"}).status_code == 404
    assert client.get("/api/runs/file", params={"path": "empty"}).status_code == 404


@pytest.mark.parametrize("url", [
    "/api/runs/file?path=../secret.txt",
    "/api/runs/file?path=runs/tiny/../../../secret.txt",
    "/api/runs/file?path=%2e%2e/secret.txt",
    "/api/runs/file?path=runs%2f%2e%2e%2f%2e%2e%2fsecret.txt",
    "/api/runs/file?path=/etc/passwd",
    "/api/runs/file?path=runs/tiny/leak.txt",            # a link inside pointing outside
    "/api/runs/file?path=runs/linked/secret.txt",        # a linked folder pointing outside
    "/api/runs/image?path=../secret.txt",
    "/api/runs/summary?path=..",
    "/api/runs/metrics?path=/tmp",
    "/api/runs/samples?path=runs/linked",
    "/api/runs/files?path=%2e%2e",
])
def test_paths_outside_the_roots_are_403(client: TestClient, url: str) -> None:
    got = client.get(url)
    assert got.status_code == 403, got.text
    assert "outside the folders this app serves" in got.json()["detail"]
    assert "not yours" not in got.text


def test_routes_are_documented(client: TestClient) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    for route in ("", "/summary", "/metrics", "/samples", "/files", "/file", "/image"):
        assert paths[f"/api/runs{route}"]["get"]["summary"]
