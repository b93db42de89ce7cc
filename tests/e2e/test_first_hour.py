"""What a new user meets in the first hour, through the real CLI: unknown keys answered with the
key meant, a prompt file with nothing to sample refused by `check`, Ctrl-C on the demo."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from difftune.cli import main

from .conftest import run_toml


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """`python -m difftune ARGS` in a fresh process."""
    return subprocess.run([sys.executable, "-m", "difftune", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_unknown_keys_get_did_you_mean(tmp_path: Path, images: Path) -> None:
    cfg = run_toml(tmp_path, images)
    text = cfg.read_text().replace("[train]\n", "[train]\nlearning_rate = 1e-4\nstpes = 3\n"
                                   "rank = 8\n", 1)
    cfg.write_text(text.replace("resolution = 64", "resolution = 64\nrepaets = 2")
                   + "\n[trian]\nsteps = 3\n")
    proc = _cli("check", str(cfg))
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr
    assert "Traceback" not in err
    # One error listing every problem, each with the key most likely meant.
    assert "5 problem(s)" in err
    assert "train.learning_rate: Extra inputs are not permitted — unknown key: did you mean " \
           "train.lr?" in err
    assert "train.stpes" in err and "did you mean train.steps?" in err
    assert "train.rank" in err and "did you mean adapter.rank?" in err
    assert "datasets[0].repaets" in err and "did you mean datasets[0].repeats?" in err
    assert "trian:" in err and "did you mean [train]?" in err


@pytest.mark.parametrize("content", ["", "# only a comment\n\n", "a prompt --w nope\n"])
def test_check_refuses_a_prompt_file_with_nothing_to_sample(
        tmp_path: Path, images: Path, content: str, capsys: pytest.CaptureFixture[str]) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(content, encoding="utf-8")
    assert main(["check", str(run_toml(tmp_path, images, prompts=prompts))]) == 2
    captured = capsys.readouterr()
    assert "check passed" not in captured.out
    assert "sample.prompts" in captured.err and str(prompts) in captured.err
    assert "no usable prompt" in captured.err


def test_interrupted_demo_is_not_an_internal_error(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    proc = subprocess.Popen([sys.executable, "-m", "difftune", "demo", "--out", str(out),
                             "--steps", "2000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 240
    while not (out / "metrics.jsonl").is_file() and time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 130, stderr
    assert "interrupted after step" in stderr and str(out) in stderr
    assert "internal error" not in stderr and "Traceback" not in stderr
    # Nothing left as if the demo had finished: no final LoRA, no figures, no report.
    for name in ("demo-lora.safetensors", "before_after.png", "loss.png"):
        assert not (out / name).exists(), name
    assert "LoRA:" not in stdout
