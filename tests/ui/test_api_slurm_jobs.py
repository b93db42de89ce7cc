"""The web app's queue sending a training to a real SLURM (tests/slurm_cluster.py), over HTTP
(FastAPI's TestClient on the /api/jobs router, the queue running the real CLI): the job shows
SLURM's state while it waits and runs, then succeeds with the same run progress a local job
shows, read from its run folder; a job SLURM refuses (a bad partition) fails with SLURM's
reason; only trainings go to the cluster. (Stop: tests/ui/test_browser_slurm.py.)"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Iterator

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from difftune.ui.api.jobs import router
from difftune.ui.context import UiContext
from difftune.ui.jobs.queue import JobQueue
from difftune.ui.security import Roots
from tests.e2e.conftest import images, run_toml  # noqa: F401  (images: a fixture)

from .jobs_helpers import kill_jobs


@pytest.fixture()
def api(tmp_path: Path, slurm_cluster: Path) -> Iterator[tuple[TestClient, UiContext, Path]]:
    """The jobs API over a queue whose jobs run the real CLI; the root folder."""
    root = tmp_path / "root"
    root.mkdir()
    queue = JobQueue(root / ".difftune-ui" / "jobs.sqlite", Roots.of([root]))
    ctx = UiContext(roots=queue.roots, queue=queue)
    app = FastAPI()
    app.include_router(router(ctx), prefix="/api")
    try:
        yield TestClient(app), ctx, root
    finally:
        queue.close()
        kill_jobs(root)


def until(client: TestClient, ctx: UiContext, job_id: int, done: tuple[str, ...],
          seen: set[str] | None = None, timeout: float = 180) -> dict:
    """Tick the queue until job `job_id` is in one of `done`; SLURM's lines into `seen`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ctx.queue.tick()
        body = client.get(f"/api/jobs/{job_id}").json()
        if seen is not None and body["scheduler"]:
            seen.add(body["scheduler"].split(": ", 1)[1].split(" ")[0])
        if body["state"] in done:
            return body
        time.sleep(0.25)
    raise AssertionError(f"job {job_id} stayed {body['state']} ({body['scheduler']})")


def test_a_training_on_slurm_shows_slurms_state_and_its_run(
        api: tuple[TestClient, UiContext, Path], images: Path) -> None:
    client, ctx, root = api
    shutil.copytree(images, root / "data")
    good, bad = (run_toml(root / name, root / "data") for name in ("good", "bad"))
    check = client.post("/api/jobs", json={"verb": "check", "config": str(good),
                                           "device": "slurm:1x0"})
    assert check.status_code == 400
    assert "only train jobs go to the SLURM" in check.json()["detail"]
    refused = client.post("/api/jobs", json={"verb": "train", "config": str(bad),
                                             "device": "slurm:1x0@no-such-partition"}).json()
    job = client.post("/api/jobs", json={"verb": "train", "config": str(good),
                                         "device": "slurm:1x0@debug"}).json()
    assert job["device"] == "slurm:1x0@debug" and job["state"] == "queued"
    failed = until(client, ctx, refused["id"], ("failed", "succeeded"))
    assert failed["state"] == "failed"
    assert "Invalid partition name specified" in failed["error"]
    seen: set[str] = set()
    done = until(client, ctx, job["id"], ("succeeded", "failed", "stopped"), seen)
    assert done["state"] == "succeeded", done["error"]
    assert "RUNNING" in seen  # SLURM's own state, shown while the job ran there
    assert done["progress"]["step"] == 4 and done["progress"]["finished"]
    assert (root / "good" / "out" / "slurm.sbatch").is_file()
    assert "lora.safetensors" in done["loras"]

