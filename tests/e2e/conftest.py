"""Fixtures for end-to-end runs through the real CLI on the tiny flavor."""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path
from typing import Callable

import pytest

from difftune.verbs.demo import demo_dir

RunFile = Callable[..., Path]


@pytest.fixture(scope="session")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the bundled demo images and captions (6 captioned 64x64 PNGs)."""
    folder = tmp_path_factory.mktemp("images")
    for path in demo_dir().iterdir():
        if path.suffix in (".png", ".txt") and path.name != "prompts.txt":
            shutil.copy(path, folder / path.name)
    return folder


@pytest.fixture(scope="session")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A two-prompt sample file at the smallest sizes."""
    path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    path.write_text("a red circle on a blue background --w 32 --h 32 --s 2 --d 1\n"
                    "a pink ring --w 32 --h 48 --s 2 --d 2 --g 2.0\n", encoding="utf-8")
    return path


def run_toml(folder: Path, data: Path, extra: str = "", steps: int = 4,
             prompts: Path | None = None, fmt: str = "diffusers") -> Path:
    """Write a small tiny-flavor run file into `folder` and return its path."""
    sample = (f'[sample]\nprompts = "{prompts.as_posix()}"\nevery_n_steps = 2\nat_start = true\n'
              if prompts else "[sample]\nat_end = false\n")
    text = textwrap.dedent(f"""
        [model]
        flavor = "tiny"

        [adapter]
        rank = 4
        alpha = 8
        targets = "all_linear"

        [[datasets]]
        path = "{data.as_posix()}"
        resolution = 64
        min_side = 32
        max_side = 128

        [train]
        steps = {steps}
        batch_size = 2
        lr = 1e-2
        seed = 3
        device = "cpu"

        [save]
        dir = "{(folder / 'out').as_posix()}"
        format = "{fmt}"
        dtype = "fp32"
        """) + sample + extra
    path = folder / "run.toml"
    path.write_text(text, encoding="utf-8")
    return path
