"""/api/jobs: every path a job will read or write (options, --set overrides, run file) lies
under the roots and outside the app's own folder, checked before it is queued and again
before it starts; a job's log is never written through a symbolic link."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from difftune.ui.context import UiContext
from difftune.verbs.demo import demo_dir

from .jobs_helpers import QUICK
from .test_api_jobs import _until, jobs_api  # noqa: F401 - the fixture

RUN = """[model]
flavor = "tiny"

[[datasets]]
path = "data"

[save]
dir = "runs/t"
"""


def _run_file(root: Path, extra: str = "") -> str:
    """A run file the CLI loads (tiny model, a dataset folder under the root); its name."""
    (root / "data").mkdir(exist_ok=True)
    (root / "t.toml").write_text(RUN + extra)
    return "t.toml"


@pytest.mark.parametrize(("verb", "args", "named"), [
    ("train", ["--set", "cache.dir={out}"], "--set cache.dir={out} (cache.dir)"),
    ("check", ["--set", "save.dir={out}/run"], "--set save.dir={out}/run (save.dir)"),
    ("cache", ["--set=datasets.0.path={out}"], "(datasets.0.path)"),
    ("train", ["--set", "sample.prompts={out}/p.txt"], "(sample.prompts)"),
    ("check", ["--set", "validation.path={out}"], "(validation.path)"),
    ("train", ["--set", "model.vae={out}/ae.safetensors"], "(model.vae)"),
    ("sample", ["--set", "datasets.0.mask_path={out}"], "(datasets.0.mask_path)"),
    ("sample", ["--lora", "{out}/x.safetensors:0.5"], "--lora {out}/x.safetensors:0.5"),
])
def test_job_paths_outside_the_roots_are_403(jobs_api: tuple[TestClient, UiContext],  # noqa: F811
                                             verb: str, args: list[str], named: str) -> None:
    client, ctx = jobs_api
    out = ctx.roots.main.parent / "outside"
    config = _run_file(ctx.roots.main)
    body = {"verb": verb, "config": config, "args": [a.format(out=out) for a in args]}
    answer = client.post("/api/jobs", json=body)
    assert answer.status_code == 403, answer.text
    detail = answer.json()["detail"]
    assert named.format(out=out) in detail and "outside the folders this app serves" in detail
    assert client.get("/api/jobs").json() == []


def test_run_file_paths_outside_the_roots_are_403(
        jobs_api: tuple[TestClient, UiContext]) -> None:  # noqa: F811
    client, ctx = jobs_api
    out = ctx.roots.main.parent / "outside"
    config = _run_file(ctx.roots.main, f'\n[cache]\ndir = "{out}/cache"\n')
    answer = client.post("/api/jobs", json={"verb": "train", "config": config})
    assert answer.status_code == 403
    assert f"cache.dir = {out}/cache in the run file" in answer.json()["detail"]


def test_abbreviated_path_options_are_refused(
        jobs_api: tuple[TestClient, UiContext]) -> None:  # noqa: F811
    client, ctx = jobs_api
    out = ctx.roots.main.parent / "outside"
    config = _run_file(ctx.roots.main)
    for args in (["--ou", str(out)], ["--se", f"save.dir={out}"], ["--init", str(out)]):
        answer = client.post("/api/jobs", json={"verb": "sample", "config": config,
                                                "args": args})
        assert answer.status_code == 400, args
        assert f"{args[0]} is an abbreviated option; write it in full" in answer.json()["detail"]


@pytest.mark.parametrize("args", [["--set", "save.dir=.difftune-ui"],
                                  ["--out", ".difftune-ui/samples"],
                                  ["--set", "cache.dir=.difftune-ui"]])
def test_the_apps_folder_is_never_a_job_path(jobs_api: tuple[TestClient, UiContext],  # noqa: F811
                                             args: list[str]) -> None:
    client, ctx = jobs_api
    config = _run_file(ctx.roots.main)
    answer = client.post("/api/jobs", json={"verb": "sample", "config": config, "args": args})
    assert answer.status_code == 403
    assert "inside the app's own folder" in answer.json()["detail"]


def test_paths_under_the_roots_are_queued_absolute(
        jobs_api: tuple[TestClient, UiContext]) -> None:  # noqa: F811
    client, ctx = jobs_api
    config = _run_file(ctx.roots.main, '\n[cache]\ndir = "caches"\n')
    answer = client.post("/api/jobs", json={"verb": "sample", "config": config, "args": [
        "--set", "sample.prompts=prompts.txt", "--out", "shots"]})
    assert answer.status_code == 201, answer.text
    assert answer.json()["args"][-1] == str(ctx.roots.main / "shots")


def test_a_run_file_edited_after_queueing_is_checked_again_at_start(
        jobs_api: tuple[TestClient, UiContext]) -> None:  # noqa: F811
    client, ctx = jobs_api
    config = _run_file(ctx.roots.main)
    job = client.post("/api/jobs", json={"verb": "check", "config": config, "args": [QUICK]})
    assert job.status_code == 201
    out = ctx.roots.main.parent / "outside"
    _run_file(ctx.roots.main, f'\n[cache]\ndir = "{out}"\n')
    failed = _until(client, ctx, job.json()["id"], "failed", "succeeded")
    assert failed["state"] == "failed"
    assert f"could not start: cache.dir = {out} in the run file" in failed["error"]


def test_a_log_file_that_is_a_link_is_never_followed(
        jobs_api: tuple[TestClient, UiContext]) -> None:  # noqa: F811
    client, ctx = jobs_api
    precious = ctx.roots.main.parent / "outside" / "precious.txt"
    precious.write_text("kept\n")
    folder = ctx.roots.main / "runs" / "a" / ".difftune-jobs"
    folder.mkdir(parents=True)
    (folder / "1.log").symlink_to(precious)
    job = client.post("/api/jobs", json={"verb": "check", "config": "a.toml", "args": [QUICK]})
    assert job.json()["id"] == 1
    failed = _until(client, ctx, 1, "failed", "succeeded")
    assert failed["state"] == "failed" and "is a symbolic link" in failed["error"]
    assert precious.read_text() == "kept\n"
    assert client.get("/api/jobs/1/log").json()["lines"] == []


def test_a_job_folder_that_is_a_link_is_refused(
        jobs_api: tuple[TestClient, UiContext]) -> None:  # noqa: F811
    client, ctx = jobs_api
    outside = ctx.roots.main.parent / "outside"
    run = ctx.roots.main / "runs" / "a"
    run.mkdir(parents=True)
    (run / ".difftune-jobs").symlink_to(outside, target_is_directory=True)
    job = client.post("/api/jobs", json={"verb": "check", "config": "a.toml", "args": [QUICK]})
    failed = _until(client, ctx, job.json()["id"], "failed", "succeeded")
    assert failed["state"] == "failed" and "through a symbolic link" in failed["error"]
    assert list(outside.iterdir()) == []


def test_a_log_reached_through_a_link_is_not_served(
        jobs_api: tuple[TestClient, UiContext]) -> None:  # noqa: F811
    client, ctx = jobs_api
    job = client.post("/api/jobs", json={"verb": "check", "config": "a.toml", "args": [QUICK]})
    assert _until(client, ctx, job.json()["id"], "succeeded")["state"] == "succeeded"
    folder = ctx.roots.main / "runs" / "a" / ".difftune-jobs"
    outside = ctx.roots.main.parent / "outside"
    (outside / "1.log").write_text("secret\n")
    (folder / "1.log").unlink()
    (folder / "1.log").symlink_to(outside / "1.log")
    assert client.get("/api/jobs/1/log").json()["lines"] == []
    for path in folder.iterdir():  # the job's record and pid file, moved out with it
        if path.name != "1.log":
            shutil.copy(path, outside / path.name)
    shutil.rmtree(folder)
    folder.symlink_to(outside, target_is_directory=True)  # the whole folder, now
    assert client.get("/api/jobs/1/log").json()["lines"] == []


def test_the_shipped_demo_data_is_read_but_never_written(
        jobs_api: tuple[TestClient, UiContext]) -> None:  # noqa: F811
    client, ctx = jobs_api
    demo = demo_dir()
    config = _run_file(ctx.roots.main, f'\n[sample]\nprompts = "{demo / "prompts.txt"}"\n')
    read = client.post("/api/jobs", json={"verb": "check", "config": config, "args": [
        "--set", f"datasets.0.path={demo}"]})
    assert read.status_code == 201, read.text
    for args in (["--set", f"save.dir={demo}"], ["--set", f"cache.dir={demo}"],
                 ["--out", str(demo)]):
        written = client.post("/api/jobs", json={"verb": "sample", "config": config,
                                                 "args": args})
        assert written.status_code == 403, args
