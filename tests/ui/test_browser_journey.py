"""In a real browser, what a user does: pick the tiny FLUX.1 preset, point it at the demo
images, see a bad field refused with the CLI's message, check, start, watch the loss chart and
a sample appear (and the run's progress and ETA on the jobs list), press "sample now", stop,
resume, finish, download the LoRA."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

from safetensors import safe_open

from difftune.ui.runs import metrics
from tests.ui.browser import DEMO, UiProcess, editable, shoot, wait_for

STEP = re.compile(r"step (\d+)/(\d+)")


def fill(page: Any, testid: str, value: str) -> None:
    """Type `value` into the input a form field's test id marks, as a user would, and leave it
    (the form validates on change)."""
    if testid.startswith("field-") and not page.get_by_test_id(testid).is_visible():
        section = re.split(r"[.\[]", testid[len("field-"):])[0]  # open its form section
        page.get_by_test_id(f"section-{section}").locator(".q-item").first.click()
    target = editable(page, testid)
    target.fill(value)
    target.press("Tab")


def step_of(page: Any) -> int:
    """The step the run page shows."""
    found = STEP.search(page.get_by_test_id("run-progress").inner_text())
    return int(found.group(1)) if found else 0


def chart_points(page: Any) -> int:
    """How many training-loss points the run page's chart holds (read from ECharts itself)."""
    return page.evaluate("""() => {
        const el = document.querySelector('[data-testid="loss-chart"]');
        const chart = el && getElement(el) && getElement(el).chart;  // NiceGUI's echart
        const opt = chart && chart.getOption();
        return opt ? opt.series[0].data.length : -1;
    }""")


def test_a_user_trains_the_tiny_preset_end_to_end(tmp_path: Path, browser: Any) -> None:
    shutil.copytree(DEMO, tmp_path / "demo")
    ui = UiProcess(tmp_path).start()
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(20_000)
    try:
        page.goto(f"{ui.url}/prepare")
        page.get_by_test_id("preset").click()
        page.get_by_role("option", name=re.compile("tiny FLUX.1")).click()
        wait_for("the preset's TOML", lambda: "flavor" in page.get_by_test_id("toml").inner_text())
        fill(page, "field-datasets[0].subsets[0].path", str(tmp_path / "demo"))
        fill(page, "field-train.lr", "-1")
        error = page.get_by_test_id("problem-train.lr")  # the CLI's line, beside its field
        wait_for("the CLI's message for the bad field", lambda: "train.lr" in error.inner_text())
        error.scroll_into_view_if_needed()
        shoot(page, "prepare-error")
        fill(page, "field-train.lr", "0.001")
        wait_for("the message to go", lambda: error.inner_text() == "")
        for field, value in (("train.steps", "120"), ("sample.every_n_steps", "100"),
                             ("save.every_n_steps", "100")):
            fill(page, f"field-{field}", value)
        fill(page, "save-path", str(tmp_path / "runs" / "tiny" / "run.toml"))
        page.get_by_test_id("check").click()
        report = page.get_by_test_id("check-report")
        wait_for("check passed", lambda: "check passed" in report.inner_text(), timeout=90)
        report.scroll_into_view_if_needed()
        shoot(page, "prepare")
        page.get_by_test_id("start").click()
        page.wait_for_url(re.compile(r"/run\?job=\d+"))
        run_dir = tmp_path / "runs" / "tiny"
        wait_for("loss points on the chart", lambda: chart_points(page) > 5, timeout=120)
        jobs = browser.new_page(viewport={"width": 1400, "height": 1000})
        jobs.goto(f"{ui.url}/")  # the jobs list, while the run trains: its progress and ETA
        wait_for("the ETA on the jobs list", lambda: jobs.get_by_test_id(
            "job-2-eta").inner_text().startswith("ETA "))
        assert jobs.get_by_test_id("job-2-name").inner_text() == "tiny"
        assert STEP.search(jobs.get_by_test_id("job-2-progress").inner_text())
        jobs.close()
        page.get_by_test_id("sample-now").click()  # before the scheduled sample at step 100
        asked = step_of(page)
        wait_for("the requested sample", lambda: page.get_by_test_id("sample").count() > 0)
        shown = page.locator('[data-testid^="samples-step-"]').first.get_attribute("data-testid")
        assert shown is not None and int(shown.rsplit("-", 1)[1]) % 100 != 0, shown
        wait_for("its images", lambda: page.get_by_test_id("sample").count() >= 6)
        shoot(page, "run")
        page.get_by_test_id("stop").click()
        state = page.get_by_test_id("run-state")
        wait_for("stopped", lambda: state.inner_text() == "stopped", timeout=60)
        stopped_at = max(r["step"] for r in metrics(run_dir))
        assert asked <= stopped_at < 120
        page.get_by_test_id("resume").click()
        page.wait_for_url(re.compile(r"/run\?job=\d+"))
        wait_for("the resumed run to finish", lambda: page.get_by_test_id(
            "run-state").inner_text() == "succeeded", timeout=120)
        assert step_of(page) == 120
        assert page.get_by_test_id("resume").count() == 0  # nothing left to train
        shoot(page, "run-finished")
        with page.expect_download() as download:
            page.get_by_test_id("download-lora.safetensors").click()
        saved = tmp_path / "downloaded.safetensors"
        download.value.save_as(saved)
        with safe_open(str(saved), "pt") as f:
            assert any(key.endswith(".alpha") or "lora" in key for key in f.keys())
        page.goto(f"{ui.url}/")
        # the check, the stopped training and its resumption
        for job, state in ((1, "succeeded"), (2, "stopped"), (3, "succeeded")):
            wait_for(f"job {job} {state}", lambda: page.get_by_test_id(
                f"job-{job}-state").inner_text() == state)
        assert page.get_by_test_id("job-3-progress").inner_text() == "step 120/120"
        assert page.get_by_test_id("job-3-resume").is_disabled()  # nothing left to train
        shoot(page, "jobs")
    finally:
        page.close()
        ui.stop()
