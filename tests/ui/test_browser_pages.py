"""In a real browser, the pages around a run: the dataset browser (a caption edited inline
lands in its .txt file and nowhere else), runs compared on one chart with their samples side
by side, the jobs list, the API page, and the token asked for off loopback."""

from __future__ import annotations

import shutil
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.ui import tiny_run
from tests.ui.browser import DEMO, UiProcess, editable, shoot, wait_for


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A root holding the demo images and two finished tiny runs, served by `difftune ui`."""
    root = tmp_path_factory.mktemp("ui-pages")
    shutil.copytree(DEMO, root / "demo")
    run = tiny_run.make(tmp_path_factory)
    for name in ("run-a", "run-b"):
        shutil.copytree(run, root / "runs" / name)
    ui = UiProcess(root).start()
    yield ui
    ui.stop()


def test_a_caption_edited_in_the_grid_is_written_to_its_file(served: UiProcess,
                                                             browser: Any) -> None:
    root = served.root
    before = {p.name: p.read_bytes() for p in (root / "demo").iterdir()}
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        page.goto(f"{served.url}/datasets?path=demo&resolution=64")
        page.get_by_test_id("caption-0").wait_for()
        caption = editable(page, "caption-0")
        wait_for("the grid", lambda: caption.input_value())
        image = page.get_by_test_id("image-0").locator("img").get_attribute("src") or ""
        caption.fill("a test caption, edited in the browser")
        caption.blur()
        wait_for("the saved note", lambda: "saved" in page.get_by_test_id(
            "caption-status-0").inner_text().lower())
        changed = {p.name for p in (root / "demo").iterdir()
                   if before.get(p.name) != p.read_bytes()}
        assert len(changed) == 1, changed
        name = changed.pop()
        assert name.endswith(".txt") and Path(name).stem in image
        assert (root / "demo" / name).read_text() == "a test caption, edited in the browser"
        wait_for("the report", lambda: page.get_by_test_id("buckets").count())
        shoot(page, "datasets")
    finally:
        page.close()


def test_two_runs_compared_and_the_other_pages(served: UiProcess, browser: Any) -> None:
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        page.goto(f"{served.url}/compare?runs=runs/run-a,runs/run-b")
        wait_for("both runs' samples", lambda: page.get_by_test_id("compare-sample-1").count())
        series = page.evaluate("""() => {
            const el = document.querySelector('[data-testid="compare-chart"]');
            return getElement(el).chart.getOption().series.map(s => s.data.length);
        }""")
        assert len(series) >= 2 and all(n > 0 for n in series), series
        shoot(page, "compare")
        page.goto(f"{served.url}/")
        page.get_by_test_id("page-title").wait_for()
        page.goto(f"{served.url}/docs")
        page.get_by_text("/api/jobs/{job_id}/resume").wait_for()
        shoot(page, "api")
    finally:
        page.close()


def test_off_loopback_the_printed_token_opens_the_app(tmp_path: Path, browser: Any) -> None:
    ui = UiProcess(tmp_path, host="0.0.0.0").start(token_from_log=True)
    try:
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"{ui.url}/api/jobs", timeout=5)
        assert refused.value.code == 401
        page = browser.new_page()
        page.goto(ui.printed)  # the address `difftune ui` printed, ?token=... included
        page.get_by_test_id("page-title").wait_for()
        page.goto(f"{ui.url}/prepare")  # later pages: the cookie carries the token
        page.get_by_test_id("preset").wait_for()
        page.close()
    finally:
        ui.stop()


def test_the_preset_shows_its_savers_and_estimate(served: UiProcess, browser: Any) -> None:
    """Under the preset choice: what the preset adds to its example and its estimated peak,
    the figures `check` and the README's table give (memory/estimate.py)."""
    from difftune.ui.forms import presets
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        for name in ("flux-dev-lora-12gib", "sdxl-lora-16gib"):
            page.goto(f"{served.url}/prepare?preset={name}")
            note = page.get_by_test_id("preset-memory")
            want = presets.get(name).note()
            wait_for("the preset's memory note", lambda: note.inner_text() == want)
        assert "as written" in want and "estimated peak" in want
        flux = presets.get("flux-dev-lora-12gib").note()
        assert "adds int8 text encoders, 8-bit AdamW, block swap" in flux and "not measured" in flux
    finally:
        page.close()
