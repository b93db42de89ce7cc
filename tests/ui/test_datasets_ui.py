"""Datasets in the UI (difftune/ui/datasets.py and /api/datasets): browsing, caption edits that
touch only the caption file, reports whose skip reasons are check's own, and paths outside the
roots refused."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from difftune.data.discover import build
from difftune.ui import datasets
from difftune.ui.api import datasets as datasets_api
from difftune.ui.context import UiContext
from difftune.ui.security import Roots
from difftune.verbs.check import _describe_data
from difftune.verbs.demo import demo_dir


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """The demo images (captioned), one without a caption, and three unusable files."""
    out = tmp_path / "root" / "data"
    shutil.copytree(demo_dir(), out, ignore=shutil.ignore_patterns("prompts.txt"))
    (out / "pink_ring.txt").unlink()
    (out / "red_circle.txt").write_text("red, circle, blue")
    (out / "cyan_cross.txt").write_text("cyan, cross, blue")
    (out / "empty.png").write_bytes(b"")
    (out / "truncated.png").write_bytes((out / "red_circle.png").read_bytes()[:120])
    (out / "notes.jpg").write_text("not an image")
    (out / ".hidden.png").write_bytes((out / "red_circle.png").read_bytes())
    return out


def _snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in folder.iterdir()}


def test_browse_pages_images_with_their_captions(folder: Path) -> None:
    page = datasets.browse(folder, offset=0, limit=4)
    names = [Path(i.image).name for i in page.items]
    assert page.total == 9 and names == ["cyan_cross.png", "empty.png", "notes.jpg",
                                         "orange_stripes.png"]  # hidden files are not data
    assert page.items[0].caption == "cyan, cross, blue"
    assert page.items[0].caption_file == str(folder / "cyan_cross.txt")
    assert (page.items[0].width, page.items[0].height) == (64, 64)
    rest = datasets.browse(folder, offset=4, limit=10)
    by_name = {Path(i.image).name: i for i in rest.items}
    assert by_name["pink_ring.png"].caption is None and len(rest.items) == 5


def test_write_caption_changes_only_the_caption_file(folder: Path) -> None:
    before = _snapshot(folder)
    os.chmod(folder / "red_circle.txt", 0o640)
    written = datasets.write_caption(folder / "red_circle.png", "  a new caption\n")
    after = _snapshot(folder)
    assert written == folder / "red_circle.txt" and written.read_text() == "a new caption"
    assert {n for n in after if after[n] != before.get(n)} == {"red_circle.txt"}
    assert set(after) == set(before)  # no temporary file left behind
    assert (written.stat().st_mode & 0o777) == 0o640
    datasets.write_caption(folder / "pink_ring.png", "ring")  # an image without a caption yet
    assert (folder / "pink_ring.txt").read_text() == "ring"
    shown = {Path(i.image).name: i.caption for i in datasets.browse(folder, 0, 100).items}
    assert shown["pink_ring.png"] == "ring"
    with pytest.raises(ValueError, match="not an image file"):
        datasets.write_caption(folder / "red_circle.txt", "x")


def test_report_skips_what_check_skips_with_the_same_reasons(folder: Path) -> None:
    report = datasets.report(folder, resolution=64)
    cfg = datasets.folder_datasets(folder, 64)
    check_lines = [line for line in _describe_data(build(cfg, datasets.DEFAULT_BUCKET_STEP))
                   if line.startswith("  skipped ")]
    assert [f"  skipped {s['path']}: {s['reason']}" for s in report.skipped] == check_lines
    assert {Path(s["path"]).name for s in report.skipped} == {"empty.png", "truncated.png",
                                                              "notes.jpg"}
    assert report.buckets == [{"resolution": 64, "bucket": "64x64", "images": 6}]
    assert [Path(p).name for p in report.missing_captions] == ["pink_ring.png"]
    assert report.tags[0] == {"tag": "blue", "count": 2}
    assert {"words": 3, "images": 2} in report.lengths
    assert report.summary["skipped"] == 3 and report.error is None


def test_report_of_a_run_file_uses_its_separator_and_buckets(folder: Path, tmp_path: Path) -> None:
    (folder / "red_circle.txt").write_text("red | circle | blue")
    (folder / "cyan_cross.txt").write_text("cyan | blue")
    run = tmp_path / "run.toml"
    run.write_text(f'[model]\nfamily = "flux"\nflavor = "tiny"\n\n[[datasets]]\n'
                   f'path = "{folder}"\nresolution = 64\nmin_side = 32\nmax_side = 128\n'
                   f'caption_separator = "|"\nshuffle_caption = true\n\n'
                   f'[save]\ndir = "{tmp_path / "out"}"\n')
    report = datasets.report(run)
    counts = {t["tag"]: t["count"] for t in report.tags}
    assert report.tags[0] == {"tag": "blue", "count": 2}
    assert counts["circle"] == counts["cyan"] == 1 and not any("|" in t for t in counts)
    assert report.buckets[0]["bucket"] == "64x64"


def test_report_of_a_folder_without_usable_images_gives_the_data_error(tmp_path: Path) -> None:
    (tmp_path / "bad.png").write_bytes(b"")
    report = datasets.report(tmp_path, resolution=64)
    assert report.error and "has no usable image" in report.error and "empty file" in report.error


# --- the API -----------------------------------------------------------------------------------

@pytest.fixture
def client(folder: Path) -> TestClient:
    app = FastAPI()
    ctx = UiContext(roots=Roots.of([folder.parent]), queue=None)  # type: ignore[arg-type]
    app.include_router(datasets_api.router(ctx), prefix="/api")
    return TestClient(app)


def test_api_browse_edit_report_and_thumbnail(client: TestClient, folder: Path) -> None:
    page = client.get("/api/datasets/browse", params={"path": "data", "limit": 2}).json()
    assert page["total"] == 9 and page["items"][0]["caption"] == "cyan, cross, blue"
    put = client.put("/api/datasets/caption", json={"image": "data/cyan_cross.png",
                                                    "text": "edited"})
    assert put.status_code == 200 and put.json()["caption"] == "edited"
    assert (folder / "cyan_cross.txt").read_text() == "edited"
    report = client.get("/api/datasets/report", params={"path": "data", "resolution": 64}).json()
    assert len(report["skipped"]) == 3 and report["buckets"][0]["images"] == 6
    thumb = client.get("/api/datasets/image", params={"path": "data/red_circle.png", "size": 32})
    assert thumb.status_code == 200 and thumb.headers["content-type"] == "image/jpeg"
    bad = client.get("/api/datasets/image", params={"path": "data/truncated.png", "size": 32})
    assert bad.status_code == 422 and "corrupt or truncated" in bad.json()["detail"]
    assert client.get("/api/datasets/folders").json() == [{"path": str(folder), "images": 9}]
    low = client.get("/api/datasets/report", params={"path": "data", "resolution": 8})
    assert low.status_code == 422 and "below 64" in low.json()["detail"]


def test_api_refuses_paths_outside_the_roots(client: TestClient, folder: Path,
                                             tmp_path: Path) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_text("keep")
    (folder / "linked.txt").symlink_to(outside)  # the caption of linked.png leads outside
    shutil.copy(folder / "red_circle.png", folder / "linked.png")
    shutil.copy(folder / "red_circle.png", tmp_path / "elsewhere.png")
    attempts = [
        client.get("/api/datasets/browse", params={"path": ".."}),
        client.get("/api/datasets/browse?path=%2e%2e"),
        client.get("/api/datasets/browse", params={"path": str(tmp_path)}),
        client.get("/api/datasets/report", params={"path": "../.."}),
        client.get("/api/datasets/image?path=data/%2e%2e/%2e%2e/elsewhere.png"),
        client.get("/api/datasets/image", params={"path": str(tmp_path / "elsewhere.png")}),
        client.put("/api/datasets/caption", json={"image": "../elsewhere.png", "text": "x"}),
        client.put("/api/datasets/caption", json={"image": "data/linked.png", "text": "x"}),
    ]
    assert [a.status_code for a in attempts] == [403] * len(attempts)
    assert outside.read_text() == "keep" and not (tmp_path / "elsewhere.txt").exists()
    listed = {Path(i["image"]).name: i for i in client.get(
        "/api/datasets/browse", params={"path": "data", "limit": 100}).json()["items"]}
    assert listed["linked.png"]["caption"] is None and listed["linked.png"]["error"]


def test_api_a_video_shows_as_its_first_frame_with_its_length_and_fps(
        client: TestClient, folder: Path) -> None:
    """A video among the images is browsed with its size, frame count and rate, and its
    thumbnail is its first frame; a corrupt one carries check's reason."""
    import io

    import numpy as np
    from PIL import Image

    from tests.videos import frame, write_video

    write_video(folder / "clip.mp4", 20, fps=24, caption="a bar")
    (folder / "broken.webm").write_bytes(b"not a video" * 30)
    page = client.get("/api/datasets/browse", params={"path": "data", "limit": 50}).json()
    by_name = {Path(i["image"]).name: i for i in page["items"]}
    clip = by_name["clip.mp4"]
    assert (clip["width"], clip["height"], clip["frames"], clip["fps"]) == (64, 48, 20, 24.0)
    assert clip["caption"] == "a bar" and by_name["red_circle.png"]["frames"] is None
    assert "unreadable video" in by_name["broken.webm"]["error"]
    thumb = client.get("/api/datasets/image", params={"path": "data/clip.mp4", "size": 64})
    assert thumb.status_code == 200 and thumb.headers["content-type"] == "image/jpeg"
    shown = np.asarray(Image.open(io.BytesIO(thumb.content)).convert("RGB"), dtype=float)
    assert np.abs(shown - frame(0, 64, 48)).mean() < 8
    bad = client.get("/api/datasets/image", params={"path": "data/broken.webm", "size": 64})
    assert bad.status_code == 422 and "unreadable video" in bad.json()["detail"]
