"""In a real browser: the jobs list names each run and shows its progress, last loss and
newest sample; actions that cannot work are disabled with the reason; Duplicate trains a copy
in a new folder; each state has a colour of its own, on the list and on the run page; the
new-run form offers Start only when it can work, and its default path avoids existing runs."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from difftune.ui.forms import presets
from difftune.ui.pages.states import state_color
from tests.ui.browser import UiProcess, editable, shoot, wait_for
from tests.ui.jobs_helpers import run_outputs
from tests.ui.test_browser_journey import fill
from tests.ui.test_browser_restart import api


def badge_colour(page: Any, testid: str) -> str:
    """The Quasar background colour class (`bg-...`) of the badge a test id marks."""
    classes = page.get_by_test_id(testid).get_attribute("class") or ""
    return next((c for c in classes.split() if c.startswith("bg-")), "")


def failed_job(ui: UiProcess, run_file: Path) -> dict[str, Any]:
    """A train job of `run_file` refused by the CLI (a bad learning rate), once it failed."""
    job = api(ui, "POST", "/jobs", {"verb": "train", "config": str(run_file),
                                    "args": ["--set", "train.lr=-1"]})

    def ended() -> dict[str, Any] | None:
        now = api(ui, "GET", f"/jobs/{job['id']}")
        return now if now["state"] == "failed" else None

    return wait_for("the bad run to fail", ended, timeout=120)


def test_the_jobs_list_and_the_actions_it_offers(tmp_path: Path, browser: Any) -> None:
    run_dir = tmp_path / "runs" / "done"
    run_dir.mkdir(parents=True)
    text = presets.get("tiny-flux").toml
    (run_dir / "run.toml").write_text(text)
    (tmp_path / "runs" / "run").mkdir()  # where the form's default would go, already taken
    ui = UiProcess(tmp_path).start()
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(20_000)
    try:
        job = failed_job(ui, run_dir / "run.toml")
        run_outputs(run_dir, 100, 100, final=True, samples=(50, 100))  # as a finished run
        page.goto(f"{ui.url}/")
        row = f"job-{job['id']}"
        wait_for("the run's progress", lambda: page.get_by_test_id(
            f"{row}-progress").inner_text() == "step 100/100")
        assert page.get_by_test_id(f"{row}-name").inner_text() == "done"
        assert page.get_by_test_id(f"{row}-loss").inner_text() == "loss 0.0100"
        thumb = page.get_by_test_id(f"{row}-sample").locator("img")
        wait_for("the newest sample", lambda: "step-000100_00_a-red-square.png" in (
            thumb.get_attribute("src") or ""))
        assert badge_colour(page, f"{row}-state") == f"bg-{state_color('failed')}"
        assert page.get_by_test_id(f"{row}-resume").is_disabled()
        assert "run is complete (step 100 of 100)" in page.get_by_test_id(
            f"{row}-why-resume").inner_text()
        assert page.get_by_test_id(f"{row}-requeue").is_disabled()
        assert "already holds a run's results" in page.get_by_test_id(
            f"{row}-why-requeue").inner_text()
        shoot(page, "jobs-actions")
        page.goto(f"{ui.url}/run?job={job['id']}")  # the run page says the same
        wait_for("the run page's greyed Resume", lambda: page.get_by_test_id("resume").count())
        assert page.get_by_test_id("resume").is_disabled()
        assert "run is complete (step 100 of 100)" in page.get_by_test_id(
            "why-resume").inner_text()
        page.goto(f"{ui.url}/")
        wait_for("the jobs list again", lambda: page.get_by_test_id(f"{row}-duplicate").count())
        page.get_by_test_id(f"{row}-duplicate").click()
        page.wait_for_url(re.compile(r"/run\?job=\d+"))
        copy = api(ui, "GET", f"/jobs/{page.url.rsplit('=', 1)[1]}")
        assert (copy["run_dir"], copy["config"], copy["name"]) == \
            (str(tmp_path / "runs" / "done-2"), str(run_dir / "run-2.toml"), "done-2")
        written = (run_dir / "run-2.toml").read_text()
        assert 'dir = "../done-2"' in written and 'name = "lora-2"' in written
        assert (run_dir / "run.toml").read_text() == text
        wait_for("the copy to fail (its bad learning rate came along)",
                 lambda: page.get_by_test_id("run-state").inner_text() == "failed", timeout=120)
        wait_for("the run page's badge colour", lambda: badge_colour(
            page, "run-state") == f"bg-{state_color('failed')}")
        assert state_color("failed") not in (state_color("running"), state_color("stopped"))

        page.goto(f"{ui.url}/prepare?path={run_dir / 'run.toml'}")
        start = page.get_by_test_id("start")
        wait_for("Start offered for a valid run file", lambda: start.is_enabled())
        start.click()
        error = page.get_by_test_id("error")
        wait_for("the refusal", lambda: error.count() and "already holds a run's results"
                 in error.first.inner_text())
        assert "/prepare" in page.url

        page.goto(f"{ui.url}/prepare")
        page.get_by_test_id("preset").click()
        page.get_by_role("option", name=re.compile("tiny FLUX.1")).click()
        path = editable(page, "save-path")
        wait_for("the default save path", lambda: path.input_value())
        assert path.input_value() == str(tmp_path / "runs" / "run-2" / "run.toml")
        wait_for("Start offered", lambda: start.is_enabled())
        fill(page, "field-train.lr", "-1")
        wait_for("Start withdrawn", lambda: start.is_disabled())
        assert "fix the error" in page.get_by_test_id("start-why").inner_text()
        fill(page, "field-train.lr", "0.001")
        wait_for("Start offered again", lambda: start.is_enabled())
    finally:
        page.close()
        ui.stop()
