"""/api/datasets uploads, bulk caption edits and their undo: an upload never replaces a file,
lands only under the roots with a plain image or caption name, and stays within its size
limits (the upload route alone takes bodies over 4 MiB, streamed); a bulk edit is undone byte
for byte from its journal on disk; tags are counted only over tag-style captions."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from difftune.ui import caption_bulk, dataset_uploads, datasets
from difftune.ui.api import datasets as datasets_api
from difftune.ui.context import UiContext
from difftune.ui.limits import MAX_BODY_BYTES, MAX_TEXT_BYTES, BodyLimit
from difftune.ui.security import Roots

from .test_datasets_ui import _snapshot, client, folder  # noqa: F401 - the fixtures


def _png(folder: Path) -> bytes:
    return (folder / "red_circle.png").read_bytes()


def _upload(client: TestClient, where: str, *files: tuple[str, bytes]) -> object:  # noqa: F811
    return client.post("/api/datasets/upload", params={"folder": where},
                       files=[("files", (name, io.BytesIO(data))) for name, data in files])


def test_an_upload_writes_images_and_captions(client: TestClient,  # noqa: F811
                                              folder: Path) -> None:
    answer = _upload(client, "data", ("new one.png", _png(folder)), ("new one.txt", b"ohwx, dog"))
    assert answer.status_code == 200, answer.text
    assert answer.json()["files"] == [str(folder / "new one.png"), str(folder / "new one.txt")]
    assert (folder / "new one.png").read_bytes() == _png(folder)
    assert datasets.browse(folder, 0, 100).total == 10
    assert not [p for p in folder.iterdir() if p.name.endswith(".upload")]


@pytest.mark.parametrize("name, reason", [
    ("../up.png", "no folder part"), ("sub\\up.png", "no folder part"),
    (".up.png", "hidden files"), ("up.exe", "not an image or caption file"),
    ("up.toml", "not an image or caption file"), ("..", "no folder part"),
    ("u" * 300 + ".png", "longer than 255 bytes")])
def test_an_upload_with_a_bad_name_is_422_and_writes_nothing(
        client: TestClient, folder: Path, name: str, reason: str) -> None:  # noqa: F811
    before = _snapshot(folder)
    answer = _upload(client, "data", (name, _png(folder)))
    assert answer.status_code == 422, answer.text
    assert repr(name) in answer.json()["detail"] and reason in answer.json()["detail"]
    assert _snapshot(folder) == before and [p.name for p in folder.parent.iterdir()] == ["data"]


def test_a_name_with_a_control_character_is_refused() -> None:
    # (an HTTP client escapes one in the multipart header; a name is checked all the same)
    with pytest.raises(dataset_uploads.UploadRefused, match="control character"):
        dataset_uploads.check_name("u\x01p.png")


def test_an_upload_never_replaces_a_file(client: TestClient, folder: Path) -> None:  # noqa: F811
    before = _snapshot(folder)
    answer = _upload(client, "data", ("red_circle.txt", b"replaced"), ("fresh.txt", b"kept"))
    assert answer.status_code == 409, answer.text
    detail = answer.json()["detail"]
    assert "'red_circle.txt'" in detail and "never replaces" in detail
    assert "kept: fresh.txt" in detail
    assert (folder / "red_circle.txt").read_bytes() == before["red_circle.txt"][0]
    assert (folder / "fresh.txt").read_text() == "kept"


def test_an_upload_outside_the_roots_or_into_the_apps_folder_is_403(
        client: TestClient, folder: Path, tmp_path: Path) -> None:  # noqa: F811
    outside = tmp_path / "outside"
    outside.mkdir()
    answer = _upload(client, str(outside), ("up.png", _png(folder)))
    assert answer.status_code == 403 and "outside the folders" in answer.json()["detail"]
    (folder / "link").symlink_to(outside)
    assert _upload(client, "data/link", ("up.png", _png(folder))).status_code == 403
    (folder.parent / ".difftune-ui").mkdir()
    answer = _upload(client, ".difftune-ui", ("up.png", _png(folder)))
    assert answer.status_code == 403 and "app's own folder" in answer.json()["detail"]
    assert list(outside.iterdir()) == [] and list((folder.parent / ".difftune-ui").iterdir()) == []


def test_an_upload_that_is_too_large_or_not_its_kind_is_refused(
        client: TestClient, folder: Path) -> None:  # noqa: F811
    big = _upload(client, "data", ("big.txt", b"x" * (MAX_TEXT_BYTES + 1)))
    assert big.status_code == 413 and "'big.txt'" in big.json()["detail"]
    bad = _upload(client, "data", ("broken.png", b"not a png"), ("latin.txt", b"caf\xe9"))
    assert bad.status_code == 422
    assert "'broken.png': not a readable image" in bad.json()["detail"]
    assert "'latin.txt'" in bad.json()["detail"] and "not UTF-8" in bad.json()["detail"]
    assert not any((folder / n).exists() for n in ("big.txt", "broken.png", "latin.txt"))
    assert not [p for p in folder.iterdir() if p.name.endswith(".upload")]


def test_only_the_upload_route_takes_bodies_over_the_request_limit(
        folder: Path) -> None:  # noqa: F811
    app = FastAPI()
    ctx = UiContext(roots=Roots.of([folder.parent]), queue=None)  # type: ignore[arg-type]
    app.include_router(datasets_api.router(ctx), prefix="/api")
    app.add_middleware(BodyLimit, upload_limit=MAX_BODY_BYTES * 2)
    limited = TestClient(app)
    image = _png(folder)
    large = image + b"\0" * (MAX_BODY_BYTES + 1024 - len(image))  # a PNG with trailing bytes
    answer = _upload(limited, "data", ("large.png", large))
    assert answer.status_code == 200, answer.text
    assert (folder / "large.png").read_bytes() == large
    caption = limited.put("/api/datasets/caption", content=json.dumps(
        {"image": "data/red_circle.png", "text": "x" * (MAX_BODY_BYTES + 1)}),
        headers={"content-type": "application/json"})
    assert caption.status_code == 413
    larger = _upload(limited, "data", ("larger.png", large + b"\0" * MAX_BODY_BYTES))
    assert larger.status_code == 413 and "at most 64.0 MiB a file" in larger.text
    assert not (folder / "larger.png").exists()


def test_an_upload_without_a_length_is_411_unread() -> None:
    taken: list[dict] = []

    async def receive() -> dict:
        taken.append({})
        return {"type": "http.request", "body": b"x" * 1024, "more_body": True}

    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def app(scope: dict, receive: object, send: object) -> None:
        raise AssertionError("the app is not called")

    scope = {"type": "http", "method": "POST", "path": "/_nicegui/client/c1/upload/5",
             "headers": [(b"transfer-encoding", b"chunked")], "query_string": b""}
    asyncio.run(BodyLimit(app)(scope, receive, send))
    assert sent[0]["status"] == 411 and taken == []
    assert b"Content-Length" in sent[1]["body"]


# --- bulk caption edits ------------------------------------------------------------------------

def _bulk(client: TestClient, **body: object) -> object:  # noqa: F811
    return client.post("/api/datasets/bulk-caption", json={"folder": "data", **body})


def test_a_bulk_edit_is_undone_byte_for_byte(client: TestClient,  # noqa: F811
                                            folder: Path) -> None:
    (folder / "red_circle.txt").write_bytes(b"\xef\xbb\xbfred, circle,  blue\r\n")
    (folder / "cyan_cross.txt").chmod(0o600)
    before = _snapshot(folder)
    added = _bulk(client, op="add", text="ohwx", where="start")
    assert added.status_code == 200, added.text
    assert (folder / "red_circle.txt").read_bytes() == b"ohwx, red, circle,  blue\r\n"
    assert (folder / "pink_ring.txt").read_text() == "ohwx"  # it had no caption file
    assert (folder / "cyan_cross.txt").stat().st_mode & 0o777 == 0o600
    # the journal is on disk: a new app (a reload, a restart) undoes it
    assert (folder / caption_bulk.JOURNAL).is_file()
    undone = client.post("/api/datasets/undo-caption", json={"folder": "data"})
    assert undone.status_code == 200, undone.text
    after = _snapshot(folder)
    assert {n: b for n, (b, _) in after.items()} == {n: b for n, (b, _) in before.items()}
    assert (folder / "cyan_cross.txt").stat().st_mode & 0o777 == 0o600
    again = client.post("/api/datasets/undo-caption", json={"folder": "data"})
    assert again.status_code == 409 and "no bulk caption edit" in again.json()["detail"]


def test_an_edit_that_changes_nothing_keeps_the_last_undo(client: TestClient,  # noqa: F811
                                                          folder: Path) -> None:
    before = _snapshot(folder)
    _bulk(client, op="add", text="ohwx")
    again = _bulk(client, op="add", text="ohwx")  # every caption has it already
    assert again.status_code == 200 and again.json()["files"] == []
    assert client.post("/api/datasets/undo-caption", json={"folder": "data"}).status_code == 200
    assert {n: b for n, (b, _) in _snapshot(folder).items()} == \
        {n: b for n, (b, _) in before.items()}


def test_bulk_edits_remove_replace_and_selected_images(client: TestClient,  # noqa: F811
                                                     folder: Path) -> None:
    _bulk(client, op="add", text="ohwx", where="end", images=["data/red_circle.png"])
    assert (folder / "red_circle.txt").read_text() == "red, circle, blue, ohwx"
    assert (folder / "cyan_cross.txt").read_text() == "cyan, cross, blue"
    assert _bulk(client, op="remove", text="ohwx", where="end").status_code == 200
    assert (folder / "red_circle.txt").read_text() == "red, circle, blue"
    _bulk(client, op="replace", text="blue", replacement="navy")
    assert (folder / "cyan_cross.txt").read_text() == "cyan, cross, navy"
    assert (folder / "red_circle.txt").read_text() == "red, circle, navy"
    assert caption_bulk.BulkEdit("remove", "ohwx").apply("ohwx, a dog") == "a dog"
    assert caption_bulk.BulkEdit("remove", "ohwx").apply("ohwxy, a dog") == "ohwxy, a dog"
    assert caption_bulk.BulkEdit("add", "ohwx").apply("ohwx, a dog") == "ohwx, a dog"


def test_undo_refuses_when_a_caption_changed_since(client: TestClient,  # noqa: F811
                                                   folder: Path) -> None:
    _bulk(client, op="add", text="ohwx")
    (folder / "red_circle.txt").write_text("my own edit")
    before = _snapshot(folder)
    answer = client.post("/api/datasets/undo-caption", json={"folder": "data"})
    assert answer.status_code == 409 and "red_circle.txt changed after" in answer.json()["detail"]
    assert _snapshot(folder) == before


def test_bulk_edits_refuse_paths_outside_and_other_folders_images(
        client: TestClient, folder: Path, tmp_path: Path) -> None:  # noqa: F811
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "a.png").write_bytes(_png(folder))
    assert client.post("/api/datasets/bulk-caption", json={
        "folder": str(outside), "op": "add", "text": "x"}).status_code == 403
    answer = _bulk(client, op="add", text="x", images=[str(outside / "a.png")])
    assert answer.status_code == 403 and not (outside / "a.txt").exists()
    assert _bulk(client, op="add", text="x", caption_ext=".png").status_code == 422
    assert not (folder / caption_bulk.JOURNAL).exists()


# --- the tag-style rule ------------------------------------------------------------------------

@pytest.mark.parametrize("caption, tags", [
    ("1girl, red hair, smiling", True), ("ohwx", True), ("a red car", True),
    ("A woman with red hair, smiling at the camera.", False),
    ("a photo of a dog sitting on grass", False), ("red, circle. It is blue, big", False),
    ("", False)])
def test_the_tag_style_rule(caption: str, tags: bool) -> None:
    assert datasets.is_tag_style(caption) is tags


def test_the_report_counts_tags_only_over_tag_style_captions(client: TestClient,  # noqa: F811
                                                             folder: Path) -> None:
    (folder / "cyan_cross.txt").write_text("A cyan cross on a white ground, drawn by hand.")
    report = client.get("/api/datasets/report", params={"path": "data", "resolution": 64}).json()
    counts = {t["tag"]: t["count"] for t in report["tags"]}
    assert counts["blue"] == 1 and "cyan" not in counts
    assert not any("drawn by hand" in t for t in counts)
    # the demo's own captions ("a white triangle on a black background") are prose too
    assert report["caption_styles"] == {"tags": 1, "prose": 4}
    assert not any("background" in t for t in counts)
