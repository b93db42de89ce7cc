"""Fixtures for end-to-end runs through the real CLI on the tiny flavor."""

from __future__ import annotations

import inspect
import itertools
import json
import shutil
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Hashable

import pytest
import torch
from safetensors import safe_open

from difftune import families
from difftune.cli import main
from difftune.config import ModelConfig, PrecisionConfig
from difftune.verbs.demo import demo_dir
from difftune.precision.policy import PrecisionPolicy

if TYPE_CHECKING:
    from diffusers import DiffusionPipeline

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
             prompts: Path | None = None, fmt: str | None = "diffusers",
             family: str | None = None, model: str = 'flavor = "tiny"') -> Path:
    """Write a small tiny-flavor run file into `folder` (made if missing); its path.

    `family` adds `model.family` (the default family otherwise); `model` is the model source
    line (the tiny flavor, or e.g. a `path = ...` to a saved folder); `fmt` None leaves
    save.format out (the family's default format)."""
    source = (f'family = "{family}"\n' if family else "") + model
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
        """).replace('flavor = "tiny"', source, 1) + sample + extra
    if fmt is None:
        text = text.replace('format = "None"\n', "")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "run.toml"
    path.write_text(text, encoding="utf-8")
    return path


def train_cli(folder: Path, data: Path, *sets: str, **kw: object) -> Path:
    """Train through the real CLI (`run_toml(**kw)` plus `--set` overrides); the output folder."""
    args = ["train", str(run_toml(folder, data, **kw)), "--no-progress"]  # type: ignore[arg-type]
    for s in sets:
        args += ["--set", s]
    assert main(args) == 0
    return folder / "out"


def metrics_rows(out: Path) -> list[dict]:
    """The rows of a run's metrics.jsonl, in order."""
    return [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]


def tiny_pipeline(family: str) -> DiffusionPipeline:
    """A fresh diffusers pipeline of `family`'s tiny flavor with base weights only (default
    precision, CPU), progress bars off."""
    fam = families.get(family)
    policy = PrecisionPolicy.from_config(PrecisionConfig(), torch.device("cpu"))
    pipe = fam.pipeline(fam.load(ModelConfig(family=family, flavor="tiny"), policy))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def pipeline_image(pipe: DiffusionPipeline, prompt: str = "a red circle", size: int = 32,
                   **kw: Any) -> torch.Tensor:
    """A 2-step, seed-0 image from `pipe` (T5 prompts capped at 32 tokens where it has T5; a
    video pipeline's one-frame clip)."""
    params = inspect.signature(pipe.__call__).parameters
    if "max_sequence_length" in params:
        kw.setdefault("max_sequence_length", 32)
    if "num_frames" in params:
        kw.setdefault("num_frames", 1)
    out = pipe(prompt=prompt, height=size, width=size, num_inference_steps=2,
               generator=torch.Generator().manual_seed(0), output_type="pt", **kw)
    return out.images if hasattr(out, "images") else out.frames


def train_exit_code(cfg: Path, *sets: str, extra: list[str] | None = None) -> int:
    """`difftune train cfg --no-progress` with `--set` overrides and `extra` arguments: its code."""
    args = ["train", str(cfg), "--no-progress"] + [a for s in sets for a in ("--set", s)]
    return main(args + (extra or []))


def stopped_and_resumed(a: Path, b: Path, monkeypatch: pytest.MonkeyPatch, stop: int,
                        *sets: str) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """Run config `a` through; run config `b` stopped by SIGINT after step `stop` (the run saves
    a checkpoint and exits cleanly), then resumed from it. Returns both runs' (step, loss)
    rows, for exact-resume tests to compare."""
    import os
    import signal

    from difftune.report.metrics import Reporter

    assert train_exit_code(a, *sets) == 0
    real = Reporter.step

    def reporting(self: Reporter, s: int, *args: object, **kwargs: object) -> None:
        real(self, s, *args, **kwargs)
        if s == stop:
            os.kill(os.getpid(), signal.SIGINT)

    with monkeypatch.context() as mp:
        mp.setattr(Reporter, "step", reporting)
        assert train_exit_code(b, *sets) == 0
    assert train_exit_code(b, *sets, extra=["--resume", "latest"]) == 0
    rows = [[(r["step"], r["loss"]) for r in metrics_rows(cfg.parent / "out")] for cfg in (a, b)]
    return rows[0], rows[1]


def assert_same_lora(a: Path, b: Path) -> None:
    """Two output folders' final LoRA files hold bitwise equal tensors under the same keys."""
    from safetensors.torch import load_file

    wa, wb = (load_file(str(out / "lora.safetensors")) for out in (a, b))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def lora_metadata(path: Path) -> dict[str, str]:
    """A safetensors file's metadata ({} when it has none)."""
    with safe_open(str(path), "pt") as f:
        return dict(f.metadata() or {})


def steps_of(out: Path) -> list[int]:
    """The steps a run's metrics.jsonl records, in order."""
    return [json.loads(r)["step"] for r in (out / "metrics.jsonl").read_text().splitlines()]


def output_files(out: Path, skip: tuple[str, ...] = ("difftune.log",)) -> dict:
    """Every file under `out` (but `skip`) -> its bytes: a snapshot to compare runs by."""
    return {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name not in skip}


def copy_run(cfg: Path, where: Path) -> Path:
    """A copy of a run's folder (run file, out/) whose run file points at the copy."""
    shutil.copytree(cfg.parent, where, dirs_exist_ok=True)
    text = cfg.read_text(encoding="utf-8").replace(cfg.parent.as_posix(), where.as_posix())
    (where / "run.toml").write_text(text, encoding="utf-8")
    return where / "run.toml"


@pytest.fixture(scope="session")
def finished(tmp_path_factory: pytest.TempPathFactory, images: Path) -> Path:
    """A 4-step run with checkpoints after steps 2 and 4 (its run file; outputs in out/).

    Shared read-only: tests work on a `copy_run` of it."""
    folder = tmp_path_factory.mktemp("finished")
    cfg = run_toml(folder, images)
    assert train_exit_code(cfg, "save.every_n_steps=2") == 0
    return cfg


def pairwise(cells: list[tuple], skip: tuple[tuple[int, int], ...] = (),
             ignore: tuple[int, ...] = ()) -> list[tuple]:
    """A covering subset of `cells`: every pair of values of any two axes in some chosen cell
    (so every value of every axis too), but the pairs of the axes `skip` names ((0, 1): the
    first and second axes' pairs need not all appear) and any pair with an axis of `ignore`
    (whose values need not appear at all). An axis left with no pair still has each of its
    values in some chosen cell.

    Greedy and deterministic: repeatedly the first cell (in `cells` order) that covers the most
    pairs (and values) not yet covered; the same cells on every run."""
    size = len(cells[0])
    axes = [a for a in itertools.combinations(range(size), 2)
            if a not in skip and not set(a) & set(ignore)]
    alone = [i for i in range(size) if i not in ignore and not any(i in a for a in axes)]

    def pairs(cell: tuple) -> set[tuple]:
        return ({(i, cell[i], j, cell[j]) for i, j in axes} | {(i, cell[i]) for i in alone})
    todo = set().union(*(pairs(c) for c in cells))
    chosen: list[tuple] = []
    while todo:
        best = max(cells, key=lambda c: len(pairs(c) & todo))
        chosen.append(best)
        todo -= pairs(best)
    return chosen


def representatives(path: Callable[[str], Hashable | None]) -> list[str]:
    """The registered families that stand for a shared code path in the default tier: for each
    distinct value of `path(family)` (what decides the path the test exercises, read from the
    family's spec), the first family in registry order with that value; a family whose `path`
    is None takes none of the test's paths that another suite does not already cover.

    The rule, not a list: a family registered later runs these tests by default only when its
    spec gives a value no earlier family has (a new path), else with `--full`."""
    chosen: dict[Hashable, str] = {}
    for name in families.names():
        key = path(name)
        if key is not None:
            chosen.setdefault(key, name)
    return list(chosen.values())


def family_tier(path: Callable[[str], Hashable | None]) -> list[Any]:
    """Every registered family as a parameter: the `representatives` of `path` in the default
    tier, the others `full_only` (`pytest --full`)."""
    keep = representatives(path)
    return [pytest.param(n, marks=() if n in keep else pytest.mark.full_only)
            for n in families.names()]


def sampled_grid(cells: list[tuple]) -> list[Any]:
    """`cells` as parametrize values for the tiers: the `pairwise` subset runs by default, every
    other cell is `full_only` (runs with `pytest --full`)."""
    keep = pairwise(cells)
    return [c if c in keep else pytest.param(*c, marks=pytest.mark.full_only) for c in cells]
