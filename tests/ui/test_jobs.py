"""The job queue: real wrapper processes, state derived from processes and run folders."""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path
from typing import Iterator

import pytest

from difftune.ui.jobs.clone import copy_args
from difftune.ui.jobs.derive import derive, finish
from difftune.ui.jobs.launch import gpus_visible, resolve_device, write_json
from difftune.ui.jobs.queue import JobQueue, JobStateError, run_dir_of
from difftune.ui.jobs.store import Job
from difftune.ui.security import PathOutsideRoots, Roots

from .jobs_helpers import (CLI_ERROR, FAIL, QUICK, SLEEP, TRAINLIKE, kill_jobs, make_queue,
                           make_root, wait_for, wait_log)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture()
def jobs_root(tmp_path: Path) -> Iterator[Path]:
    root = make_root(tmp_path)
    yield root
    kill_jobs(root)


@pytest.fixture()
def jobs_queue(jobs_root: Path) -> Iterator[JobQueue]:
    queue = make_queue(jobs_root)
    yield queue
    queue.close()


def test_run_folder_is_the_save_dir_relative_to_the_run_file(tmp_path: Path) -> None:
    config = tmp_path / "cfg" / "run.toml"
    config.parent.mkdir()
    config.write_text('[save]\ndir = "../runs/x"\n')
    assert run_dir_of(config, []) == tmp_path / "runs" / "x"
    assert run_dir_of(config, ["--set", 'save.dir="out"']) == tmp_path / "cfg" / "out"
    config.write_text("not toml [")
    assert run_dir_of(config, []) == tmp_path / "cfg"


def test_one_job_at_a_time_per_device_in_submission_order(jobs_root: Path) -> None:
    jobs_queue = make_queue(jobs_root, gpus=True)  # default is GPU 0, another device than cpu
    short = "import time; time.sleep(0.3)"
    first, second, third = (jobs_queue.submit("check", jobs_root / f"{n}.toml", [short])
                            for n in "abc")
    other = jobs_queue.submit("check", jobs_root / "a.toml", [short], device="cpu")
    jobs_queue.tick()
    states = {j.id: j.state for j in jobs_queue.list()}
    assert states == {first.id: "running", second.id: "queued", third.id: "queued",
                      other.id: "running"}
    done = [wait_for(jobs_queue, j.id, ("succeeded",)) for j in (first, second, third)]
    for before, after in zip(done, done[1:]):
        assert before.ended is not None and after.started is not None
        assert after.started >= before.ended  # the next started only once the previous ended
    assert [j.id for j in jobs_queue.list()] == [other.id, third.id, second.id, first.id]
    assert done[0].run_dir == jobs_root / "runs" / "a"
    assert done[0].log == jobs_root / "runs" / "a" / ".difftune-jobs" / f"{first.id}.log"
    jobs_queue.close()


def _running_at_once(queue: JobQueue, root: Path, devices: list[str]) -> list[str]:
    """Queue a sleeping job on each of `devices`; the devices of those that run after a tick."""
    jobs = [queue.submit("check", root / "a.toml", [SLEEP], device=d) for d in devices]
    queue.tick()
    return [d for d, job in zip(devices, jobs) if queue.get(job.id).state == "running"]


def test_two_spellings_of_one_gpu_are_one_device(jobs_root: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    queue = make_queue(jobs_root, gpus=True)
    try:
        assert _running_at_once(queue, jobs_root, ["cuda:00", "cuda:0", "default", "cpu",
                                                   "cuda:01"]) == ["cuda:00", "cpu", "cuda:01"]
        assert [j.device for j in queue.list()][-1] == "cuda:0"  # stored in one spelling
        assert resolve_device("default", gpus=True) == "cuda:0"
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
        assert resolve_device("default", gpus=True) == resolve_device("cuda:003", gpus=True)
    finally:
        queue.close()


def test_without_a_gpu_every_device_is_the_cpu(tmp_path: Path) -> None:
    # The queue asks torch by default: on this machine, default and cpu are one device
    # exactly when torch sees no GPU.
    cases = [(False, ["default", "cpu", "cuda:0"], ["default"]),
             (None, ["default", "cpu"], ["default"] if not gpus_visible() else ["default", "cpu"])]
    for n, (gpus, devices, running) in enumerate(cases):
        (tmp_path / str(n)).mkdir()
        root = make_root(tmp_path / str(n))
        queue = make_queue(root, gpus=gpus)
        try:
            assert _running_at_once(queue, root, devices) == running
        finally:
            queue.close()
            kill_jobs(root)


def test_stop_cancels_a_queued_job(jobs_queue: JobQueue, jobs_root: Path) -> None:
    running = jobs_queue.submit("check", jobs_root / "a.toml", [SLEEP])
    queued = jobs_queue.submit("check", jobs_root / "b.toml", [QUICK])
    jobs_queue.tick()
    assert jobs_queue.stop(queued.id).state == "cancelled"
    jobs_queue.stop(running.id)
    wait_for(jobs_queue, running.id, ("stopped",))
    jobs_queue.tick()
    assert jobs_queue.get(queued.id).state == "cancelled"
    assert not jobs_queue.get(queued.id).log.exists()  # it never ran


def test_stop_sends_sigterm_to_the_cli_which_stops(jobs_queue: JobQueue,
                                                   jobs_root: Path) -> None:
    job = jobs_queue.submit("train", jobs_root / "a.toml", [TRAINLIKE])
    jobs_queue.tick()
    wait_log(jobs_queue, job.id, "ready")
    assert jobs_queue.stop(job.id).state == "stopping"
    done = wait_for(jobs_queue, job.id, ("stopped", "failed", "succeeded"))
    assert (done.state, done.exit_code, done.error) == ("stopped", 0, None)
    assert any(line.startswith("stopped after step") for line in jobs_queue.tail(job.id))
    with pytest.raises(JobStateError, match="already ended"):
        jobs_queue.stop(job.id)


def test_a_killed_job_is_died_not_running(jobs_queue: JobQueue, jobs_root: Path) -> None:
    job = jobs_queue.submit("train", jobs_root / "a.toml", [SLEEP])
    jobs_queue.tick()
    wait_log(jobs_queue, job.id, "ready")
    os.killpg(jobs_queue.get(job.id).pid, signal.SIGKILL)  # wrapper and CLI, no exit record
    died = wait_for(jobs_queue, job.id, ("died", "failed", "succeeded", "stopped"))
    assert died.state == "died"
    assert "without an exit record" in died.error and died.error.endswith("ready")


def test_exit_0_after_a_stop_is_stopped_only_when_the_cli_says_so(tmp_path: Path) -> None:
    job = Job(id=1, verb="train", config=tmp_path / "run.toml", args=[], run_dir=tmp_path,
              state="stopping", log=tmp_path / "1.log")
    (tmp_path / "lora.safetensors").write_bytes(b"x")
    job.log.write_text(f"step 3\nLoRA written to {tmp_path / 'lora.safetensors'}\n")
    asked = {"exit_code": 0, "ended": 5.0, "signal": "SIGTERM", "killed_by": None}
    assert finish(job, asked).state == "succeeded"  # finished before the stop reached it
    job.log.write_text("step 3\nstopped after step 3; checkpoint saved to c\nresume with: x\n")
    assert finish(job, asked).state == "stopped"
    killed = {"exit_code": 143, "ended": 5.0, "signal": "SIGTERM", "killed_by": "SIGTERM"}
    assert finish(job, killed).state == "stopped"  # a verb without a stop handler
    crashed = {"exit_code": 1, "ended": 5.0, "signal": None, "killed_by": None}
    job.log.write_text("Traceback...\ninternal error: ValueError: x (traceback in log)\n")
    assert finish(job, crashed).error == "internal error: ValueError: x (traceback in log)"


def test_a_reused_pid_is_not_taken_for_the_job(jobs_queue: JobQueue, jobs_root: Path) -> None:
    job = jobs_queue.submit("train", jobs_root / "a.toml", [QUICK])
    job.folder.mkdir(parents=True)
    write_json(job.pidfile, {"pid": os.getpid(), "start": 1})  # a live pid, another start time
    job.state, job.pid = "running", os.getpid()
    assert derive(job).state == "died"


def test_a_restarted_app_reattaches_live_jobs_and_finishes_ended_ones(jobs_root: Path) -> None:
    before = make_queue(jobs_root, gpus=True)  # three devices: default (GPU 0), cpu, GPU 1
    live = before.submit("train", jobs_root / "a.toml", [TRAINLIKE])
    ended = before.submit("check", jobs_root / "b.toml", [QUICK], device="cpu")
    killed = before.submit("train", jobs_root / "c.toml", [SLEEP], device="cuda:1")
    before.tick()
    for job_id in (live.id, killed.id):
        wait_log(before, job_id, "ready")
    os.killpg(before.store.get(killed.id).pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while not before.store.get(ended.id).record.exists():  # ended while the app was down
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert {j.state for j in before.store.all()} == {"running"}
    before.close()  # the app stops; its jobs do not

    after = make_queue(jobs_root, gpus=True)
    try:
        states = {j.id: j.state for j in after.store.all()}  # as the restart derived them
        assert states == {live.id: "running", ended.id: "succeeded", killed.id: "died"}
        assert after.stop(live.id).state == "stopping"
        assert wait_for(after, live.id, ("stopped", "failed")).state == "stopped"
    finally:
        after.close()


def test_a_failed_job_shows_the_cli_error(jobs_queue: JobQueue, jobs_root: Path) -> None:
    job = jobs_queue.submit("train", jobs_root / "a.toml", [FAIL])
    failed = wait_for(jobs_queue, job.id, ("failed", "succeeded"))
    assert (failed.state, failed.exit_code, failed.error) == ("failed", 2, CLI_ERROR)


def test_resume_needs_a_checkpoint(jobs_queue: JobQueue, jobs_root: Path) -> None:
    job = jobs_queue.submit("train", jobs_root / "a.toml", [QUICK, "--set", "train.lr=1"])
    with pytest.raises(JobStateError, match="queued"):
        jobs_queue.resume(job.id)
    wait_for(jobs_queue, job.id, ("succeeded", "failed"))  # no LoRA file: failed, yet finished
    with pytest.raises(JobStateError, match="no complete checkpoint"):
        jobs_queue.resume(job.id)
    step = job.run_dir / "checkpoints" / "step-000004"
    step.mkdir(parents=True)
    (job.run_dir / "checkpoints" / "step-000008").mkdir()  # an interrupted save: no state.json
    (step / "state.json").write_text("{}")
    assert jobs_queue.get(job.id).checkpoints == ["step-000004"]
    resumed = jobs_queue.resume(job.id)
    assert (resumed.verb, resumed.state, resumed.parent) == ("train", "queued", job.id)
    assert resumed.args == [QUICK, "--set", "train.lr=1", "--resume", "latest"]


def test_duplicate_and_requeue_make_new_jobs(jobs_queue: JobQueue, jobs_root: Path) -> None:
    job = jobs_queue.submit("cache", jobs_root / "a.toml", [QUICK], device="cpu")
    with pytest.raises(JobStateError, match="only a finished job"):
        jobs_queue.requeue(job.id)
    copy = jobs_queue.duplicate(job.id)
    assert (copy.verb, copy.config, copy.args, copy.device, copy.parent) == \
        ("cache", job.config, job.args, "cpu", job.id)
    jobs_queue.stop(copy.id)
    wait_for(jobs_queue, job.id, ("succeeded",))
    again = jobs_queue.requeue(job.id)
    assert (again.state, again.parent) == ("queued", job.id) and again.id > copy.id
    with pytest.raises(KeyError, match="no job 999"):
        jobs_queue.requeue(999)


def test_paths_outside_the_roots_are_refused(jobs_queue: JobQueue, jobs_root: Path) -> None:
    outside = jobs_root.parent / "outside" / "run.toml"
    outside.write_text('[save]\ndir = "x"\n')
    (jobs_root / "escape.toml").write_text('[save]\ndir = "../outside/run"\n')
    for config, args in ((outside, []), ("../outside/run.toml", []),
                         (jobs_root / "escape.toml", []),
                         (jobs_root / "a.toml", ["--set", "save.dir='/tmp/elsewhere'"]),
                         (jobs_root / "a.toml", ["--init-lora", "../outside/x.safetensors"]),
                         (jobs_root / "a.toml", ["--resume=/etc"])):
        with pytest.raises(PathOutsideRoots, match="outside the folders"):
            jobs_queue.submit("train", config, args)
    with pytest.raises(ValueError, match="does not exist"):
        jobs_queue.submit("train", "missing.toml")
    with pytest.raises(ValueError, match="device 'gpu7'"):
        jobs_queue.submit("train", "a.toml", device="gpu7")
    job = jobs_queue.submit("sample", "a.toml", ["--lora", "runs/a/l.safetensors:0.5"])
    assert job.args == ["--lora", f"{jobs_root}/runs/a/l.safetensors:0.5"]


def test_the_real_cli_check_passes_and_a_bad_option_fails_with_its_message(
        tmp_path: Path) -> None:
    root = tmp_path / "root"
    shutil.copytree(REPO / "difftune" / "assets" / "demo", root / "demo")
    text = (REPO / "examples" / "tiny-lora.toml").read_text()
    text = text.replace("../difftune/assets/demo", "demo").replace("../runs/", "runs/")
    (root / "tiny.toml").write_text(text)
    queue = JobQueue(root / "jobs.sqlite", Roots.of([root]))
    try:
        good = queue.submit("check", "tiny.toml")
        bad = queue.submit("check", "tiny.toml", ["--bogus"], device="cpu")  # refused at once
        good = wait_for(queue, good.id, ("failed", "succeeded"), timeout=90)
        bad = wait_for(queue, bad.id, ("failed", "succeeded"), timeout=60)
    finally:
        queue.close()
        kill_jobs(root)
    assert good.state == "succeeded", good.error
    assert "check passed: this run should start and train" in good.log.read_text()
    assert good.run_dir == root / "runs" / "tiny-lora"
    assert (bad.state, bad.exit_code) == ("failed", 2)
    assert bad.error == "difftune: error: unrecognized arguments: --bogus"


def test_a_train_job_that_wrote_no_file_is_not_a_success(tmp_path: Path) -> None:
    job = Job(id=1, verb="train", config=tmp_path / "run.toml", args=[], run_dir=tmp_path,
              state="running", log=tmp_path / "1.log")
    clean = {"exit_code": 0, "ended": 5.0, "signal": None, "killed_by": None}
    job.log.write_text("step 3\n")
    failed = finish(job, clean)
    assert failed.state == "failed" and "no LoRA or model file" in failed.error
    job.log.write_text(f"LoRA written to {tmp_path / 'gone.safetensors'}\n")
    failed = finish(job, clean)
    assert failed.state == "failed" and "there is no such file" in failed.error
    (tmp_path / "gone.safetensors").write_bytes(b"x")
    assert finish(job, clean).state == "succeeded"
    # Wan 2.2 A14B's two files, in one line (cli.py joins them with " and "); the folder's own
    # name may hold " and " too
    pair = [tmp_path / "x and y" / f"l{s}.safetensors" for s in ("_high_noise", "_low_noise")]
    job.log.write_text(f"LoRA written to {pair[0]} and {pair[1]}\n")
    failed = finish(job, clean)
    assert failed.state == "failed" and f"{pair[0]} and {pair[1]}" in failed.error
    pair[0].parent.mkdir()
    pair[0].write_bytes(b"x")
    assert finish(job, clean).state == "failed"  # one of the two is not a success
    pair[1].write_bytes(b"x")
    assert finish(job, clean).state == "succeeded"


def test_a_second_stop_kills_a_job_that_ignores_sigterm(jobs_queue: JobQueue,
                                                        jobs_root: Path) -> None:
    stubborn = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "print('ready', flush=True); time.sleep(60)")
    job = jobs_queue.submit("train", jobs_root / "a.toml", [stubborn])
    jobs_queue.tick()
    wait_log(jobs_queue, job.id, "ready")
    assert jobs_queue.stop(job.id).state == "stopping"
    time.sleep(1.0)
    assert jobs_queue.get(job.id).state == "stopping"  # SIGTERM ignored: still there
    jobs_queue.stop(job.id)  # the second press kills it
    done = wait_for(jobs_queue, job.id, ("died", "failed", "stopped", "succeeded"))
    assert done.state == "died" and "without an exit record" in done.error


def test_a_copy_of_a_training_leaves_out_its_resume_and_save_overrides() -> None:
    args = ["--set=save.dir=x", "--resume=latest", "--set", "train.lr=1", "--resume",
            "runs/a/checkpoints/step-000001", "--set", " save.name = y", "--init-lora", "l.st"]
    assert copy_args(args) == ["--set", "train.lr=1", "--init-lora", "l.st"]
