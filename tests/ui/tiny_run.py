"""One real tiny training run, made once per test process and shared by the UI tests that read
run folders (the readers, their API, the compare page).

The packaged demo (tiny FLUX.1, six 64x64 images) trains 4 steps with validation every 2 steps
(so rows carry val_loss), a LoRA and checkpoint saved at step 2, and samples of two prompts at
steps 0 and 4.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

STEPS = 4
_made: dict[str, Path] = {}


PROMPTS = ("A red circle, on a blue background!", "a yellow square on a green background")


def _config(out: Path) -> object:
    """The demo's config, shortened: 4 steps, saves and validation every 2, two prompts (the
    first with capitals and punctuation, which sample file names drop)."""
    from difftune.config import parse_config
    from difftune.verbs.demo import demo_config_path

    path = demo_config_path()
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    data["save"] |= {"dir": str(out), "every_n_steps": 2}
    data["train"] |= {"steps": STEPS, "warmup_steps": 0}
    prompts = out.parent / "prompts.txt"
    prompts.write_text("".join(f"{p} --w 64 --h 64 --s 2 --d 1\n" for p in PROMPTS))
    data["sample"] |= {"every_n_steps": STEPS, "prompts": str(prompts)}
    data["validation"] = {"enabled": True, "every_n_steps": 2, "timesteps": 1}
    return parse_config(data, path.parent, "tiny ui run")


def make(factory: pytest.TempPathFactory) -> Path:
    """The run folder (trained on the first call of the process, then reused)."""
    if "run" not in _made:
        from difftune.verbs.train import run_train

        out = factory.mktemp("ui-runs") / "tiny-run"
        run_train(_config(out), show_progress=False)
        _made["run"] = out
    return _made["run"]
