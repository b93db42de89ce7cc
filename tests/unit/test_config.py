"""Config validation: unknown keys, all problems at once, dotted names, overrides, conflicts."""

from __future__ import annotations

from pathlib import Path

import pytest

from difftune.config import load_config
from difftune.errors import ConfigError

GOOD = """
[model]
flavor = "tiny"

[[datasets]]
path = "images"
resolution = 64
min_side = 32
max_side = 128

[train]
steps = 10

[save]
dir = "out"
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_valid_config_resolves_relative_paths(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, GOOD))
    assert cfg.datasets[0].subsets[0].path == (tmp_path / "images").resolve()
    assert cfg.save.dir == (tmp_path / "out").resolve()
    assert cfg.adapter.scale_alpha == cfg.adapter.rank


def test_every_problem_reported_at_once_with_dotted_fields(tmp_path: Path) -> None:
    text = GOOD.replace("steps = 10", "steps = 0\nlr = -1\ntimesteps = \"nope\"\nbogus = 1")
    text = text.replace('path = "images"', 'path = "images"\nrepeats = 0\nflipp = true')
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text))
    msg = str(err.value)
    for field in ("train.steps", "train.lr", "train.timesteps", "train.bogus",
                  "datasets[0].subsets[0].repeats", "datasets[0].flipp"):
        assert field in msg, (field, msg)
    assert "unknown key" in msg
    assert "'uniform', 'sigmoid', 'shift' or 'flux_shift'" in msg


def test_unknown_section_rejected(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="optimiser"):
        load_config(write(tmp_path, GOOD + "\n[optimiser]\nlr = 1\n"))


def test_missing_model_source_names_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match='flavor = "tiny", or path'):
        load_config(write(tmp_path, GOOD.replace('flavor = "tiny"', "")))


def test_tiny_with_files_is_a_conflict(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="needs no files"):
        load_config(write(tmp_path, GOOD.replace('flavor = "tiny"', 'flavor = "tiny"\nvae = "ae.safetensors"')))


def test_cross_field_conflicts_caught_at_load(tmp_path: Path) -> None:
    text = GOOD + '\n[precision]\ndenoiser = "bf16"\n'
    text = text.replace("[save]", "[save]\nevery_n_steps = 50")
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text))
    assert "precision.mixed" in str(err.value)
    assert "save.every_n_steps (50) is larger than train.steps (10)" in str(err.value)


def test_sampling_scheduled_without_prompts(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="sample.*prompts"):
        load_config(write(tmp_path, GOOD + "\n[sample]\nevery_n_steps = 5\n"))


def test_resolution_outside_sides(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"datasets\[0\].*resolution \(64\) must lie between"):
        load_config(write(tmp_path, GOOD.replace("min_side = 32", "min_side = 96")))


def test_overrides_apply_with_types(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, GOOD), ["train.lr=2e-4", "train.steps=5",
                                              "datasets.0.repeats=3", "save.format=\"kohya\"",
                                              "train.gradient_checkpointing=true"])
    assert cfg.train.lr == 2e-4 and cfg.train.steps == 5
    assert cfg.datasets[0].subsets[0].repeats == 3
    assert cfg.save.format == "kohya" and cfg.train.gradient_checkpointing is True


def test_bad_overrides(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD)
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        load_config(path, ["train.lr"])
    with pytest.raises(ConfigError, match="index from 0 to 0"):
        load_config(path, ["datasets.3.repeats=2"])
    with pytest.raises(ConfigError, match="train.lr"):
        load_config(path, ["train.lr=fast"])


def test_bad_toml_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "[model\n"))
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")


def test_objective_options_are_never_silently_ignored(tmp_path: Path) -> None:
    text = GOOD.replace("steps = 10", "steps = 10\nnoise_offset = 0.1\nmin_snr_gamma = 5")
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text))
    assert 'train.noise_offset does not apply to model.family = "flux"' in str(err.value)
    assert "train.min_snr_gamma does not apply" in str(err.value)


def test_zero_terminal_snr_needs_v_prediction(tmp_path: Path) -> None:
    text = GOOD.replace("steps = 10", 'steps = 10\nzero_terminal_snr = true\nprediction = "epsilon"')
    with pytest.raises(ConfigError, match="zero_terminal_snr needs prediction"):
        load_config(write(tmp_path, text))
