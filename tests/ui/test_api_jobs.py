"""/api/jobs: the queue over HTTP (FastAPI's TestClient on an app with only this router)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Iterator

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from difftune.ui.api.jobs import router
from difftune.ui.context import UiContext

from .jobs_helpers import (FAIL, QUICK, SLEEP, TRAINLIKE, kill_jobs, make_queue, make_root,
                           run_outputs, wait_log)


@pytest.fixture()
def jobs_api(tmp_path: Path) -> Iterator[tuple[TestClient, UiContext]]:
    root = make_root(tmp_path)
    queue = make_queue(root)
    ctx = UiContext(roots=queue.roots, queue=queue)
    app = FastAPI()
    app.include_router(router(ctx), prefix="/api")
    try:
        yield TestClient(app), ctx
    finally:
        queue.close()
        kill_jobs(root)


def _until(client: TestClient, ctx: UiContext, job_id: int, *states: str) -> dict:
    """Tick the queue until the API shows job `job_id` in one of `states`."""
    for _ in range(300):
        ctx.queue.tick()
        body = client.get(f"/api/jobs/{job_id}").json()
        if body["state"] in states:
            return body
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} stayed {body['state']}")


def test_submit_list_get_and_log(jobs_api: tuple[TestClient, UiContext]) -> None:
    client, ctx = jobs_api
    made = client.post("/api/jobs", json={"verb": "check", "config": "a.toml", "args": [QUICK]})
    assert made.status_code == 201
    job = made.json()
    assert (job["state"], job["verb"], job["device"]) == ("queued", "check", "default")
    assert job["run_dir"] == str(ctx.roots.main / "runs" / "a")
    failing = client.post("/api/jobs", json={"verb": "train", "config": "b.toml", "args": [FAIL],
                                             "device": "cpu"}).json()
    assert [j["id"] for j in client.get("/api/jobs").json()] == [failing["id"], job["id"]]
    done = _until(client, ctx, job["id"], "succeeded")
    assert done["exit_code"] == 0 and done["ended"] >= done["started"]
    log = client.get(f"/api/jobs/{job['id']}/log", params={"tail": 1}).json()
    assert log == {"id": job["id"], "lines": ["done"]}
    failed = _until(client, ctx, failing["id"], "failed")
    assert failed["error"].startswith("error: run.toml: 1 problem(s)")


def test_stop_then_resume_refused_without_checkpoint(
        jobs_api: tuple[TestClient, UiContext]) -> None:
    client, ctx = jobs_api
    job = client.post("/api/jobs", json={"verb": "train", "config": "a.toml",
                                         "args": [TRAINLIKE]}).json()
    ctx.queue.tick()
    wait_log(ctx.queue, job["id"], "ready")
    assert client.post(f"/api/jobs/{job['id']}/stop").json()["state"] == "stopping"
    assert _until(client, ctx, job["id"], "stopped")["checkpoints"] == []
    refused = client.post(f"/api/jobs/{job['id']}/resume")
    assert refused.status_code == 409 and "no complete checkpoint" in refused.json()["detail"]
    assert client.post(f"/api/jobs/{job['id']}/stop").status_code == 409
    again = client.post(f"/api/jobs/{job['id']}/requeue")
    assert again.status_code == 201 and again.json()["parent"] == job["id"]
    copy = client.post(f"/api/jobs/{again.json()['id']}/duplicate").json()
    assert (copy["state"], copy["args"]) == ("queued", [TRAINLIKE])
    assert client.post(f"/api/jobs/{copy['id']}/stop").json()["state"] == "cancelled"


@pytest.mark.parametrize("route", ["/api/jobs/999", "/api/jobs/999/log"])
def test_unknown_job_is_404(jobs_api: tuple[TestClient, UiContext], route: str) -> None:
    client, _ = jobs_api
    answer = client.get(route)
    assert answer.status_code == 404 and "no job 999" in answer.json()["detail"]
    for action in ("stop", "resume", "duplicate", "requeue"):
        assert client.post(f"/api/jobs/999/{action}").status_code == 404


@pytest.mark.parametrize("body", [
    {"verb": "train", "config": "../outside/run.toml"},
    {"verb": "train", "config": "/etc/passwd"},
    {"verb": "train", "config": "runs/../../outside/run.toml"},
    {"verb": "train", "config": "a.toml", "args": ["--init-lora", "../../etc/x.safetensors"]},
    {"verb": "sample", "config": "a.toml", "args": ["--out", "/tmp"]},
])
def test_paths_outside_the_roots_are_403(jobs_api: tuple[TestClient, UiContext],
                                         body: dict) -> None:
    client, ctx = jobs_api
    (ctx.roots.main.parent / "outside" / "run.toml").write_text('[save]\ndir = "x"\n')
    answer = client.post("/api/jobs", json=body)
    assert answer.status_code == 403
    assert "outside the folders this app serves" in answer.json()["detail"]
    assert client.get("/api/jobs").json() == []


def test_bad_input_is_refused_with_the_message(jobs_api: tuple[TestClient, UiContext]) -> None:
    client, ctx = jobs_api
    assert client.post("/api/jobs", json={"verb": "demo", "config": "a.toml"}).status_code == 422
    missing = client.post("/api/jobs", json={"verb": "train", "config": "nope.toml"})
    assert missing.status_code == 400 and "does not exist" in missing.json()["detail"]
    device = client.post("/api/jobs", json={"verb": "train", "config": "a.toml", "device": "x"})
    assert device.status_code == 400 and "use default, cpu or cuda:N" in device.json()["detail"]
    big = ctx.roots.main / "big.toml"
    big.write_text("# " + "x" * (2 << 20) + "\n")  # valid TOML, larger than a run file can be
    large = client.post("/api/jobs", json={"verb": "train", "config": "big.toml"})
    assert large.status_code == 413 and "too large for a run file" in large.json()["detail"]


def test_routes_are_documented(jobs_api: tuple[TestClient, UiContext]) -> None:
    client, _ = jobs_api
    paths = client.get("/openapi.json").json()["paths"]
    assert paths["/api/jobs"]["post"]["summary"] == "Queue a job"
    for route in ("/api/jobs/{job_id}", "/api/jobs/{job_id}/stop", "/api/jobs/{job_id}/resume",
                  "/api/jobs/{job_id}/duplicate", "/api/jobs/{job_id}/requeue",
                  "/api/jobs/{job_id}/log"):
        assert route in paths and all(op.get("description") for op in paths[route].values())


def _post(client: TestClient, route: str, **body: object) -> dict:
    """POST `route` (a job, or an action on one); the answer's JSON with its status code."""
    answer = client.post(route, json=body or None)
    return {"status": answer.status_code, **answer.json()}


def test_a_training_is_refused_where_it_cannot_start(
        jobs_api: tuple[TestClient, UiContext]) -> None:
    client, ctx = jobs_api
    first = _post(client, "/api/jobs", verb="train", config="a.toml", args=[SLEEP])
    assert first["status"] == 201 and first["actions"] == {"stop": None, "duplicate": None}
    second = _post(client, "/api/jobs", verb="train", config="a.toml", args=[QUICK])
    assert second["status"] == 409
    assert f"job {first['id']} (queued) already trains in the run folder" in second["detail"]
    assert _post(client, "/api/jobs", verb="check", config="a.toml", args=[QUICK])["status"] == 201
    assert _post(client, "/api/jobs", verb="train", config="b.toml", args=[QUICK])["status"] == 201
    assert _post(client, f"/api/jobs/{first['id']}/stop")["state"] == "cancelled"
    run_dir = ctx.roots.main / "runs" / "a"
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n')
    held = _post(client, "/api/jobs", verb="train", config="a.toml", args=[QUICK])
    assert held["status"] == 409 and "already holds a run's results (metrics.jsonl)" in \
        held["detail"] and "Duplicate it" in held["detail"]
    resumed = _post(client, "/api/jobs", verb="train", config="a.toml",
                    args=[QUICK, "--resume", "latest"])
    assert resumed["status"] == 201
    replaced = _post(client, "/api/jobs", verb="train", config="a.toml",
                     args=[QUICK, "--set", "save.overwrite=true"])
    assert replaced["status"] == 409 and f"job {resumed['id']} (queued)" in replaced["detail"]
    _post(client, f"/api/jobs/{resumed['id']}/stop")
    replaced = _post(client, "/api/jobs", verb="train", config="a.toml",
                     args=[QUICK, "--set", "save.overwrite=true"])
    assert replaced["status"] == 201


def test_duplicate_of_a_training_trains_a_copy_in_a_new_folder(
        jobs_api: tuple[TestClient, UiContext]) -> None:
    client, ctx = jobs_api
    root = ctx.roots.main
    text = ('# my run\n[save]\ndir = "runs/a"  # where it goes\nname = "mine"\n\n'
            '[train]\nsteps = 5\n')
    (root / "a.toml").write_text(text)
    job = _post(client, "/api/jobs", verb="train", config="a.toml",
                args=[QUICK, "--set", "save.name=other", "--set", "train.lr=1"])
    _until(client, ctx, job["id"], "failed")  # (no "written to" line: failed, yet finished)
    run_outputs(root / "runs" / "a", 3, 5, final=False)
    requeued = _post(client, f"/api/jobs/{job['id']}/requeue")
    assert requeued["status"] == 409 and "already holds a run's results" in requeued["detail"]
    offered = client.get(f"/api/jobs/{job['id']}").json()["actions"]
    assert offered == {"resume": None, "requeue": requeued["detail"], "duplicate": None}
    copy = _post(client, f"/api/jobs/{job['id']}/duplicate")
    assert copy["status"] == 201
    assert (copy["config"], copy["run_dir"], copy["name"], copy["parent"]) == \
        (str(root / "a-2.toml"), str(root / "runs" / "a-2"), "a-2", job["id"])
    assert copy["args"] == [QUICK, "--set", "train.lr=1"]  # the file now names folder and name
    assert (root / "a-2.toml").read_text() == \
        text.replace('"runs/a"', '"runs/a-2"').replace('"mine"', '"other-2"')
    assert (root / "a.toml").read_text() == text
    (root / "a-3.toml").write_text("# a file of the user's\n")
    again = _post(client, f"/api/jobs/{job['id']}/duplicate")  # runs/a-2: the queued copy's
    assert (again["config"], again["run_dir"]) == (str(root / "a-4.toml"),
                                                   str(root / "runs" / "a-4"))
    assert (root / "a-3.toml").read_text() == "# a file of the user's\n"
    of_copy = _post(client, f"/api/jobs/{copy['id']}/duplicate")
    assert of_copy["run_dir"] == str(root / "runs" / "a-5")
    assert 'name = "other-5"' in (root / "a-5.toml").read_text()


def test_resume_is_offered_only_while_the_run_has_steps_left(
        jobs_api: tuple[TestClient, UiContext]) -> None:
    client, ctx = jobs_api
    done_dir = ctx.roots.main / "runs" / "a"
    lora = done_dir / "lora.safetensors"
    writes = (f"import pathlib; p = pathlib.Path({str(lora)!r}); p.parent.mkdir(parents=True, "
              "exist_ok=True); p.write_bytes(b'{}'); print(f'LoRA written to {p}')")
    done = _post(client, "/api/jobs", verb="train", config="a.toml", args=[writes])
    done = _until(client, ctx, done["id"], "succeeded", "failed")
    assert done["state"] == "succeeded"
    run_outputs(done_dir, 5, 5, final=True)
    refused = _post(client, f"/api/jobs/{done['id']}/resume")
    assert refused["status"] == 409 and "run is complete (step 5 of 5)" in refused["detail"]
    got = client.get(f"/api/jobs/{done['id']}").json()
    assert got["actions"]["resume"] == refused["detail"]
    assert got["progress"] == {"name": "a", "step": 5, "total": 5, "eta_s": None, "loss": 0.2,
                               "sample": None, "finished": True}
    stopped = _post(client, "/api/jobs", verb="train", config="b.toml", args=[TRAINLIKE])
    ctx.queue.tick()
    wait_log(ctx.queue, stopped["id"], "ready")
    _post(client, f"/api/jobs/{stopped['id']}/stop")
    _until(client, ctx, stopped["id"], "stopped")
    run_outputs(ctx.roots.main / "runs" / "b", 3, 5, final=False)
    got = client.get(f"/api/jobs/{stopped['id']}").json()
    assert got["actions"]["resume"] is None and got["progress"]["eta_s"] == 1.0
    assert _post(client, f"/api/jobs/{stopped['id']}/resume")["status"] == 201
    busy = client.get(f"/api/jobs/{stopped['id']}").json()["actions"]["requeue"]
    assert busy is not None and "already trains in the run folder" in busy


def test_a_copy_of_a_run_file_grown_too_large_is_413(
        jobs_api: tuple[TestClient, UiContext]) -> None:
    client, ctx = jobs_api
    job = _post(client, "/api/jobs", verb="train", config="a.toml", args=[QUICK])
    (ctx.roots.main / "a.toml").write_text('[save]\ndir = "runs/a"\n# ' + "x" * (2 << 20) + "\n")
    answer = _post(client, f"/api/jobs/{job['id']}/duplicate")
    assert answer["status"] == 413 and "too large for a run file" in answer["detail"]
    assert not (ctx.roots.main / "a-2.toml").exists()
