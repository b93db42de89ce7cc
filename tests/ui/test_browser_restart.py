"""In a real browser: the UI restarted mid-run shows the run's true state, and a job whose
process is killed shows as ended with what its log says, never as running."""

from __future__ import annotations

import json
import os
import shutil
import signal
import urllib.request
from pathlib import Path
from typing import Any

from difftune.ui.runs import metrics
from tests.ui.browser import DEMO, UiProcess, shoot, wait_for


RUN_FILE = """\
# a tiny FLUX.1 LoRA on the bundled demo images (CPU)
[model]
family = "flux"
flavor = "tiny"

[adapter]
rank = 4
targets = "attention"

[[datasets]]
path = "demo"
resolution = 64
min_side = 32
max_side = 128

[train]
steps = {steps}
batch_size = 1
lr = 1e-3
seed = 1

[sample]
prompts = "demo/prompts.txt"
every_n_steps = {sample_every}

[save]
dir = "runs/tiny"
every_n_steps = {save_every}
"""


def make_root(root: Path, steps: int, sample_every: int, save_every: int) -> Path:
    """A root folder holding the demo images and a run file; returns the run file."""
    shutil.copytree(DEMO, root / "demo")
    run_file = root / "tiny.toml"
    run_file.write_text(RUN_FILE.format(steps=steps, sample_every=sample_every,
                                        save_every=save_every))
    return run_file


def api(ui: UiProcess, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    """Call the app's HTTP API (as a script on the same machine would)."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(f"{ui.url}/api{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def test_restart_mid_run_and_a_killed_job(tmp_path: Path, browser: Any) -> None:
    run_file = make_root(tmp_path, steps=4000, sample_every=4000, save_every=4000)
    ui = UiProcess(tmp_path).start()
    try:
        job = api(ui, "POST", "/jobs", {"verb": "train", "config": str(run_file)})
        run_dir = tmp_path / "runs" / "tiny"
        wait_for("the first training steps", lambda: metrics(run_dir), timeout=90)
    finally:
        ui.stop()
    assert metrics(run_dir), "the job must outlive the UI"
    ui = UiProcess(tmp_path).start()
    page = browser.new_page()
    try:
        page.goto(f"{ui.url}/run?job={job['id']}")
        state = page.get_by_test_id("run-state")
        wait_for("running after the restart", lambda: state.inner_text() == "running")
        before = int(page.get_by_test_id("run-progress").inner_text().split()[1].split("/")[0])
        wait_for("steps after the restart", lambda: int(page.get_by_test_id(
            "run-progress").inner_text().split()[1].split("/")[0]) > before)
        shoot(page, "run-after-restart")
        pid = api(ui, "GET", f"/jobs/{job['id']}")["pid"]
        os.killpg(pid, signal.SIGKILL)  # the wrapper and the CLI: a crash, no exit record
        wait_for("the killed job to show as ended", lambda: state.inner_text() in
                 ("died", "failed"), timeout=30)
        assert api(ui, "GET", f"/jobs/{job['id']}")["state"] in ("died", "failed")
        assert page.get_by_test_id("error").count() >= 1
    finally:
        page.close()
        ui.stop()
