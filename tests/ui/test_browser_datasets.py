"""In a real browser, a dataset folder changed from the datasets page: files uploaded through
the page land in the folder (a taken name refused, the old file kept), a trigger word added to
every caption in bulk is undone after a reload, byte for byte."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from difftune.ui.limits import MAX_BODY_BYTES
from tests.ui.browser import DEMO, UiProcess, editable, shoot, wait_for


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A root holding a copy of the demo images, served by `difftune ui`."""
    root = tmp_path_factory.mktemp("ui-datasets")
    shutil.copytree(DEMO, root / "demo", ignore=shutil.ignore_patterns("prompts.txt"))
    ui = UiProcess(root).start()
    yield ui
    ui.stop()


def _bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_upload_then_a_bulk_trigger_word_undone(served: UiProcess, browser: Any,
                                                tmp_path: Path) -> None:
    folder = served.root / "demo"
    mine = tmp_path / "mine"
    mine.mkdir()
    shutil.copy(folder / "red_circle.png", mine / "my photo.png")
    (mine / "my photo.txt").write_text("my, own, tags")
    (mine / "red_circle.txt").write_text("would replace the demo's caption")
    image = (folder / "red_circle.png").read_bytes()  # over the 4 MiB other requests may send:
    (mine / "large.png").write_bytes(image + b"\0" * (MAX_BODY_BYTES + (1 << 20)))
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        page.goto(f"{served.url}/datasets?path=demo&resolution=64")
        wait_for("the grid", lambda: editable(page, "caption-0").input_value())
        page.get_by_test_id("dataset-tools").get_by_text("Add images and edit captions").click()
        files = page.get_by_test_id("dataset-upload").locator("input[type=file]")
        files.set_input_files([str(mine / n) for n in ("my photo.png", "my photo.txt",
                                                       "large.png")])
        wait_for("the uploaded files", lambda: all((folder / n).exists() for n in (
            "my photo.png", "my photo.txt", "large.png")))
        wait_for("the large file whole", lambda: (folder / "large.png").read_bytes()
                 == (mine / "large.png").read_bytes())
        assert (folder / "my photo.png").read_bytes() == (mine / "my photo.png").read_bytes()
        wait_for("the grid to show it", lambda: page.get_by_text("my photo.png").count())
        demo_caption = (folder / "red_circle.txt").read_bytes()
        files.set_input_files([str(mine / "red_circle.txt")])
        wait_for("the refusal", lambda: "never replaces" in page.get_by_test_id(
            "upload-status").inner_text())
        assert (folder / "red_circle.txt").read_bytes() == demo_caption

        before = _bytes(folder)
        editable(page, "bulk-text").fill("ohwx")
        page.get_by_test_id("bulk-apply").click()
        wait_for("the bulk edit", lambda: "changed 8 caption files" in page.get_by_test_id(
            "bulk-status").inner_text())
        captions = [p.read_text() for p in folder.glob("*.txt")]  # large.png got one
        assert sorted(c.split(", ")[0] for c in captions) == ["ohwx"] * 8, captions
        assert (folder / "large.txt").read_text() == "ohwx"
        wait_for("the grid's captions", lambda: editable(page, "caption-0")
                 .input_value().startswith("ohwx, "))
        shoot(page, "dataset-tools")

        page.reload()  # the undo survives a reload: it is journaled in the folder
        wait_for("the grid", lambda: editable(page, "caption-0").input_value())
        page.get_by_test_id("dataset-tools").get_by_text("Add images and edit captions").click()
        wait_for("the undo offered", lambda: "add trigger word 'ohwx', 8 caption files"
                 in page.get_by_test_id("undo-info").inner_text())
        page.get_by_test_id("bulk-undo").click()
        wait_for("the undo", lambda: "undone" in page.get_by_test_id("bulk-status").inner_text())
        assert _bytes(folder) == before  # the journal gone with the edit
        wait_for("the grid's captions", lambda: not editable(page, "caption-0")
                 .input_value().startswith("ohwx"))
    finally:
        page.close()
