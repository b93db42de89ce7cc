"""Data-parallel training through accelerate on the CPU (gloo), two processes, tiny flavor.

Tolerance: N processes with train.batch_size B draw the same noise, timesteps and batches as
one process with batch N*B, so they differ only in floating-point summation order (per-process
means, the all-reduce). We require per-step losses equal to a relative 1e-5 and every LoRA
weight within 0.1 x lr of the single-process run after 4 AdamW steps (Adam moves a weight by
about lr per step, so this says every step went the same way; we saw 5e-5 with lr 1e-2).

Tiers: every multi-process run costs a launch of two processes, so the default run keeps one
representative of each behaviour. The plain run of two processes (`two`) and the tests that
read it are `full_only`, each behaviour being shown in the default run elsewhere: N processes
equal one on the same global batch (tests/e2e/contract/test_training_paths.py's two-process
Qwen-Image run, accelerate launch with disk caches and padded captions; test_fsdp.py;
test_multinode.py), each cache entry filled once and one run log and metrics row a step
(test_multinode.py's two-node run), a checkpoint of two processes resumed by one and a changed
global batch refused (test_multinode.py's lost node; test_fsdp.py for a sharded one). Its
variants on other data (a short last batch leaving one process empty; a trained text encoder
with a rarely used placeholder) are `full_only` too; `--num-processes` is exercised by the
stop-signal and `cache` runs, so its own training run is `full_only` as well. Failing ranks,
stop signals and the `cache` verb each run by default; a stop signal reaching one process
between steps is `full_only`, the stops during a sample event showing the same exchange.
Decisions every process must share (validation, keep_best, metrics): test_distributed_decisions.py.
`pytest --full` runs all.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file

from difftune.cache.disk import DiskStore
from difftune.cli import main

from .conftest import run_toml

ROOT = Path(__file__).resolve().parents[2]
LR = 1e-2  # run_toml's train.lr
TWO = ["--set", "train.batch_size=1", "--set", "save.every_n_steps=2"]


def launch(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """`accelerate launch --multi_gpu --num_processes 2 ARGS` (gloo on a CPU-only machine).
    A run still going after `timeout` seconds (a hang: processes waiting in collectives the
    others never enter) fails the test, its processes killed, none left behind."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
           "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
           "--dynamo_backend", "no", "--main_process_port", "0", *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, err = proc.communicate()
        pytest.fail(f"the run hung: still going after {timeout:g} s\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def kill_tree(pid: int) -> None:
    """SIGKILL process `pid` and every process under it (each rank of a launch runs in a
    session of its own, so no process group holds them all)."""
    import psutil

    root = psutil.Process(pid)
    for proc in [*root.children(recursive=True), root]:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass


def held_out(tmp_path: Path, images: Path) -> str:
    """A `[validation]` section reading one demo image of its own (training data unchanged)."""
    held = tmp_path / "held"
    held.mkdir()
    for name in ("red_circle.png", "red_circle.txt"):
        shutil.copy(images / name, held / name)
    return f'\n[validation]\npath = "{held.as_posix()}"\n'


def losses(out: Path) -> list[float]:
    return [json.loads(r)["loss"] for r in (out / "metrics.jsonl").read_text().splitlines()]


def assert_close_runs(a: Path, b: Path) -> None:
    """Same losses (relative 1e-5) and LoRA weights (0.1 x lr) of two runs' output folders."""
    assert losses(a) == pytest.approx(losses(b), rel=1e-5)
    la, lb = load_file(str(a / "lora.safetensors")), load_file(str(b / "lora.safetensors"))
    assert la.keys() == lb.keys()
    assert max(float((la[k] - lb[k]).abs().max()) for k in la) <= 0.1 * LR


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory, images: Path) -> Path:
    """A 4-step run with 2 processes of batch 1 through accelerate launch, disk caches."""
    folder = tmp_path_factory.mktemp("two")
    cfg = run_toml(folder, images, steps=4)
    done = launch(["-m", "difftune", "train", str(cfg), "--no-progress", *TWO,
                   "--set", 'cache.latents="disk"', "--set", 'cache.text="disk"'])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "LoRA written to" in done.stdout and done.stdout.count("LoRA written to") == 1
    return folder / "out"


# Default-run cover: contract/test_training_paths.py (qwen_image), test_fsdp.py, test_multinode.py.
@pytest.mark.full_only
def test_two_processes_match_one_with_the_same_global_batch(tmp_path: Path, images: Path,
                                                            two: Path) -> None:
    one = run_toml(tmp_path, images, steps=4)  # one process, batch 2, memory caches
    assert main(["train", str(one), "--no-progress"]) == 0
    assert_close_runs(two, tmp_path / "out")



def five_images(tmp_path: Path, images: Path) -> Path:
    """The bundled images less one (and its caption): five, so a global batch of 2 ends with a
    batch of 1 that leaves one of two processes without a row."""
    five = tmp_path / "five"
    five.mkdir()
    for path in sorted(images.iterdir())[2:]:
        shutil.copy(path, five / path.name)
    assert len(list(five.glob("*.png"))) == 5
    return five

@pytest.mark.full_only
def test_a_short_batch_leaving_one_process_empty_still_matches(tmp_path: Path,
                                                               images: Path) -> None:
    five = five_images(tmp_path, images)  # global batch 2: batches of 2, 2 and 1
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    one = run_toml(tmp_path / "one", five, steps=4)
    assert main(["train", str(one), "--no-progress"]) == 0
    two = run_toml(tmp_path / "two", five, steps=4)
    done = launch(["-m", "difftune", "train", str(two), "--no-progress", *TWO])
    assert done.returncode == 0, done.stderr[-3000:]
    assert_close_runs(tmp_path / "two" / "out", tmp_path / "one" / "out")


@pytest.mark.full_only
def test_text_encoder_lora_and_a_rare_placeholder_match_one_process(tmp_path: Path,
                                                                    images: Path) -> None:
    data = tmp_path / "data"
    shutil.copytree(images, data)
    for caption in sorted(data.glob("*.txt"))[:2]:  # 2 of 6 captions use the placeholder:
        caption.write_text("<sks> " + caption.read_text())  # some batches never touch it
    pivotal = ('[[adapter.embeddings]]\nname = "<sks>"\ntokens = 2\ninit = "a shape"\n\n'
               '[[datasets]]')
    runs = []
    for name in ("one", "two"):
        (tmp_path / name).mkdir()
        cfg = run_toml(tmp_path / name, data, steps=6)
        cfg.write_text(cfg.read_text().replace("[[datasets]]", pivotal, 1)
                       .replace("[adapter]", '[adapter]\ntext_encoders = ["clip_l"]', 1))
        runs.append(cfg)
    assert main(["train", str(runs[0]), "--no-progress"]) == 0
    done = launch(["-m", "difftune", "train", str(runs[1]), "--no-progress", *TWO])
    assert done.returncode == 0, done.stderr[-3000:]
    assert_close_runs(tmp_path / "two" / "out", tmp_path / "one" / "out")
    a = load_file(str(tmp_path / "one" / "out" / "embeddings" / "sks.safetensors"))
    b = load_file(str(tmp_path / "two" / "out" / "embeddings" / "sks.safetensors"))
    assert all(float((a[k] - b[k]).abs().max()) <= 0.1 * LR for k in a)


# Default-run cover: test_multinode.py::test_two_nodes_fill_each_cache_entry_once_and_write_the_run_once
# (and its losses compared row by row with one process's: one metrics row a step).
@pytest.mark.full_only
def test_two_processes_cache_every_entry_once_and_log_from_rank_0(two: Path) -> None:
    latents, text = DiskStore(two / "cache", "latents"), DiskStore(two / "cache", "text")
    assert len(latents) == 6  # 6 images, flip off: each entry once, none missing
    assert len(text) == 6 * 2  # 6 captions x 2 frozen encoders (CLIP-L, T5)
    leftovers = [p for p in (two / "cache").rglob("*") if p.is_file() and ".tmp" in p.name]
    assert leftovers == []
    log = (two / "difftune.log").read_text()
    assert log.count("loading flux model") == 1  # one run log, written by rank 0
    assert "data-parallel run: 2 processes, global batch 2" in log
    steps = [json.loads(r)["step"] for r in (two / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]  # one metrics row per step, not per process


# Default-run cover: test_multinode.py::test_a_lost_node_is_named_and_the_run_resumes_on_one_node
# (the changed global batch refused, then resumed on one process to the same end).
@pytest.mark.full_only
def test_checkpoint_of_two_processes_resumes_with_one(tmp_path: Path, images: Path,
                                                      two: Path) -> None:
    out = tmp_path / "out"
    shutil.copytree(two / "checkpoints" / "step-000002", out / "checkpoints" / "step-000002")
    cfg = run_toml(tmp_path, images, steps=4)
    refused = main(["train", str(cfg), "--no-progress", "--set", "train.batch_size=1",
                    "--resume", "latest"])
    assert refused == 2  # global batch 1 != 2: refused before anything is written
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints"]
    assert main(["train", str(cfg), "--no-progress", "--resume", "latest"]) == 0  # batch 2
    la, lb = load_file(str(two / "lora.safetensors")), load_file(str(out / "lora.safetensors"))
    assert max(float((la[k] - lb[k]).abs().max()) for k in la) <= 0.1 * LR
    assert losses(out) == pytest.approx(losses(two)[2:], rel=1e-5)


@pytest.mark.full_only
def test_num_processes_option_runs_accelerate_launch(tmp_path: Path, images: Path) -> None:
    cfg = run_toml(tmp_path, images, steps=2)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "difftune", "train", str(cfg), "--no-progress",
                           "--num-processes", "2", "--set", "train.batch_size=1"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "global batch 2" in (tmp_path / "out" / "difftune.log").read_text()
    assert (tmp_path / "out" / "lora.safetensors").is_file()


def test_a_failing_rank_stops_the_run_with_its_error(tmp_path: Path, images: Path) -> None:
    cfg = run_toml(tmp_path, images, steps=6)
    started = time.monotonic()
    done = launch([str(ROOT / "tests" / "e2e" / "failing_rank.py"), "train", str(cfg),
                   "--no-progress", "--set", "train.batch_size=1"], timeout=180)
    assert done.returncode != 0
    assert time.monotonic() - started < 120  # stopped, not hung until a timeout
    assert "[rank 1] error: rank one could not read its batch" in done.stderr
    assert "[rank 0] stopped: a collective with the other processes failed" in done.stderr
    assert "[rank 0] internal error" not in done.stderr
    assert not (tmp_path / "out" / "lora.safetensors").exists()


def test_check_refuses_a_multi_process_launch(tmp_path: Path, images: Path,
                                              monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["check", str(run_toml(tmp_path, images))]) == 2
    assert "runs in one process" in capsys.readouterr().err
    assert not torch.distributed.is_initialized()


# Default-run cover: the two sample-event stops below (the stop reaches the other process
# through the same exchange after the step: "another process ... asked to stop", the resume line).
@pytest.mark.full_only
def test_a_stop_signal_to_one_process_stops_all_after_the_same_step(tmp_path: Path,
                                                                   images: Path) -> None:
    cfg = run_toml(tmp_path, images, steps=200)
    stop_one_process(cfg, tmp_path / "out", ["--set", "train.batch_size=1"])


def stop_one_process(cfg: Path, out: Path, sets: list[str]) -> None:
    """Train `cfg` (at least 100 steps) with `--num-processes 2` and `sets`, SIGTERM rank 1
    after 3 steps, and check that both stopped after the same step with one checkpoint."""
    import psutil

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "difftune", "train", str(cfg), "--no-progress",
                             "--num-processes", "2", *sets],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 180
    try:
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
        workers = psutil.Process(proc.pid).children(recursive=True)
        rank1 = [w for w in workers if w.environ().get("RANK") == "1"]
        assert len(rank1) == 1
        rank1[0].send_signal(signal.SIGTERM)  # a scheduler preempting one process
        stdout, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
    assert proc.returncode == 0, err[-3000:]
    saved = sorted((out / "checkpoints").iterdir())
    assert len(saved) == 1 and f"checkpoint saved to {saved[0]}" in stdout
    assert "--num-processes 2 --resume latest" in stdout
    assert "another process of this run was asked to stop" in err
    assert not (out / "lora.safetensors").exists()  # stopped long before the last step


def _stopped_in_a_sample_event(tmp_path: Path, images: Path, launcher: list[str],
                               target: Callable[[subprocess.Popen], int],
                               extra: tuple[str, ...] = ()) -> tuple[str, str]:
    """Start `launcher + ["train", cfg, ...] + extra` (two processes, eight images to sample at
    step 2), send SIGTERM to `target(proc)` once the event's first image is written, and check
    that the run stopped after at most one image more (it rendered all eight, then trained a
    step more, before), saved a checkpoint of step 2 and no final LoRA, and exited 0; returns
    its (stdout, stderr)."""
    prompts = tmp_path / "many.txt"
    prompts.write_text("".join(f"prompt {i} --w 64 --h 64 --s 30\n" for i in range(8)))
    cfg = run_toml(tmp_path, images, prompts=prompts, steps=6)
    env = {**os.environ, "PYTHONPATH": str(ROOT),
           "DIFFTUNE_TEST_PID_FILE": str(tmp_path / "rank1.pid")}
    proc = subprocess.Popen([*launcher, "train", str(cfg), "--no-progress", "--set",
                             "train.batch_size=1", "--set", "sample.at_start=false", *extra],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    samples, deadline = tmp_path / "out" / "samples", time.monotonic() + 180
    while not list(samples.glob("step-000002_00_*.png")):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    os.kill(target(proc), signal.SIGTERM)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err[-3000:]
    assert len(list(samples.glob("step-000002_0*.png"))) <= 3, err[-3000:]
    assert "stopped after step 2" in out, out
    assert sorted(p.name for p in (tmp_path / "out" / "checkpoints").iterdir()) == \
        ["step-000002"]
    assert not (tmp_path / "out" / "lora.safetensors").exists()
    return out, err


def test_a_stop_signal_to_another_process_ends_a_sample_event_early(tmp_path: Path,
                                                                   images: Path) -> None:
    """SIGTERM to rank 1 (a scheduler preempting one process) while rank 0 samples."""
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
                "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
                "--dynamo_backend", "no", "--main_process_port", "0",
                str(ROOT / "tests" / "e2e" / "stopping_rank.py")]
    _, err = _stopped_in_a_sample_event(tmp_path, images, launcher,
                                        lambda proc: int((tmp_path / "rank1.pid").read_text()))
    assert "another process of this run was asked to stop" in err  # rank 0 learnt it


def test_a_stop_signal_to_the_command_stops_every_process(tmp_path: Path, images: Path) -> None:
    """SIGTERM to `difftune train --num-processes 2` itself (the web app's Stop): it died
    alone, and the training processes trained on to the end."""
    out, _ = _stopped_in_a_sample_event(tmp_path, images, [sys.executable, "-m", "difftune"],
                                        lambda proc: proc.pid, ("--num-processes", "2"))
    assert "--num-processes 2 --resume latest" in out


def test_cache_verb_with_two_processes_fills_once_and_reports_once(tmp_path: Path,
                                                                   images: Path) -> None:
    cfg = run_toml(tmp_path, images, extra='\n[cache]\nlatents = "disk"\ntext = "disk"\n')
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "difftune", "cache", str(cfg), "--no-progress",
                           "--num-processes", "2"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("latents: 6 entries") == 1  # rank 0 reports
    assert done.stdout.count("text: 12 entries") == 1
    # Then trains from the cache: its cache pass looks up every entry before the first step,
    # so one step shows what more would.
    assert main(["train", str(cfg), "--no-progress", "--set", "train.steps=1"]) == 0
