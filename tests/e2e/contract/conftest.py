"""Shared runs of the contract suite: one sampled tiny run per family, trained once a session.

A family's sample-prompt file is its own (below) where its suite always sampled with one; a new
family gets a one-prompt file at its bucket size, so it joins the contract with no entry here."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest

from difftune import families

from ..conftest import train_cli

# family -> (sample-prompt file text, the slugs its samples are named by, in prompt order)
SAMPLE_PROMPTS: dict[str, tuple[str, list[str]]] = {
    "flux": ("a red circle on a blue background --w 32 --h 32 --s 2 --d 1\n"
             "a pink ring --w 32 --h 48 --s 2 --d 2 --g 2.0\n",
             ["a-red-circle-on-a-blue-background", "a-pink-ring"]),
    # one prompt with a negative prompt and CFG 4 (so the negative is used)
    "sd3": ("a red circle --w 32 --h 32 --s 2 --l 4 --n blurry\n", ["a-red-circle"]),
    # one prompt with a negative prompt and CFG 5, one with the family's default CFG
    "sdxl": ("a red circle --n blurry --w 64 --h 64 --s 2 --d 1 --l 5\n"
             "a pink ring --w 64 --h 64 --s 2 --d 2\n", ["a-red-circle", "a-pink-ring"]),
    # CFG 4 with a negative prompt (the pipeline's guidance_scale 3), and the default (no CFG)
    "z_image": ("a red circle --n blurry --w 32 --h 48 --s 2 --l 4\n"
                "a pink ring --w 32 --h 32 --s 2 --d 2\n", ["a-red-circle", "a-pink-ring"]),
}


def sample_prompts(family: str) -> tuple[str, list[str]]:
    """`family`'s sample-prompt file text and sample slugs (a default one at its bucket size)."""
    step = families.get(family).bucket_step
    default = (f"a red circle --n blurry --w {step} --h {step} --s 2\n", ["a-red-circle"])
    return SAMPLE_PROMPTS.get(family, default)


@pytest.fixture(scope="session")
def family_prompts(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """`family` -> the path of its sample-prompt file."""
    def write(family: str) -> Path:
        path = tmp_path_factory.mktemp(f"{family}_prompts") / "prompts.txt"
        path.write_text(sample_prompts(family)[0], encoding="utf-8")
        return path
    return write


@pytest.fixture(scope="session")
def trained(tmp_path_factory: pytest.TempPathFactory, images: Path,
            family_prompts: Callable[[str], Path]) -> Callable[[str], Path]:
    """`family` -> the output folder of its reference run (trained on first use).

    4 steps, rank 4 alpha 8, seed 3, diffusers layout, sampled at the start, every 2 steps and at
    the end, an intermediate save at step 2."""
    runs: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in runs:
            runs[family] = train_cli(tmp_path_factory.mktemp(f"{family}_run"), images,
                                     "save.every_n_steps=2", family=family,
                                     prompts=family_prompts(family))
        return runs[family]
    return get
