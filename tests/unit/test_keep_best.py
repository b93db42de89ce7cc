"""`save.keep_best` expressions: parsed with ast and walked (never eval), their direction,
their value, and what they need from the rest of the config."""

from __future__ import annotations

from pathlib import Path

import pytest

from difftune.config.keep_best import Measure
from difftune.errors import ConfigError


def test_a_weighted_combination_is_evaluated_by_walking_the_tree() -> None:
    m = Measure("0.7*fidelity + 0.3*clip_score/100")
    assert m.names == {"fidelity", "clip_score"} and m.higher
    assert m.value({"fidelity": 0.5, "clip_score": 20.0}) == pytest.approx(0.41)
    assert Measure("-(val_loss)").value({"val_loss": 2.0}) == -2.0
    assert not Measure("val_loss").higher and not Measure("nearest_similarity").higher


@pytest.mark.parametrize(("text", "why"), [
    ("__import__('os').system('true')", "is not allowed"),
    ("fidelity.real", "is not allowed"),
    ("fidelity > 0.5", "is not allowed"),
    ("'fidelity'", "is not allowed"),
    ("fidelty", "unknown metric 'fidelty'"),
    ("0.7*fidelity +", "is not an expression"),
    ("fidelity - val_loss", "keep_best_mode"),
])
def test_anything_but_arithmetic_of_known_metrics_is_refused(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        Measure(text)


def test_a_mixed_expression_takes_the_mode_given() -> None:
    assert Measure("fidelity - val_loss", "max").higher
    assert not Measure("fidelity", "min").higher


def _load(tmp_path: Path, extra: str) -> object:
    from difftune.config import load_config
    from tests.unit.test_config import GOOD, write

    return load_config(write(tmp_path, GOOD.replace('dir = "out"', 'dir = "out"\n' + extra)))


def test_config_names_what_a_keep_best_metric_needs(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"save.keep_best = 'fidelity' reads fidelity: set "
                                          r"metrics.enabled"):
        _load(tmp_path, 'keep_best = "fidelity"')
    with pytest.raises(ConfigError, match=r"save.keep_best: unknown metric 'loss'"):
        _load(tmp_path, 'keep_best = "loss"')
    with pytest.raises(ConfigError, match="validation.keep_best and save.keep_best"):
        _load(tmp_path, 'keep_best = "val_loss"\n[validation]\nkeep_best = true')
    assert _load(tmp_path, 'keep_best = "val_loss"').save.keep_best == "val_loss"


def test_a_step_whose_metrics_were_skipped_loses_its_candidate_and_is_never_compared(
        tmp_path: Path) -> None:
    """Measuring fell behind and skipped step 20: its candidate LoRA is deleted at once (not
    left on disk until the run ends) and the best is chosen among the measured steps."""
    from difftune.train.best import CANDIDATES, BestKeeper

    keeper = BestKeeper(Measure("fidelity"), tmp_path, "lora", None)

    def save(step: int, path: Path) -> Path:
        path.write_bytes(b"lora of step %d" % step)
        return path

    for step in (10, 20, 30):
        keeper.candidate(step, save)
    keeper.skipped(20)
    assert sorted(p.name for p in (tmp_path / CANDIDATES).iterdir()) == [
        "step-000010.safetensors", "step-000030.safetensors"]
    keeper.record(10, {"fidelity": 0.5})
    keeper.record(30, {"fidelity": 0.4})
    assert keeper.best_step() == 10 and set(keeper.scores) == {10, 30}
    assert (tmp_path / "lora-best.safetensors").read_bytes() == b"lora of step 10"
