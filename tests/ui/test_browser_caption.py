"""In a real browser, the datasets page captions a folder in the background with a local
model (a tiny ONNX tagger) and lists the dataset report's findings, each linked to its image;
and the captioning process stops on request and resumes where it stopped."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from difftune.ui import captioning
from tests import captioners
from tests.ui.browser import UiProcess, editable, shoot, wait_for

COLORS = {"red": (255, 0, 0), "blue": (0, 0, 255), "mix": (255, 0, 255)}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A root with a folder of uncaptioned images and a tagger, served by `difftune ui`."""
    root = tmp_path_factory.mktemp("ui-caption")
    captioners.images_folder(root / "data", COLORS)
    captioners.tagger_folder(root / "tagger")
    ui = UiProcess(root).start()
    yield ui
    ui.stop()


def test_caption_in_the_background_then_the_report_links_each_image(
        served: UiProcess, browser: Any) -> None:
    data = served.root / "data"
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        page.goto(f"{served.url}/datasets?path=data&resolution=64")
        wait_for("the grid", lambda: page.get_by_test_id("image-2").count())
        page.get_by_test_id("caption-panel").get_by_text("Caption with a local model").click()
        page.get_by_test_id("caption-found").click()  # the captioners under the roots
        page.get_by_role("option", name="tagger (wd14)").click()
        assert editable(page, "caption-model").input_value() == str(served.root / "tagger")
        editable(page, "caption-trigger").fill("ohwx")
        page.get_by_test_id("caption-style").click()
        page.get_by_role("option", name="tags", exact=True).click()
        page.get_by_test_id("caption-start").click()
        wait_for("the captions", lambda: "finished: 3 of 3 captions written" in
                 page.get_by_test_id("caption-state").inner_text(), timeout=90)
        assert (data / "red.txt").read_text() == "ohwx, red hair, hatsune miku\n"
        assert page.get_by_test_id("caption-stop").is_disabled()  # nothing runs to stop
        assert page.get_by_test_id("caption-start").is_enabled()
        assert "ohwx, blue sky" in page.get_by_test_id("caption-recent").inner_text()
        wait_for("the grid's captions", lambda: editable(page, "caption-0")
                 .input_value().startswith("ohwx, "))
        shoot(page, "dataset-caption")

        page.get_by_test_id("findings-run").click()
        summary = wait_for("the findings", lambda: page.get_by_test_id(
            "findings-summary").count() and page.get_by_test_id("findings-summary").inner_text())
        assert summary.startswith("dataset report: 3 image(s);")
        assert "3 blurred" in summary  # flat color images have no detail
        row = page.get_by_test_id("findings").locator("a").first
        assert "/api/datasets/image?path=" in row.get_attribute("href")
        assert "blurred" in page.get_by_test_id("finding-0").inner_text()
        page.get_by_test_id("findings").locator("img").last.scroll_into_view_if_needed()
        shoot(page, "dataset-findings")
    finally:
        page.close()


def test_stop_keeps_captions_and_start_resumes(tmp_path: Path) -> None:
    folder = captioners.images_folder(tmp_path / "data", {f"im{i:02d}": (255, 0, i * 20)
                                                          for i in range(12)})
    tagger = captioners.tagger_folder(tmp_path / "tagger")
    app = tmp_path / "app"
    captioning.start(app, folder, tagger, style="tags")
    assert captioning.stop(app, folder)  # at once: while the CLI is still starting
    wait_for("the stop", lambda: captioning.status(app, folder).state == "stopped")
    assert len(list(folder.glob("*.txt"))) < 12
    with pytest.raises(ValueError, match="style"):
        captioning.start(app, folder, tagger, style="poem")
    captioning.start(app, folder, tagger, style="tags")
    wait_for("the rest", lambda: captioning.status(app, folder).state == "finished")
    st = captioning.status(app, folder)
    assert len(list(folder.glob("*.txt"))) == 12 and st.done == st.total
    assert st.recent and st.recent[0]["image"].endswith(".png")
    (app / "captions").joinpath(next(p.name for p in (app / "captions").iterdir()),
                                "record.json").unlink()  # as if killed: no exit record
    assert captioning.status(app, folder).state == "failed"
