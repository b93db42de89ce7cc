"""`difftune sweep` end to end on the tiny flavor: a 4-trial grid over the learning rate whose
diverging trial (lr 30) is pruned on its validation loss, the sweep process killed mid-study,
run again and stopped (SIGTERM) during its last trial, and run a third time to finish it,
every trial folder an ordinary run the compare page lists; and a space
naming an unknown field, a refused value or an empty range refused with exit 2 up front."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from difftune.cli import main
from tests.e2e.conftest import run_toml

VALIDATION = ("\n[validation]\nenabled = true\nfraction = 0.34\nevery_n_steps = 1\n"
              "timesteps = 2\n")


def _space(folder: Path, space: str, sweep: str = "trials = 4\nsampler = \"grid\"") -> Path:
    path = folder / "space.toml"
    path.write_text(f"[sweep]\n{sweep}\n[space]\n{textwrap.dedent(space)}", encoding="utf-8")
    return path


@pytest.fixture()
def root(tmp_path: Path, images: Path) -> Path:
    shutil.copytree(images, tmp_path / "data")
    run_toml(tmp_path, tmp_path / "data", VALIDATION, steps=6)  # its sweep folder: out/
    return tmp_path


def _sweep_process(root: Path, space: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "difftune", "sweep", "run.toml", "--space",
                             str(space)], cwd=root, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


def test_sweep_prunes_resumes_after_a_kill_and_leaves_ordinary_runs(root: Path) -> None:
    import optuna

    space = _space(root, '"train.lr" = { choices = [3e-3, 1e-2, 30.0, 2e-2] }')
    proc = _sweep_process(root, space)
    deadline = time.monotonic() + 120
    while not (root / "out" / "trial-001" / "metrics.jsonl").is_file():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)  # the sweep dies; trial 1's job lives on
    proc.wait()
    # Run again, and stop it (SIGTERM, as Ctrl-C) once the last trial trains: its job is
    # stopped cleanly and the sweep exits 130.
    proc = _sweep_process(root, space)
    while not (root / "out" / "trial-003" / "metrics.jsonl").is_file():
        assert proc.poll() is None and time.monotonic() < deadline + 240
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 130
    # Stopped cleanly: the trial's run saved a checkpoint to resume from.
    assert list((root / "out" / "trial-003" / "checkpoints").glob("step-*"))
    assert main(["sweep", str(root / "run.toml"), "--space", str(space), "--root",
                 str(root)]) == 0
    study = optuna.load_study(study_name="lora", storage=f"sqlite:///{root}/out/study.db")
    states = {t.params["train.lr"]: t.state.name for t in study.trials}
    assert states == {3e-3: "COMPLETE", 1e-2: "COMPLETE", 30.0: "PRUNED", 2e-2: "COMPLETE"}
    rows = json.loads((root / "out" / "sweep.json").read_text())["trials"]
    assert [r["trial"] for r in rows] == [0, 1, 2, 3]
    for r in rows:
        run = Path(r["run_dir"])
        assert (run / "config.resolved.json").is_file()
        if r["state"] == "complete":
            assert (run / "lora.safetensors").is_file() and Path(r["best_file"]).is_file()
            assert r["value"] == json.loads((run / "best.json").read_text())["best"]
    # Pruned on its validation loss as Optuna's median pruner decided from the reported steps
    # (how many steps its job ran before the stop arrived depends on the machine's speed).
    diverged = next(t for t in study.trials if t.params["train.lr"] == 30.0)
    assert diverged.intermediate_values
    from difftune.ui.runs import find_runs
    from difftune.ui.security import Roots

    listed = {Path(r.path).name for r in find_runs(Roots.of([root]))}
    assert {"trial-000", "trial-001", "trial-002", "trial-003"} <= listed


@pytest.mark.parametrize(("space", "said"), [
    ('"train.lrr" = { choices = [1e-3] }', "train.lrr"),
    ('"adapter.rank" = { choices = [8, 0] }', "adapter.rank = 0"),
    ('"train.lr" = { low = 1e-2, high = 1e-3 }', "the range is empty"),
    ('"train.lr" = { low = 1e-4, high = 1e-2 }', "needs a finite set for train.lr"),
    ('"train.lr" = { choices = [1e-3] }\n[sweep.x]', "sweep.x"),
])
def test_a_bad_space_exits_2_before_any_trial(root: Path, space: str, said: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    path = _space(root, space)
    assert main(["sweep", str(root / "run.toml"), "--space", str(path), "--root",
                 str(root)]) == 2
    assert said in capsys.readouterr().err
    assert not (root / "out").exists() and not (root / ".difftune-ui").exists()


def test_a_run_file_outside_the_root_exits_2(root: Path, tmp_path_factory: pytest.TempPathFactory,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    path = _space(root, '"train.lr" = { choices = [1e-3] }')
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    assert main(["sweep", str(root / "run.toml"), "--space", str(path), "--root",
                 str(elsewhere)]) == 2
    assert "--root" in capsys.readouterr().err
