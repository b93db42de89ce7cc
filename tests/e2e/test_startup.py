"""Start-up: a config mistake is reported before torch and the model libraries are imported
(so in well under a second, not after seconds of imports), by every verb that reads a config."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import run_toml

HEAVY = ("torch", "diffusers", "transformers", "peft", "accelerate", "lycoris")


def _imported(importtime: str) -> set[str]:
    """The top-level modules a `python -X importtime` run imported (from its stderr)."""
    found = re.findall(r"^import time:\s+\d+ \|\s+\d+ \|\s*([\w.]+)\s*$", importtime, re.M)
    return {name.split(".")[0] for name in found}


@pytest.mark.parametrize(("verb", "args"), [("check", []), ("train", []), ("cache", []),
                                            ("sample", []), ("train", ["--num-processes", "2"])])
def test_config_mistake_before_heavy_imports(tmp_path: Path, images: Path, verb: str,
                                             args: list[str]) -> None:
    cfg = run_toml(tmp_path, images)
    cfg.write_text(cfg.read_text().replace("[train]\n", "[train]\nlearning_rate = 1e-4\n", 1))
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "difftune", verb,
                           str(cfg), *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "did you mean train.lr?" in proc.stderr
    imported = _imported(proc.stderr)
    assert "difftune" in imported  # the parse saw the run's own imports
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))


def test_missing_model_file_before_heavy_imports(tmp_path: Path, images: Path) -> None:
    missing = tmp_path / "nowhere" / "flux1-dev.safetensors"
    cfg = run_toml(tmp_path, images, model="\n".join(
        f'{key} = "{missing.as_posix()}"' for key in ("transformer", "vae", "clip_l", "t5")))
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "difftune", "check",
                           str(cfg)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "model.transformer" in proc.stderr and "does not exist" in proc.stderr
    assert not _imported(proc.stderr) & set(HEAVY)
