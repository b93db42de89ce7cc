"""In a real browser, the run page of a long run while a real training job loads the machine:
a run folder with 3,000 samples and 200 checkpoints (made beside the training's own files)
stays connected, never reloads, and honours "Sample now"; the full-size viewer steps through
steps and prompts; "resume from here" on an earlier checkpoint says what it replaces and asks;
"sample with this LoRA" queues a real `difftune sample` job whose images show in a set of
their own, never among the run's samples."""

from __future__ import annotations

import io
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
from PIL import Image
from safetensors.numpy import save_file

from difftune.sample.runner import slug
from difftune.ui.runs import metrics
from tests.ui.browser import DEMO, UiProcess, editable, shoot, wait_for
from tests.ui.jobs_helpers import kill_jobs
from tests.ui.test_browser_restart import api, make_root

PROMPTS = [line.split(" --")[0] for line in (DEMO / "prompts.txt").read_text().splitlines()]
FAKE_STEPS = [50_000 + 10 * k for k in range(3000 // len(PROMPTS))]  # 500 events of 6
FAKE_CHECKPOINTS = [50_000 + 25 * k for k in range(200)]
FAKE_LORAS = [50_000 + 250 * k for k in range(18)]
LAST = FAKE_STEPS[-1]


def _png() -> bytes:
    """A small real PNG (the gallery and the viewer show it)."""
    out = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 40, 40)).save(out, format="PNG")
    return out.getvalue()


def add_long_run_outputs(run: Path) -> None:
    """What a long run leaves: 3,000 samples of the demo's prompts, 200 complete checkpoints
    (a state.json and a small LoRA file each), 18 step LoRA files."""
    png = _png()
    (run / "samples").mkdir(exist_ok=True)
    for step in FAKE_STEPS:
        for i, prompt in enumerate(PROMPTS):
            (run / "samples" / f"step-{step:06d}_{i:02d}_{slug(prompt)}.png").write_bytes(png)
    tensors = {"a.lora_down.weight": np.zeros((2, 2), dtype=np.float32)}
    for step in FAKE_CHECKPOINTS:
        folder = run / "checkpoints" / f"step-{step:06d}"
        folder.mkdir(parents=True)
        (folder / "state.json").write_text("{}")
        save_file(tensors, str(folder / "lora.safetensors"),
                  metadata={"difftune.rank": "4", "difftune.steps": str(step)})
    for step in FAKE_LORAS:
        save_file(tensors, str(run / f"lora-step{step:06d}.safetensors"),
                  metadata={"difftune.rank": "4", "difftune.steps": str(step)})


@pytest.fixture(scope="module")
def long_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[UiProcess, Path, int]]:
    """`difftune ui` with a real training job running (100,000 steps of the tiny FLUX.1 on
    the demo images), its run folder filled as a long run's is."""
    root = tmp_path_factory.mktemp("long-run")
    run_file = make_root(root, steps=100_000, sample_every=100_000, save_every=100_000)
    ui = UiProcess(root).start()
    try:
        job = api(ui, "POST", "/jobs", {"verb": "train", "config": str(run_file)})["id"]
        run_dir = root / "runs" / "tiny"
        wait_for("the first training steps", lambda: metrics(run_dir), timeout=120)
        add_long_run_outputs(run_dir)
        yield ui, run_dir, job
    finally:
        ui.stop()
        kill_jobs(root)


def _burn() -> list[subprocess.Popen[bytes]]:
    """Two processes spinning on the CPU besides the training job (the machine loaded)."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]


def _real_samples(run_dir: Path) -> list[Path]:
    """Sample images the training drew itself (below the made-up steps)."""
    return [p for p in (run_dir / "samples").glob("step-*_00_*.png")
            if int(p.name[5:11]) < FAKE_STEPS[0]]


def test_a_long_run_page_stays_connected_under_load(long_run: tuple[UiProcess, Path, int],
                                                     browser: Any) -> None:
    ui, run_dir, job = long_run
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    loads: list[str] = []
    page.on("load", lambda p: loads.append(p.url))
    console: list[str] = []
    page.on("console", lambda m: console.append(m.text))
    burners = _burn()
    try:
        page.goto(f"{ui.url}/run?job={job}")
        wait_for("the newest samples", lambda: page.get_by_test_id(
            f"samples-step-{LAST}").count(), timeout=60)
        wait_for("the newest files", lambda: page.get_by_test_id(
            f"download-lora-step{FAKE_LORAS[-1]:06d}.safetensors").count(), timeout=60)
        assert page.get_by_test_id("sample").count() == 8 * len(PROMPTS)  # newest steps only
        assert "492 more step(s)" in page.get_by_test_id("gallery-more").inner_text().lower()
        lost = []
        for _ in range(20):  # 10 s of refreshes on a loaded machine, the training going on
            if page.evaluate("document.getElementById('popup').ariaHidden") == "false":
                lost.append(time.monotonic())
            time.sleep(0.5)
        step = int(re.search(r"step (\d+)/", page.get_by_test_id("run-progress")
                             .inner_text()).group(1))
        assert step > 0
        shoot(page, "run-long")
        page.get_by_test_id("sample-now").click()
        wait_for("the request's note", lambda: page.get_by_text("sample requested").count())
        wait_for("the requested sample, drawn by the training", lambda: _real_samples(run_dir),
                 timeout=120)
        assert len(loads) == 1, loads
        assert not [m for m in console if "reloading" in m], console
        assert lost == [], f"the connection was lost {len(lost)} time(s)"
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
        page.close()
    assert "Traceback" not in ui.log.read_text()


def _jobs(ui: UiProcess) -> list[dict[str, Any]]:
    return api(ui, "GET", "/jobs")


def test_viewer_resume_confirmation_and_sampling_with_a_lora(
        long_run: tuple[UiProcess, Path, int], browser: Any) -> None:
    ui, run_dir, job = long_run
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(20_000)
    try:
        page.goto(f"{ui.url}/run?job={job}")
        wait_for("the gallery", lambda: page.get_by_test_id(f"samples-step-{LAST}").count())
        page.get_by_test_id(f"samples-step-{LAST}").get_by_test_id("sample").first.click()
        viewer = page.get_by_test_id("viewer")
        viewer.wait_for()
        where, prompt = page.get_by_test_id("viewer-step"), page.get_by_test_id("viewer-prompt")
        assert (where.inner_text(), prompt.inner_text()) == (f"step {LAST} · prompt 1",
                                                             PROMPTS[0])
        assert page.get_by_test_id("viewer-seed").inner_text() == "seed 1"  # its --d
        size = page.get_by_test_id("viewer-image").evaluate(
            "e => [e.naturalWidth, e.clientWidth]")
        assert size == [64, 64]  # at its own size
        page.keyboard.press("ArrowLeft")
        wait_for("the previous step", lambda: where.inner_text() == f"step {LAST - 10} · prompt 1")
        page.keyboard.press("ArrowDown")
        wait_for("the next prompt", lambda: prompt.inner_text() == PROMPTS[1])
        assert page.get_by_test_id("viewer-seed").inner_text() == "seed 2"
        page.get_by_test_id("viewer-next-step").click()
        wait_for("the next step", lambda: where.inner_text() == f"step {LAST} · prompt 2")
        assert not page.get_by_test_id("viewer-next-step").is_enabled()  # the newest
        shoot(page, "run-viewer")
        page.keyboard.press("Escape")
        # Save now: a real LoRA file and checkpoint, then stop (another checkpoint).
        page.get_by_test_id("save-now").click()
        wait_for("the saved LoRA", lambda: [p for p in run_dir.glob("lora-step*.safetensors")
                                           if int(p.stem[-6:]) < FAKE_STEPS[0]], timeout=90)
        page.get_by_test_id("stop").click()
        wait_for("stopped", lambda: page.get_by_test_id("run-state").inner_text() == "stopped",
                 timeout=90)
        _resume_asks_first(ui, page, run_dir)
        _sample_with_the_lora(page, run_dir)
    finally:
        page.close()


def _resume_asks_first(ui: UiProcess, page: Any, run_dir: Path) -> None:
    """Resume from the run's own (earliest) checkpoint: the dialog counts the 200 later ones
    and the 3,000 later samples; Cancel starts nothing, OK starts the resume."""
    real = min(p.name for p in (run_dir / "checkpoints").glob("step-*"))
    page.get_by_test_id("files-more").click()
    metadata = page.get_by_test_id(f"metadata-{real}")
    metadata.click()  # drawn when opened: the checkpoint's LoRA file's header
    wait_for("its metadata", lambda: '"difftune.rank"' in metadata.inner_text())
    before = len(_jobs(ui))
    page.get_by_test_id(f"resume-from-{real}").click()
    text = page.get_by_test_id("resume-confirm-text")
    wait_for("what it replaces", lambda: "later checkpoint(s)" in text.inner_text())
    later = re.search(r"(\d+) later checkpoint\(s\)", text.inner_text())
    assert later is not None and int(later.group(1)) >= 200  # (and the stop's own)
    assert "3000 sample image(s) of 500 later step(s)" in text.inner_text()
    assert f"step-{FAKE_CHECKPOINTS[0]:06d}" in text.inner_text()
    shoot(page, "run-resume-confirm")
    page.get_by_test_id("resume-confirm-cancel").click()
    time.sleep(1)
    assert len(_jobs(ui)) == before  # nothing started
    page.get_by_test_id(f"resume-from-{real}").click()
    page.get_by_test_id("resume-confirm-ok").click()
    page.wait_for_url(re.compile(rf"/run\?job={before + 1}$"))
    resumed = _jobs(ui)[0]
    assert resumed["args"][:2] == ["--resume", str(run_dir / "checkpoints" / real)]
    api(ui, "POST", f"/jobs/{resumed['id']}/stop")
    wait_for("the resumed job to end", lambda: _jobs(ui)[0]["state"] not in (
        "queued", "running", "stopping"), timeout=90)


def _sample_with_the_lora(page: Any, run_dir: Path) -> None:
    """Sample with the LoRA "Save now" wrote: a job of its own, images in their own set."""
    lora = min(p.name for p in run_dir.glob("lora-step*.safetensors"))
    before = sorted(p.name for p in (run_dir / "samples").iterdir())
    page.goto(page.url.replace(re.search(r"job=\d+", page.url).group(0), "job=1"))
    page.get_by_test_id("files-more").click()
    page.get_by_test_id(f"sample-lora-{lora}").click()
    prompts = editable(page, "lora-prompts")
    wait_for("the run's prompts", lambda: PROMPTS[0] in prompts.input_value())
    prompts.fill("a red circle\na blue square")
    editable(page, "lora-seeds").fill("3, 4")
    strength = editable(page, "lora-strength")
    strength.fill("0.7")
    strength.press("Tab")
    page.get_by_test_id("lora-sample-ok").click()
    wait_for("the job's note", lambda: page.get_by_text("sample job").count())
    name = f"{Path(lora).stem}-1"
    folder = run_dir / "lora-samples" / name
    assert (folder / "prompts.txt").read_text().splitlines()[:2] == ["a red circle --d 3",
                                                                    "a red circle --d 4"]
    group = page.get_by_test_id(f"lora-set-{name}")
    wait_for("its images", lambda: group.get_by_test_id("lora-sample").count() == 4,
             timeout=180)
    assert "strength 0.7, seeds 3, 4" in group.inner_text()
    group.scroll_into_view_if_needed()
    shoot(page, "run-lora-samples")
    group.get_by_test_id("lora-sample").nth(1).click()
    wait_for("the viewer", lambda: page.get_by_test_id("viewer-seed").inner_text() == "seed 4")
    assert page.get_by_test_id("viewer-prompt").inner_text() == "a red circle"
    assert sorted(p.name for p in (run_dir / "samples").iterdir()) == before
