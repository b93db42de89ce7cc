"""The run form: schema walked from the config models, which fields apply, presets, TOML
import/export byte for byte, and validation messages equal to the CLI's."""

from __future__ import annotations

import difflib
from pathlib import Path

import pytest
from pydantic import Field

from difftune.cli import main
from difftune.config import RunConfig, load_config
from difftune.config.load import parse_config
from difftune.config.sections import TrainConfig
from difftune.ui.forms import applies, presets, schema, toml_io
from difftune.ui.forms.validate import validate

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.toml"))


def _leaf_count(model: type) -> int:
    """Leaf fields of a model, nested tables and lists of tables walked (independently)."""
    n = 0
    for info in model.model_fields.values():
        ann = info.annotation
        inner = getattr(ann, "__args__", (None,))[0] if getattr(ann, "__origin__", None) is list \
            else ann
        if isinstance(inner, type) and hasattr(inner, "model_fields"):
            n += _leaf_count(inner)
        else:
            n += 1
    return n


def test_schema_walks_every_field_of_the_models() -> None:
    fields = schema.fields_by_path()
    assert len(fields) == _leaf_count(RunConfig)
    lr = fields["train.lr"]
    assert (lr.kind, lr.default, lr.bounds, lr.help) == ("float", 1e-4, {"gt": 0},
                                                         "Peak learning rate.")
    assert fields["train.optimizer"].kind == "choice" and "adamw8bit" in fields[
        "train.optimizer"].choices
    assert fields["adapter.rank"].bounds == {"ge": 1, "le": 1024}
    path = fields["datasets[0].subsets[0].path"]
    assert path.kind == "path" and path.required and path.repeated == "datasets[0].subsets"
    assert fields["model.family"].choices[:3] == ["flux", "sd3", "sdxl"]  # from the registry
    assert fields["validation.enabled"].choices == ["auto", True, False]
    assert fields["train.ema.enabled"].kind == "bool"
    assert fields["save.dir"].required


def test_a_new_model_field_appears_in_the_form_by_itself() -> None:
    class MoreTrain(TrainConfig):
        new_knob: int = Field(3, ge=2, description="A field added later.")

    class MoreRun(RunConfig):
        train: MoreTrain = Field(default_factory=MoreTrain)

    knob = schema.fields_by_path(MoreRun)["train.new_knob"]
    assert (knob.kind, knob.default, knob.bounds, knob.help) == ("int", 3, {"ge": 2},
                                                                 "A field added later.")


def test_sdxl_hides_flux_only_fields() -> None:
    sdxl = applies.hidden({"model.family": "sdxl"})
    flux = applies.hidden({"model.family": "flux"})
    for path in ("model.t5", "model.t5_mask", "train.timesteps", "train.shift",
                 "train.blocks_to_swap", "datasets[0].subsets[0].control_path"):
        assert path in sdxl, path
    for path in ("model.t5", "model.t5_mask", "train.timesteps", "train.blocks_to_swap"):
        assert path not in flux, path
    assert "train.min_snr_gamma" not in sdxl and "train.min_snr_gamma" in flux  # DDPM only
    assert "model.clip_skip" in flux and "model.clip_skip" not in sdxl
    assert "has no T5 encoder" in sdxl["model.t5"]


def test_adapter_type_decides_its_fields() -> None:
    lora = applies.hidden({"model.family": "sdxl", "adapter.type": "lora"})
    lokr = applies.hidden({"model.family": "sdxl", "adapter.type": "lokr"})
    for path in ("adapter.factor", "adapter.decompose_both", "adapter.full_matrix"):
        assert path in lora and path not in lokr
    assert "adapter.conv_rank" not in lokr  # SDXL has conv layers
    assert "adapter.conv_rank" in applies.hidden({"model.family": "flux", "adapter.type": "lokr"})
    full = applies.hidden({"model.family": "flux", "adapter.type": "full"})
    assert "adapter.rank" in full and "adapter.train_blocks" not in full
    assert "save.format" in full and "save.format" not in lora
    assert "adapter.embeddings[0].name" in applies.hidden({"model.family": "z_image"})


def test_switches_show_their_subsections() -> None:
    off = applies.hidden({})
    on = applies.hidden({"train.ema.enabled": True,
                         "datasets[0].subsets[0].regularization": True,
                         "datasets[0].subsets[0].class_images": 4})
    for path in ("train.ema.decay", "datasets[0].subsets[0].class_prompt",
                 "datasets[0].subsets[0].class_steps"):
        assert path in off and path not in on, path


def test_variant_choices_come_from_the_spec() -> None:
    assert applies.choices({"model.family": "flux2"})["model.variant"] == ["klein", "dev"]
    assert "model.variant" in applies.hidden({"model.family": "sdxl"})
    assert applies.choices({"model.family": "flux2"})["save.format"][0] == "original"
    assert "original" not in applies.choices({"model.family": "sd3"})["save.format"]


def test_expert_fields_show_for_a_model_of_two_experts() -> None:
    """train.experts and its options (and the second expert's file) apply to Wan 2.2 A14B
    only, whose experts are the choices."""
    both = {"model.family": "wan", "model.variant": "2.2-t2v-a14b"}
    assert not {"train.experts", "train.expert_switch_every", "train.expert_boundary",
                "model.transformer_2"} & set(applies.hidden(both))
    assert applies.choices(both)["train.experts"] == ["high", "low"]
    one = applies.hidden({"model.family": "wan", "model.variant": "2.1-t2v-14b"})
    assert "one denoiser" in one["train.experts"] and "model.transformer_2" in one


def test_presets_scale_from_the_examples() -> None:
    made, refused = presets.build()
    by_name = {p.name: p for p in made}
    assert made[0].title == "tiny FLUX.1 (CPU demo)"
    for stem in ("sdxl-lora", "chroma-lora", "flux-dev-lora"):
        assert {f"{stem}-{g}gib" for g in (24, 16, 12)} <= set(by_name)
    # 24 GiB: the example as written (its outputs next to the run file).
    sd = (ROOT / "examples" / "sd35-lora.toml").read_text()
    changed = [ln for ln in difflib.ndiff(sd.splitlines(), by_name["sd35-lora-24gib"].toml
                                          .splitlines()) if ln[:1] in "+-"]
    assert changed == ['- dir = "/runs/my-subject-sd35"', '+ dir = "."']
    small = toml_io.values(toml_io.parse(by_name["flux-dev-lora-12gib"].toml))
    assert small["train.blocks_to_swap"] > 0 and small["precision.quantize.denoiser"] == "int8"
    assert by_name["flux-dev-lora-12gib"].estimate_gib <= 12
    assert any(r.example == "flux-dev-full.toml" and r.gib == 24 for r in refused)
    # Qwen2.5-VL reaches the GPU in bf16 (16.6 GB) before it is quantized: no 16 GiB preset
    qwen = next(r for r in refused if r.example == "qwen-image-lora.toml" and r.gib == 16)
    assert "while loading (before quantization)" in qwen.reason
    for preset in made:  # each one is a config the CLI accepts (model files aside)
        RunConfig.model_validate(toml_io.plain(toml_io.parse(preset.toml)))


def test_tiny_preset_points_at_the_demo_images(tmp_path: Path) -> None:
    preset = presets.get("tiny-flux")
    values = toml_io.values(toml_io.parse(preset.toml))
    demo = Path(values["datasets[0].subsets[0].path"])
    assert demo == presets.demo_dir() and any(demo.glob("*.png"))
    assert validate(preset.toml, tmp_path).ok


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_examples_round_trip_byte_for_byte(example: Path, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("difftune.config.load.check_paths", lambda cfg, source: None)
    text = example.read_bytes().decode("utf-8")
    doc = toml_io.parse(text)
    assert toml_io.dumps(doc).encode() == example.read_bytes()
    # One field changed: only its line changes, and the file loads as the form validated it.
    steps = toml_io.values(doc).get("train.steps", 1000)
    toml_io.set_value(doc, "train.steps", steps + 1)
    out = toml_io.dumps(doc)
    diff = [ln for ln in difflib.ndiff(text.splitlines(), out.splitlines()) if ln[:1] in "+-"]
    assert len(diff) in (1, 2) and all("steps" in ln for ln in diff)
    copy = example.parent / f".form-{example.name}"  # same folder: relative paths agree
    try:
        copy.write_text(out, encoding="utf-8")
        form_cfg = parse_config(toml_io.plain(doc), example.parent, str(copy))
        assert load_config(copy) == form_cfg
        assert load_config(copy).train.steps == steps + 1
    finally:
        copy.unlink(missing_ok=True)


def test_a_file_made_in_the_form_runs_unchanged(tmp_path: Path) -> None:
    doc = toml_io.parse(presets.get("tiny-flux").toml)
    for path, value in {"train.steps": 60, "train.lr": 5e-4, "adapter.type": "lokr",
                        "adapter.factor": 4, "adapter.rank": 4, "train.ema.enabled": True,
                        "datasets[0].subsets[0].repeats": 2, "save.format": None}.items():
        toml_io.set_value(doc, path, value)
    text = toml_io.dumps(doc)
    checked = validate(text, tmp_path, str(tmp_path / "run.toml"))
    assert checked.ok, checked.message
    (tmp_path / "run.toml").write_text(text, encoding="utf-8")
    assert load_config(tmp_path / "run.toml") == checked.config
    assert '[train.ema]\nenabled = true\n' in text and "format" not in text
    # Unchanged values keep their spelling (1e-3 stays 1e-3 when set to the same value).
    toml_io.set_value(doc, "train.warmup_steps", 10)
    assert toml_io.dumps(doc) == text


def test_bad_field_message_equals_the_cli(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    doc = toml_io.parse(presets.get("tiny-flux").toml)
    toml_io.set_value(doc, "train.lr", -1.0)
    toml_io.set_value(doc, "adapter.factor", 4)
    path = tmp_path / "bad.toml"
    path.write_text(toml_io.dumps(doc), encoding="utf-8")
    ui = validate(toml_io.dumps(doc), tmp_path, str(path))
    assert not ui.ok and "train.lr" in ui.message and "adapter.factor" in ui.message
    # The CLI's entry point (`python -m difftune check` calls it), in this process for speed.
    assert main(["check", str(path)]) != 0
    assert capsys.readouterr().err.strip() == f"error: {ui.message}"


def test_bad_toml_is_reported_as_the_cli_words_it(tmp_path: Path) -> None:
    result = validate("[train\nsteps = 1", tmp_path, "run.toml")
    assert not result.ok and result.message.startswith("run.toml is not valid TOML:")


def test_fields_have_human_labels() -> None:
    fields = schema.fields_by_path()
    assert fields["train.lr"].label == "Learning rate"
    assert fields["train.min_snr_gamma"].label == "Min. SNR gamma"
    assert fields["datasets[0].subsets[0].caption_dropout_rate"].label == "Caption dropout rate"
    assert schema.inner_lists("datasets") == ["datasets[0].subsets"]


def test_problems_go_beside_their_fields(tmp_path: Path) -> None:
    """Each line of the CLI's message naming a field the form shows goes to that field (a
    dataset's shorthand key to its subset 0's field); the rest stays at the top."""
    from difftune.ui.forms import field_errors

    text = presets.get("tiny-flux").toml.replace("lr = 1e-3", "lr = -1\nlearning_rate = 2")
    message = validate(text, tmp_path).message
    places = {"train.lr", "datasets[0].subsets[0].path", "datasets[0]"}
    by_place, top = field_errors.split(message, places)
    assert [line.split(":")[0] for line in by_place["train.lr"]] == ["train.lr"]
    assert "train.learning_rate" in top and "train.lr:" not in top
    only, top = field_errors.split("run.toml: 1 problem(s) in the configuration:\n"
                                   "  - datasets[1].path: Field required", {
                                       "datasets[1].subsets[0].path"})
    assert only == {"datasets[1].subsets[0].path": ["datasets[1].path: Field required"]}
    assert top == ""


def test_list_items_are_added_and_removed_in_place() -> None:
    """A second dataset, a second subset of a shorthand dataset, and removals: the rest of the
    file is the same bytes."""
    text = presets.get("tiny-flux").toml
    doc = toml_io.parse(text)
    assert (toml_io.count(doc, "datasets"), toml_io.count(doc, "datasets[0].subsets")) == (1, 1)
    toml_io.add_item(doc, "datasets[0].subsets")  # the shorthand becomes [[datasets.subsets]]
    toml_io.set_value(doc, "datasets[0].subsets[1].path", "more")
    toml_io.add_item(doc, "datasets")
    toml_io.add_item(doc, "datasets[1].subsets")
    toml_io.set_value(doc, "datasets[1].subsets[0].path", "other")
    values = toml_io.values(doc)
    assert values["datasets[0].subsets[0].path"] == values["datasets[0].subsets[0].path"]
    assert (values["datasets[0].subsets[1].path"], values["datasets[1].subsets[0].path"]) == (
        "more", "other")
    toml_io.remove_item(doc, "datasets", 1)
    toml_io.remove_item(doc, "datasets[0].subsets", 1)
    assert toml_io.count(doc, "datasets") == 1
    after = toml_io.dumps(doc)
    head = text.split("[[datasets]]")[0]
    assert after.startswith(head) and after.split("[train]")[1] == text.split("[train]")[1]
