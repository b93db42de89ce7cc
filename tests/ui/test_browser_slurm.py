"""In a real browser: a training queued on the jobs page with a SLURM device goes to the test
SLURM (tests/slurm_cluster.py), and its row shows SLURM's own state; Stop cancels it there:
the training saves a checkpoint, the job is not requeued, and Resume is offered."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

from tests.e2e.conftest import images, run_toml  # noqa: F401  (images: a fixture)
from tests.ui.browser import UiProcess, wait_for
from tests.ui.test_browser_restart import api


def test_a_slurm_job_from_the_jobs_page_shows_slurms_state(tmp_path: Path, browser: Any,
                                                          slurm_cluster: Path,
                                                          images: Path) -> None:
    shutil.copytree(images, tmp_path / "data")
    config = run_toml(tmp_path / "long", tmp_path / "data", steps=300)
    config.write_text(config.read_text().replace("[save]\n", "[save]\nevery_n_steps = 2\n"))
    ui = UiProcess(tmp_path).start()
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(20_000)
    try:
        page.goto(f"{ui.url}/")
        page.get_by_test_id("submit-config").fill(str(config))
        page.get_by_test_id("submit-device").fill("slurm:1x0@debug")
        page.get_by_test_id("submit").click()
        page.wait_for_url(re.compile(r"/run\?job=\d+"))
        job = api(ui, "GET", f"/jobs/{page.url.rsplit('=', 1)[1]}")
        assert job["device"] == "slurm:1x0@debug"
        page.goto(f"{ui.url}/")
        line = page.get_by_test_id(f"job-{job['id']}-scheduler")
        wait_for("SLURM's state on the row", lambda: re.fullmatch(
            r"job \d+: RUNNING on \S+", line.inner_text()), timeout=120)
        first = tmp_path / "long" / "out" / "checkpoints" / "step-000002" / "state.json"
        wait_for("the job's first checkpoint", first.is_file, timeout=120)
        api(ui, "POST", f"/jobs/{job['id']}/stop")
        wait_for("the cancelled job", lambda: page.get_by_test_id(
            f"job-{job['id']}-state").inner_text() == "stopped", timeout=120)
        log = next((tmp_path / "long" / "out").glob("slurm-*.out")).read_text()
        assert "stopped after step" in log and "was cancelled" in log  # a checkpoint saved,
        assert "requeueing" not in log  # and the cancelled job not requeued
        assert api(ui, "GET", f"/jobs/{job['id']}")["actions"]["resume"] is None
    finally:
        page.close()
        ui.stop()
