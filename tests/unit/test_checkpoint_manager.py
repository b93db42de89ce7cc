"""The checkpoint manager: identity refusals, pruning, and the training state's round trip."""

from __future__ import annotations

import random
import shutil
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from difftune.config import RunConfig, load_config
from difftune.errors import CheckpointError
from difftune.verbs.demo import demo_dir
from difftune.train.checkpoint import CheckpointManager
from difftune.train.checkpoint.files import complete_checkpoints, read
from difftune.train.loop import build_state
from difftune.train.setup import Run, prepare
from difftune.train.state import TrainState


def _config(folder: Path, *sets: str) -> RunConfig:
    """A tiny-flavor run on the demo images, saving into `folder / "out"`."""
    images = folder / "images"
    if not images.exists():
        images.mkdir()
        for path in demo_dir().iterdir():
            if path.suffix in (".png", ".txt") and path.name != "prompts.txt":
                shutil.copy(path, images / path.name)
    text = textwrap.dedent(f"""
        [model]
        flavor = "tiny"
        [adapter]
        rank = 4
        alpha = 8
        targets = "all_linear"
        [[datasets]]
        path = "{images.as_posix()}"
        resolution = 64
        min_side = 32
        max_side = 128
        [train]
        steps = 10
        batch_size = 2
        seed = 3
        device = "cpu"
        [save]
        dir = "{(folder / 'out').as_posix()}"
        dtype = "fp32"
        keep_last = 2
        """)
    path = folder / "run.toml"
    path.write_text(text, encoding="utf-8")
    return load_config(path, list(sets))


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return prepare(_config(tmp_path_factory.mktemp("manager")), show_progress=False)


@pytest.fixture
def loaded(prepared: Run, tmp_path: Path) -> tuple[Run, CheckpointManager]:
    """The prepared run and a manager saving into this test's own folder."""
    cfg = prepared.cfg.model_copy(deep=True)
    cfg.save.dir = tmp_path / "out"
    return prepared, CheckpointManager(cfg, prepared.family, prepared.comps, prepared.targets, {})


def _advance(state: TrainState) -> None:
    """Move every part of the state away from where a fresh one starts."""
    batches = state.sampler.batches()
    for _ in range(5):  # past the first epoch's 3 batches
        next(batches)
    for loss in (float("nan"), 1.0, float("nan"), float("inf")):
        state.guard.skip(1, loss)
    torch.rand(3, generator=state.generator)
    random.random()
    np.random.rand()
    torch.rand(1)
    state.step = 5


def _draws(state: TrainState) -> list[object]:
    """The next values of every RNG the state covers."""
    return [torch.rand(4, generator=state.generator).tolist(), random.random(),
            float(np.random.rand()), torch.rand(2).tolist()]


def _position(state: TrainState) -> tuple[object, ...]:
    """Step, sampler position, guard counters and the next batch (which it then consumes)."""
    return (state.step, state.sampler.epoch, state.sampler.position, state.guard.state_dict(),
            next(state.sampler.batches()))


def test_pruning_keeps_the_newest(loaded: tuple[Run, CheckpointManager]) -> None:
    run, manager = loaded
    state = build_state(run, manager.names())
    for step in (1, 2, 3, 4):
        state.step = step
        assert manager.save(state).name == f"step-{step:06d}"
    found = complete_checkpoints(manager.out / "checkpoints")
    assert [p.name for p in found] == ["step-000003", "step-000004"]


def test_identity_mismatch_is_refused(loaded: tuple[Run, CheckpointManager],
                                      tmp_path: Path) -> None:
    run, manager = loaded
    state = build_state(run, manager.names())
    state.step = 1
    manager.save(state)
    other = _config(tmp_path, "adapter.rank=8")
    other.save.dir = manager.out
    with pytest.raises(CheckpointError) as err:
        CheckpointManager.open(other, "latest")
    assert str(err.value) == (
        f"cannot resume from {manager.out / 'checkpoints' / 'step-000001'}: the adapter "
        "differs (rank: checkpoint 4, config 8). Resume with the checkpoint's settings, or "
        "start a new run (--init-lora keeps its weights)")
    ckpt = CheckpointManager.open(manager.cfg, "latest")  # the same config resumes
    fewer = CheckpointManager(manager.cfg, run.family, run.comps, run.targets[:1], {})
    with pytest.raises(CheckpointError, match=r"the adapter differs \(targets: checkpoint"):
        fewer.check_compatible(ckpt)
    manager.check_compatible(ckpt)


def test_state_round_trip(loaded: tuple[Run, CheckpointManager]) -> None:
    run, manager = loaded
    state = build_state(run, manager.names())
    _advance(state)
    saved = state.state_dict()
    expected_position = _position(state)
    expected = _draws(state)
    fresh = build_state(run, manager.names())
    fresh.load_state_dict(saved)
    assert _position(fresh) == expected_position
    assert fresh.guard.state_dict() == {"in_row": 2, "skipped": 3, "overflow": 0, "scale": -1.0}
    assert _draws(fresh) == expected


def test_state_round_trip_through_files(loaded: tuple[Run, CheckpointManager]) -> None:
    run, manager = loaded
    state = build_state(run, manager.names())
    _advance(state)
    path = manager.save(state)
    expected_position = _position(state)
    expected = _draws(state)
    fresh = build_state(run, manager.names())
    manager.load(read(path), fresh)
    assert _position(fresh) == expected_position
    assert _draws(fresh) == expected
