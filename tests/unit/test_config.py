"""Config validation: unknown keys, all problems at once, dotted names, overrides, conflicts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from difftune.config import load_config, parse_config
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
    edit = GOOD.replace('flavor = "tiny"', 'flavor = "tiny"\nfamily = "flux2"')
    edit = edit.replace('path = "images"', 'path = "images"\ncontrol_path = ["refs", "/abs"]')
    subset = load_config(write(tmp_path, edit)).datasets[0].subsets[0]
    assert subset.control_path == [(tmp_path / "refs").resolve(), Path("/abs")]


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


def problems(tmp_path: Path, text: str, overrides: list[str] | None = None) -> str:
    """The message of the ConfigError that loading `text` (with `overrides`) raises."""
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text), overrides)
    return str(err.value)


@pytest.mark.parametrize("field, value", [
    ("train.lr", "inf"), ("train.lr", "nan"), ("adapter.text_encoder_lr", "inf"),
    ("adapter.embedding_lr", "inf"), ("adapter.alpha", "inf"), ("train.weight_decay", "inf"),
    ("train.eps", "inf"), ("train.shift", "inf"), ("train.guidance", "inf"),
    ("train.sigmoid_mean", "nan"), ("train.sigmoid_std", "inf"), ("train.max_grad_norm", "inf"),
    ("sample.guidance", "inf"), ("sample.cfg", "inf"), ("train.betas", "[0.9, nan]")])
def test_non_finite_floats_are_refused_naming_the_field(tmp_path: Path, field: str,
                                                        value: str) -> None:
    msg = problems(tmp_path, GOOD, [f"{field}={value}"])
    assert field in msg and "finite" in msg, msg


@pytest.mark.parametrize("betas", ["[1.0, 0.999]", "[0.9, 1.5]", "[-0.1, 0.999]"])
def test_betas_outside_zero_one_are_refused(tmp_path: Path, betas: str) -> None:
    msg = problems(tmp_path, GOOD, [f"train.betas={betas}"])
    assert "train.betas[" in msg and ("less than 1" in msg or "greater than or equal to 0" in msg)


@pytest.mark.parametrize("ext", ['""', '"."', '"a/b"'])
def test_unusable_caption_ext_is_refused(tmp_path: Path, ext: str) -> None:
    msg = problems(tmp_path, GOOD, [f"datasets.0.caption_ext={ext}"])
    assert "datasets[0].subsets[0].caption_ext" in msg


def test_token_warmup_that_outlasts_the_run_is_refused(tmp_path: Path) -> None:
    msg = problems(tmp_path, GOOD, ["datasets.0.token_warmup_steps=10"])  # train.steps = 10
    assert "datasets[0].subsets[0].token_warmup_steps (10)" in msg and "train.steps" in msg
    load_config(write(tmp_path, GOOD), ["datasets.0.token_warmup_steps=9"])  # ends in the run


def test_empty_config_lists_every_missing_section_at_once(tmp_path: Path) -> None:
    msg = problems(tmp_path, "# nothing yet\n")
    assert "3 problem(s)" in msg
    for section in ("  - model:", "  - datasets:", "  - save:"):
        assert section in msg, msg
    assert 'flavor = "tiny"' in msg and "dir = " in msg


def test_sample_keep_last_is_refused_with_what_to_use(tmp_path: Path) -> None:
    msg = problems(tmp_path, GOOD + "\n[sample]\nkeep_last = 3\n")
    assert "sample.keep_last" in msg and "save.keep_last" in msg


def test_max_grad_norm_zero_turns_clipping_off(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, GOOD), ["train.max_grad_norm=0"])
    assert cfg.train.max_grad_norm is None
    assert load_config(write(tmp_path, GOOD)).train.max_grad_norm == 1.0


def test_clipping_off_survives_config_resolved_json(tmp_path: Path) -> None:
    """config.resolved.json writes clipping off as null; reading it back (resume, `runs rank`,
    the web app) must give off again, not pydantic's TypeError on a bound applied to None."""
    cfg = load_config(write(tmp_path, GOOD), ["train.max_grad_norm=0"])
    again = parse_config(json.loads(json.dumps(cfg.model_dump(mode="json"))), tmp_path)
    assert again.train.max_grad_norm is None
    msg = problems(tmp_path, GOOD, ["train.max_grad_norm=true"])
    assert "train.max_grad_norm" in msg and "0" in msg
    assert "train.max_grad_norm" in problems(tmp_path, GOOD, ["train.max_grad_norm=-1"])


EMBEDDING = '\n[[adapter.embeddings]]\nname = "{}"\n'


@pytest.mark.parametrize("a, b", [("<sks>", "sks"), ("a/b", "ab"), ("<Sks>", "sks")])
def test_placeholders_sharing_a_file_name_are_refused(tmp_path: Path, a: str, b: str) -> None:
    text = GOOD.replace("[[datasets]]", EMBEDDING.format(a) + EMBEDDING.format(b) + "\n[[datasets]]")
    msg = problems(tmp_path, text)
    assert "adapter.embeddings[1].name" in msg and a in msg and b in msg


def test_names_too_long_for_the_file_system_are_refused(tmp_path: Path) -> None:
    long = "x" * 230
    text = GOOD.replace("[[datasets]]", EMBEDDING.format(f"<{long}>") + "\n[[datasets]]")
    msg = problems(tmp_path, text.replace('dir = "out"', f'dir = "out"\nname = "{long}"'))
    assert "save.name" in msg and "adapter.embeddings[0].name" in msg and "too long" in msg
    assert "at most 218 bytes" in msg  # 255 - len("-step000010.safetensors") - 14 (temp name)
    load_config(write(tmp_path, GOOD.replace('dir = "out"', f'dir = "out"\nname = "{"x" * 218}"')))


def test_save_dir_that_is_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "out").write_text("not a folder")
    msg = problems(tmp_path, GOOD)
    assert "save.dir" in msg and "not a folder" in msg
    msg = problems(tmp_path, GOOD.replace('dir = "out"', 'dir = "out/run"'))
    assert "save.dir" in msg and str(tmp_path / "out") in msg


def test_config_path_that_is_a_folder(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is a folder"):
        load_config(tmp_path)
