"""`difftune import kohya|ai-toolkit|onetrainer FILE`: each trainer's config (written here, in
each trainer's own key names) becomes a run file difftune's own loader accepts, the report says
what became of each key, and nothing a user made is overwritten. Through the real CLI.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from difftune.cli import main
from difftune.config import load_config

KOHYA = """\
pretrained_model_name_or_path = "models/flux1-dev.safetensors"
ae = "models/ae.safetensors"
clip_l = "models/clip_l.safetensors"
t5xxl = "models/t5xxl_fp16.safetensors"
network_module = "networks.lora_flux"
network_dim = 16
network_alpha = 8
learning_rate = 2e-4
optimizer_type = "AdamW8bit"
optimizer_args = ["weight_decay=0.05", "betas=0.9,0.99"]
lr_scheduler = "cosine"
max_train_steps = 1200
mixed_precision = "bf16"
fp8_base = true
cache_latents_to_disk = true
timestep_sampling = "flux_shift"
output_dir = "out"
output_name = "my-lora"
save_every_n_steps = 200
color_aug = true
sdpa = true
train_data_dir = "train"
resolution = "512,512"
shuffle_caption = true
keep_tokens = 1
xyz_made_up = 3
"""


def _single_files(root: Path, *names: str) -> None:
    """Stand-in .safetensors files (the loader checks kind and place, not contents)."""
    (root / "models").mkdir(parents=True, exist_ok=True)
    for name in names:
        save_file({"x": torch.zeros(1)}, str(root / "models" / f"{name}.safetensors"))


def _import(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["import", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def test_kohya_config_with_dreambooth_folders(tmp_path: Path, images: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    _single_files(tmp_path, "flux1-dev", "ae", "clip_l", "t5xxl_fp16")
    shutil.copytree(images, tmp_path / "train" / "10_sks dog")
    (tmp_path / "kohya.toml").write_text(KOHYA, encoding="utf-8")
    out = tmp_path / "run.toml"
    code, report, _ = _import(capsys, "kohya", tmp_path / "kohya.toml", "--out", out)
    assert code == 0
    cfg = load_config(out)
    assert (cfg.model.family, cfg.model.transformer) == ("flux", tmp_path / "models" /
                                                         "flux1-dev.safetensors")
    assert (cfg.adapter.rank, cfg.adapter.alpha, cfg.train.lr) == (16, 8, 2e-4)
    assert (cfg.train.optimizer, cfg.train.weight_decay, cfg.train.betas) == \
        ("adamw8bit", 0.05, (0.9, 0.99))
    assert (cfg.precision.mixed, cfg.precision.denoiser, cfg.cache.latents) == \
        ("bf16", "fp8", "disk")
    assert (cfg.save.dir, cfg.save.name, cfg.save.every_n_steps) == (tmp_path / "out",
                                                                     "my-lora", 200)
    subset = cfg.datasets[0].subsets[0]
    assert (subset.path.name, subset.repeats, subset.default_caption) == ("10_sks dog", 10,
                                                                         "sks dog")
    assert (subset.shuffle_caption, subset.keep_tokens, cfg.datasets[0].resolution) == \
        (True, 1, 512)
    # The report, line by line: every key of the file, under what became of it.
    sections = report.split("\nguessed (check these):\n")
    assert 'network_dim = 16  ->  adapter.rank = 16' in sections[0]
    assert "train_data_dir" in sections[1] and "10 repeats" in sections[1]
    assert 'color_aug = true: difftune has no colour augmentation' in report
    assert 'sdpa = true: difftune uses PyTorch' in report.split("built in")[1]
    assert "xyz_made_up = 3: not a key this importer knows" in report
    for line in KOHYA.splitlines():
        assert line.split(" = ")[0] in report, line
    # The run file says where each value came from and what was left out.
    text = out.read_text(encoding="utf-8")
    assert "rank = 16 # kohya: network_dim = 16" in text
    assert "#   color_aug = true: difftune has no colour augmentation" in text


def test_kohya_dataset_config_inherits_as_kohya_does(tmp_path: Path, images: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """[general] < [[datasets]] < [[datasets.subsets]]; a regularization subset takes
    prior_loss_weight; networks.lora is read as SDXL from the dataset config's resolution,
    said as a guess."""
    (tmp_path / "data.toml").write_text(f"""\
[general]
keep_tokens = 1
caption_extension = ".caption"
[[datasets]]
resolution = [1024, 768]
batch_size = 2
  [[datasets.subsets]]
  image_dir = "{images.as_posix()}"
  num_repeats = 5
  keep_tokens = 2
  [[datasets.subsets]]
  image_dir = "{images.as_posix()}"
  is_reg = true
  class_tokens = "dog"
""", encoding="utf-8")
    (tmp_path / "model").mkdir()
    (tmp_path / "cfg.toml").write_text("""\
[model]
pretrained_model_name_or_path = "model"
[network]
network_module = "networks.lora"
network_dim = 4
[training]
dataset_config = "data.toml"
output_dir = "out"
prior_loss_weight = 0.5
""", encoding="utf-8")
    out = tmp_path / "run.toml"
    code, report, _ = _import(capsys, "kohya", tmp_path / "cfg.toml", "--out", out)
    assert code == 0
    cfg = load_config(out)
    main_, reg = cfg.datasets[0].subsets
    assert (main_.repeats, main_.keep_tokens, main_.caption_ext) == (5, 2, ".caption")
    assert (reg.regularization, reg.keep_tokens, reg.loss_weight, reg.default_caption) == \
        (True, 1, 0.5, "dog")
    assert (cfg.model.family, cfg.model.path, cfg.train.batch_size) == ("sdxl",
                                                                       tmp_path / "model", 2)
    assert cfg.datasets[0].resolution == 880  # the side of 1024 x 768's area
    assert 'resolution = [1024, 768]  ->  model.family = "sdxl"' in report.split("guessed")[1]
    # What the file leaves out trains as sd-scripts would: its defaults, said as such.
    assert (cfg.adapter.rank, cfg.adapter.alpha, cfg.train.lr, cfg.train.steps) == \
        (4, 1, 2e-6, 1600)
    assert "network_alpha (kohya's default, not in the file) = 1  ->  adapter.alpha = 1" in report


AI_TOOLKIT = """\
job: extension
config:
  name: "my qwen lora"
  process:
    - type: sd_trainer
      training_folder: output
      device: cuda:0
      trigger_word: p3r5on
      network: {type: lora, linear: 32, linear_alpha: 16}
      save: {dtype: float16, save_every: 250, max_step_saves_to_keep: 4}
      datasets:
        - folder_path: IMAGES
          caption_ext: txt
          caption_dropout_rate: 0.05
          cache_latents_to_disk: true
          resolution: [512, 768, 1024]
      train:
        batch_size: 1
        steps: 3000
        optimizer: adamw8bit
        lr: 1e-4
        timestep_type: weighted
        ema_config: {use_ema: true, ema_decay: 0.99}
        dtype: bf16
        diff_output_preservation: true
        diff_output_preservation_class: person
      model:
        name_or_path: MODEL
        arch: qwen_image
        quantize: true
        qtype: qfloat8
      sample:
        sample_every: 250
        prompts: ["[trigger] holding a sign", "a bear in the snow"]
        neg: ""
        seed: 42
        guidance_scale: 4
        sample_steps: 25
meta: {name: "[name]"}
"""


def test_ai_toolkit_job(tmp_path: Path, images: Path,
                        capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "qwen").mkdir()
    job = tmp_path / "job.yaml"
    job.write_text(AI_TOOLKIT.replace("IMAGES", images.as_posix()).replace("MODEL", "qwen"),
                   encoding="utf-8")
    out = tmp_path / "runs" / "qwen.toml"
    code, report, _ = _import(capsys, "ai-toolkit", job, "--out", out)
    assert code == 0
    cfg = load_config(out)
    assert (cfg.model.family, cfg.model.variant, cfg.model.path) == ("qwen_image", "base",
                                                                     tmp_path / "qwen")
    assert (cfg.adapter.rank, cfg.adapter.alpha, cfg.train.lr, cfg.train.steps) == \
        (32, 16, 1e-4, 3000)
    assert (cfg.train.ema.enabled, cfg.train.ema.decay, cfg.precision.quantize.denoiser) == \
        (True, 0.99, "qfloat8")
    assert (cfg.preservation.trigger, cfg.preservation.replacement) == ("p3r5on", "person")
    assert cfg.save.dir == tmp_path / "output" / "my qwen lora"
    assert (cfg.save.name, cfg.save.keep_last, cfg.save.dtype) == ("my_qwen_lora", 4, "fp16")
    d = cfg.datasets[0]
    assert (d.resolutions, d.subsets[0].caption_prefix, cfg.cache.latents) == \
        ((512, 768, 1024), "p3r5on", "disk")
    assert cfg.sample.prompts == out.with_name("qwen.prompts.txt")
    assert cfg.sample.prompts.read_text(encoding="utf-8").splitlines() == [
        "p3r5on holding a sign", "a bear in the snow"]
    assert 'train.timestep_type = "weighted": difftune has no timestep type' in report


ONETRAINER = {
    "__version": 10, "training_method": "LORA", "model_type": "Z_IMAGE",
    "base_model_name": "Tongyi-MAI/Z-Image-Turbo",
    "output_model_destination": "models/zimage-lora.safetensors",
    "output_dtype": "BFLOAT_16", "concept_file_name": "concepts.json",
    "sample_definition_file_name": "samples.json", "resolution": "512",
    "learning_rate_scheduler": "COSINE", "learning_rate": 0.0003, "epochs": 10,
    "batch_size": 2, "train_dtype": "BFLOAT_16", "lora_rank": 16, "lora_alpha": 1.0,
    "transformer": {"train": True, "weight_dtype": "INT_W8A8", "model_name": ""},
    "text_encoder": {"train": False, "weight_dtype": "FLOAT_8"},
    "optimizer": {"optimizer": "ADAMW", "weight_decay": 0.01, "beta1": 0.9, "beta2": 0.99,
                  "fused": True, "d_coef": None},
    "layer_filter_preset": "attn-mlp", "sample_after": 100, "sample_after_unit": "STEP",
    "backup_after": 30, "backup_after_unit": "MINUTE", "debug_mode": False,
}


def test_onetrainer_config_with_concepts_and_samples(tmp_path: Path, images: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Concepts become subsets (balancing -> repeats), epochs become steps counted from the
    folders, samples the prompt file; a Hugging Face name is said to need a download."""
    (tmp_path / "concepts.json").write_text(json.dumps([
        {"name": "dog", "path": images.as_posix(), "balancing": 3.0,
         "image": {"enable_random_flip": True, "enable_crop_jitter": True},
         "text": {"prompt_source": "sample", "enable_tag_shuffling": True}},
        {"name": "off", "path": "/nowhere", "enabled": False}]), encoding="utf-8")
    (tmp_path / "samples.json").write_text(json.dumps([
        {"prompt": "a photo of sks dog", "width": 768, "height": 1024, "seed": 4,
         "diffusion_steps": 30, "cfg_scale": 4.0}]), encoding="utf-8")
    (tmp_path / "ot.json").write_text(json.dumps(ONETRAINER), encoding="utf-8")
    out = tmp_path / "run.toml"
    code, report, _ = _import(capsys, "onetrainer", tmp_path / "ot.json", "--out", out)
    assert code == 0
    assert "Tongyi-MAI/Z-Image-Turbo' is a Hugging Face repository name" in report
    assert "epochs = 10  ->  train.steps = 90" in report  # 6 images x 3, 2 a step, 10 times
    assert "concept 'off' (disabled)" in report and "fused" in report
    with pytest.raises(Exception, match="model.path"):
        load_config(out)  # until the download: the loader names the field to set
    (tmp_path / "zimage").mkdir()
    cfg = load_config(out, [f'model.path="{(tmp_path / "zimage").as_posix()}"'])
    assert (cfg.model.family, cfg.adapter.targets, cfg.train.scheduler) == (
        "z_image", "attention_mlp", "cosine")
    assert (cfg.precision.quantize.denoiser, cfg.precision.text_encoders) == ("int8", "fp8")
    assert (cfg.train.betas, cfg.train.steps, cfg.sample.every_n_steps) == ((0.9, 0.99), 90,
                                                                             100)
    subset = cfg.datasets[0].subsets[0]
    assert (len(cfg.datasets[0].subsets), subset.repeats, subset.flip,
            subset.shuffle_caption) == (1, 3, True, True)
    assert (cfg.save.dir, cfg.save.name) == (tmp_path / "models", "zimage-lora")
    assert cfg.sample.prompts.read_text(encoding="utf-8").strip() == \
        "a photo of sks dog --w 768 --h 1024 --d 4 --s 30 --l 4.0"


def test_nothing_is_overwritten(tmp_path: Path, images: Path,
                                capsys: pytest.CaptureFixture[str]) -> None:
    """An existing run file (or prompt file) is refused unless --force; the source file
    itself never, whatever --out says."""
    job = tmp_path / "job.yaml"
    (tmp_path / "qwen").mkdir()
    job.write_text(AI_TOOLKIT.replace("IMAGES", images.as_posix()).replace("MODEL", "qwen"),
                   encoding="utf-8")
    out = tmp_path / "run.toml"
    out.write_text("# mine\n", encoding="utf-8")
    code, _, err = _import(capsys, "ai-toolkit", job, "--out", out)
    assert code == 2 and f"{out} exists" in err and "--force" in err
    assert out.read_text(encoding="utf-8") == "# mine\n"
    prompts = tmp_path / "other.prompts.txt"
    prompts.write_text("my prompts\n", encoding="utf-8")
    code, _, err = _import(capsys, "ai-toolkit", job, "--out", tmp_path / "other.toml")
    assert code == 2 and "other.prompts.txt exists" in err
    assert prompts.read_text(encoding="utf-8") == "my prompts\n"
    assert not (tmp_path / "other.toml").exists()
    code, _, err = _import(capsys, "ai-toolkit", job, "--out", job, "--force")
    assert code == 2 and "is the file being imported" in err
    assert _import(capsys, "ai-toolkit", job, "--out", out, "--force")[0] == 0
    assert "[model]" in out.read_text(encoding="utf-8")


@pytest.mark.parametrize("trainer, name, text, problem", [
    ("kohya", "bad.toml", "network_dim = = 3", "not valid TOML"),
    ("ai-toolkit", "bad.yaml", "config: [unclosed", "not valid YAML"),
    ("onetrainer", "bad.json", "{\"model_type\": ", "not valid JSON"),
    ("kohya", "data.toml", "[[datasets]]\n[[datasets.subsets]]\nimage_dir = 'x'\n",
     "is a kohya dataset config; import the training config"),
    ("kohya", "other.toml", "[tool.poetry]\nname = 'x'\n", "is not a kohya sd-scripts"),
    ("ai-toolkit", "extract.yaml", "job: extract\nconfig:\n  process:\n    - type: locon\n",
     "is not an ai-toolkit training process"),
    ("onetrainer", "concepts.json", "[{\"path\": \"x\"}]", "a concepts or samples file"),
    ("onetrainer", "sd2.json", "{\"model_type\": \"STABLE_DIFFUSION_21\"}",
     "difftune does not train this model"),
    ("ai-toolkit", "noarch.yaml", "config:\n  process:\n    - type: sd_trainer\n",
     "model.arch is not set"),
    ("ai-toolkit", "j.yaml", "config:\n  process:\n    - type: sd_trainer\n      model: "
     "{arch: flux, name_or_path: x}\n      datasets: {folder_path: x}\n",
     "datasets should be a list of tables"),
    ("onetrainer", "o.json", '{"model_type": "FLUX_DEV_1", "epochs": "many"}',
     "a value has another shape"),
    ("ai-toolkit", "k.yaml", "config:\n  process:\n    - type: sd_trainer\n      model: "
     "{arch: flux, name_or_path: x}\n      train: {optimizer_params: 5}\n",
     "a value has another shape"),
])
def test_bad_input_exits_2_naming_the_file(trainer: str, name: str, text: str, problem: str,
                                           tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    code, _, err = _import(capsys, trainer, path, "--out", tmp_path / "run.toml")
    assert code == 2 and str(path) in err and problem in err, err
    assert "Traceback" not in err and not (tmp_path / "run.toml").exists()


def test_check_passes_on_an_imported_job(tmp_path: Path, images: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """The whole way: an ai-toolkit FLUX.1 job imported, then `difftune check` (load, one
    step, one sample) on the tiny FLUX.1 saved as the diffusers folder the job names."""
    from diffusers import FluxPipeline

    from difftune.families.flux.tiny import build_tiny_flux

    parts = {k: v for k, v in build_tiny_flux().items() if k != "t5_max_length"}
    FluxPipeline(**parts).save_pretrained(str(tmp_path / "flux"), safe_serialization=True)
    job = tmp_path / "job.yaml"
    job.write_text(f"""\
job: extension
config:
  name: tiny
  process:
    - type: sd_trainer
      training_folder: {(tmp_path / "output").as_posix()}
      network: {{type: lora, linear: 4, linear_alpha: 4}}
      datasets: [{{folder_path: {images.as_posix()}, caption_ext: txt, resolution: 64}}]
      train: {{batch_size: 1, steps: 10, optimizer: adamw, lr: 1e-3, dtype: fp32}}
      model: {{name_or_path: flux, is_flux: true}}
      sample: {{sample_every: 5, width: 64, height: 64, sample_steps: 2,
               prompts: [a red circle]}}
""", encoding="utf-8")
    out = tmp_path / "run.toml"
    code, report, _ = _import(capsys, "ai-toolkit", job, "--out", out)
    assert code == 0 and "datasets.0.min_side = 32" in report  # widened to hold 64
    assert main(["check", str(out), "--set", 'train.device="cpu"']) == 0
    report = capsys.readouterr().out
    assert "check passed" in report and "sample works" in report


def test_options_of_the_other_objective_are_left_out(tmp_path: Path, images: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """A OneTrainer SDXL config names a timestep distribution (a flow-matching option difftune
    refuses for SDXL): it is left out with the reason, and the run loads."""
    (tmp_path / "sdxl").mkdir()
    config = {"model_type": "STABLE_DIFFUSION_XL_10_BASE", "training_method": "LORA",
              "base_model_name": "sdxl", "timestep_distribution": "UNIFORM",
              "offset_noise_weight": 0.05, "output_model_destination": "out/x.safetensors",
              "concepts": [{"path": images.as_posix()}]}
    (tmp_path / "ot.json").write_text(json.dumps(config), encoding="utf-8")
    code, report, _ = _import(capsys, "onetrainer", tmp_path / "ot.json", "--out",
                              tmp_path / "run.toml")
    assert code == 0
    assert 'timestep_distribution = "UNIFORM": does not apply to model.family = "sdxl"' in report
    cfg = load_config(tmp_path / "run.toml")
    assert (cfg.model.family, cfg.train.noise_offset, cfg.train.timesteps) == ("sdxl", 0.05,
                                                                               "sigmoid")


def test_family_from_the_command_line(tmp_path: Path, images: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    """A LyCORIS config names no model: refused without --family, read with it (the kind
    from network_args)."""
    (tmp_path / "model").mkdir()
    (tmp_path / "c.toml").write_text(f"""\
pretrained_model_name_or_path = "model"
network_module = "lycoris.kohya"
network_args = ["algo=lokr", "factor=8"]
network_dim = 8
output_dir = "out"
train_data_dir = "{tmp_path.as_posix()}/train"
""", encoding="utf-8")
    shutil.copytree(images, tmp_path / "train" / "2_cat")
    code, _, err = _import(capsys, "kohya", tmp_path / "c.toml", "--out", tmp_path / "r.toml")
    assert code == 2 and "pass --family" in err and str(tmp_path / "c.toml") in err
    code, report, _ = _import(capsys, "kohya", tmp_path / "c.toml", "--out",
                              tmp_path / "r.toml", "--family", "sdxl")
    assert code == 0 and "--family sdxl  ->  model.family" in report
    cfg = load_config(tmp_path / "r.toml")
    assert (cfg.model.family, cfg.adapter.type, cfg.adapter.factor) == ("sdxl", "lokr", 8)



def test_kohya_clip_skip_is_sd15s_model_clip_skip(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """train_network.py's clip_skip = 2 (CLIP's hidden_states[-2], normed) is SD 1.5's
    model.clip_skip = 1; read as SDXL (whose script ignores it) it is left out, with why."""
    (tmp_path / "sd").mkdir()
    (tmp_path / "c.toml").write_text('pretrained_model_name_or_path = "sd"\n'
                                     'network_module = "networks.lora"\nclip_skip = 2\n',
                                     encoding="utf-8")
    code, report, err = _import(capsys, "kohya", tmp_path / "c.toml", "--out",
                                tmp_path / "r.toml", "--family", "sd15")
    assert code == 0, err
    assert "clip_skip = 2  ->  model.clip_skip = 1" in report
    assert load_config(tmp_path / "r.toml").model.clip_skip == 1
    code, report, err = _import(capsys, "kohya", tmp_path / "c.toml", "--out",
                                tmp_path / "x.toml")
    assert code == 0, err
    assert "clip_skip = 2: difftune reads" in report
    assert load_config(tmp_path / "x.toml").model.clip_skip == 0


# Stand-in single-file checkpoints with the tensor names of SD 1.5's (attention on the first
# level, no label embedding) and SDXL's (a label embedding) original-layout UNets.
UNET = "model.diffusion_model."
CHECKPOINTS = {"v1-5.safetensors": ("input_blocks.0.0.weight", "input_blocks.1.1.proj_in.weight"),
               "sd_xl.safetensors": ("input_blocks.0.0.weight", "label_emb.0.0.0.weight")}


@pytest.mark.parametrize("lines, family, guessed", [
    # the local model file's tensors decide (over a resolution that says otherwise)
    ('pretrained_model_name_or_path = "v1-5.safetensors"\nresolution = "1024"\nclip_skip = 2',
     "sd15", False),
    ('pretrained_model_name_or_path = "sd_xl.safetensors"\nresolution = "512"', "sdxl", False),
    ('pretrained_model_name_or_path = "sd-folder"\nresolution = "1024"', "sd15", False),
    # no local file: the kohya_ss GUI's sdxl flag; guesses: a key only sdxl_train_network.py
    # takes, else the resolution
    ('pretrained_model_name_or_path = "gone.safetensors"\nsdxl = false', "sd15", False),
    ('pretrained_model_name_or_path = "gone.safetensors"\ncache_text_encoder_outputs = true',
     "sdxl", True),
    ('pretrained_model_name_or_path = "gone.safetensors"\nresolution = "512,512"', "sd15", True),
])
def test_kohya_networks_lora_tells_sd15_from_sdxl(lines: str, family: str, guessed: bool,
                                                  tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """networks.lora serves train_network.py (SD 1.x/2.x) and sdxl_train_network.py, and a
    kohya config does not record its script: the family comes from what the config says
    (SD 1.5's clip_skip rule then applies), a guess only where its resolution alone tells."""
    import tomllib

    for name, keys in CHECKPOINTS.items():
        save_file({UNET + k: torch.zeros(1) for k in keys}, str(tmp_path / name))
    (tmp_path / "sd-folder").mkdir()  # a diffusers folder: its pipeline tells
    (tmp_path / "sd-folder" / "model_index.json").write_text(
        '{"_class_name": "StableDiffusionPipeline"}', encoding="utf-8")
    (tmp_path / "c.toml").write_text(f'network_module = "networks.lora"\n{lines}\n',
                                     encoding="utf-8")
    code, report, err = _import(capsys, "kohya", tmp_path / "c.toml", "--out",
                                tmp_path / "r.toml")
    assert code == 0, err
    run = tomllib.loads((tmp_path / "r.toml").read_text(encoding="utf-8"))
    assert run["model"]["family"] == family
    line = next(x for x in report.splitlines() if f'model.family = "{family}"' in x)
    assert (line in report.split("guessed (check these):")[-1]) == guessed, report
    if "clip_skip" in lines:
        assert run["model"]["clip_skip"] == 1


def test_kohya_sd2_config_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "c.toml").write_text('network_module = "networks.lora"\nv2 = true\n'
                                     'pretrained_model_name_or_path = "sd2.safetensors"\n',
                                     encoding="utf-8")
    code, _, err = _import(capsys, "kohya", tmp_path / "c.toml", "--out", tmp_path / "r.toml")
    assert code == 2 and "v2 = true" in err and "difftune does not train" in err, err


@pytest.mark.parametrize("model_type, skips, clip_skip, dropped", [
    ("STABLE_DIFFUSION_15", {"text_encoder_layer_skip": 1}, 1, ""),
    ("STABLE_DIFFUSION_XL_10_BASE", {"text_encoder_layer_skip": 2,
                                     "text_encoder_2_layer_skip": 2}, 2, ""),
    ("STABLE_DIFFUSION_XL_10_BASE", {"text_encoder_layer_skip": 1,
                                     "text_encoder_2_layer_skip": 0}, None,
     "skips as many layers in every CLIP encoder"),
    ("FLUX_DEV_1", {"text_encoder_layer_skip": 1, "text_encoder_2_layer_skip": 0}, None,
     "CLIP encoders read at a hidden state only"),
])
def test_onetrainer_layer_skip_is_model_clip_skip(
        model_type: str, skips: dict, clip_skip: int | None, dropped: str, tmp_path: Path,
        images: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """OneTrainer's text_encoder_layer_skip counts from the hidden state the pipeline reads
    (SD 1.5's last, SDXL's penultimate: its clip_util's default_layer - layer_skip), as
    model.clip_skip does: N stays N. One skip for every CLIP encoder, or none: differing
    skips, and a skip of an encoder not read at a hidden state, are left out with why."""
    import tomllib

    (tmp_path / "model").mkdir()
    config = {"model_type": model_type, "training_method": "LORA", "base_model_name": "model",
              "concepts": [{"path": images.as_posix()}], **skips}
    (tmp_path / "ot.json").write_text(json.dumps(config), encoding="utf-8")
    code, report, err = _import(capsys, "onetrainer", tmp_path / "ot.json", "--out",
                                tmp_path / "r.toml")
    assert code == 0, err
    model = tomllib.loads((tmp_path / "r.toml").read_text(encoding="utf-8"))["model"]
    assert model.get("clip_skip") == clip_skip
    if clip_skip:
        assert f"text_encoder_layer_skip = {clip_skip}" in next(
            x for x in report.splitlines() if x.endswith(f"model.clip_skip = {clip_skip}"))
    assert dropped in report.split("no equivalent")[-1]


def test_a_run_difftune_still_refuses_is_written_with_what_to_fix(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A preset naming no dataset, a rank above difftune's limit and a transformer by its
    download address: the run file is written, the fixes listed in it and printed."""
    (tmp_path / "flux").mkdir()
    preset = {"model_type": "FLUX_DEV_1", "training_method": "LORA", "base_model_name": "flux",
              "lora_rank": 5000, "train_dtype": "BFLOAT_16", "transformer": {
                  "model_name": "https://example.org/files/flux-dedistilled.safetensors"}}
    (tmp_path / "p.json").write_text(json.dumps(preset), encoding="utf-8")
    out = tmp_path / "run.toml"
    code, report, _ = _import(capsys, "onetrainer", tmp_path / "p.json", "--out", out)
    assert code == 0
    fix = report.split(f"to fix in {out} before it trains")[1]
    assert "adapter.rank" in fix and "1024" in fix
    text = out.read_text(encoding="utf-8")
    assert "# To fix before it trains" in text and "adapter.rank" in text.split("[model]")[0]
    assert 'path = "images"' in text and "put your images" in text
    assert 'transformer = "flux-dedistilled.safetensors"' in text and "download it" in text
    assert "lora_alpha (onetrainer's default, not in the file) = 1.0" in report


@pytest.mark.parametrize("trainer, name, text, family", [
    ("onetrainer", "ot.json", json.dumps({
        "model_type": "STABLE_DIFFUSION_15", "training_method": "LORA", "base_model_name": "sd",
        "output_model_destination": "out/x.safetensors", "concepts": [{"path": "IMAGES"}]}),
     "sd15"),
    ("ai-toolkit", "job.yaml", "config:\n  process:\n    - type: sd_trainer\n      model: "
     "{arch: sd1, name_or_path: sd}\n      datasets: [{folder_path: IMAGES}]\n", "sd15"),
    ("onetrainer", "ot.json", json.dumps({
        "model_type": "ERNIE", "training_method": "LORA", "base_model_name": "sd",
        "output_model_destination": "out/x.safetensors", "concepts": [{"path": "IMAGES"}]}),
     "ernie_image"),
    ("ai-toolkit", "job.yaml", "config:\n  process:\n    - type: sd_trainer\n      model: "
     "{arch: ernie_image, name_or_path: sd}\n      datasets: [{folder_path: IMAGES}]\n",
     "ernie_image"),
])
def test_family_names_of_other_trainers(trainer: str, name: str, text: str, family: str,
                                        tmp_path: Path, images: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """OneTrainer's STABLE_DIFFUSION_15 and ai-toolkit's arch sd1 are SD 1.5 runs; OneTrainer's
    ERNIE (refused as untrained before) and ai-toolkit's ernie_image are ERNIE-Image runs."""
    (tmp_path / "sd").mkdir()
    (tmp_path / name).write_text(text.replace("IMAGES", images.as_posix()), encoding="utf-8")
    code, _, err = _import(capsys, trainer, tmp_path / name, "--out", tmp_path / "run.toml")
    assert code == 0, err
    assert load_config(tmp_path / "run.toml").model.family == family


def test_ai_toolkit_wan21_and_wan22_14b_are_wan_runs(
        tmp_path: Path, images: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """ai-toolkit's arch wan21 imports as model.family = "wan"; wan22_14b as both A14B experts
    in one run (variant 2.2-t2v-a14b), its stages (model_kwargs.train_high_noise /
    train_low_noise) as train.experts and switch_boundary_every as train.expert_switch_every;
    wan22_14b_i2v and wan21_i2v as the image-to-video variants."""
    (tmp_path / "wan").mkdir()
    job = ("config:\n  process:\n    - type: sd_trainer\n      model: "
           "{arch: ARCH, name_or_path: wan}\n      datasets: [{folder_path: IMAGES}]\n")
    (tmp_path / "a.yaml").write_text(job.replace("ARCH", "wan21").replace(
        "IMAGES", images.as_posix()), encoding="utf-8")
    code, _, err = _import(capsys, "ai-toolkit", tmp_path / "a.yaml", "--out", tmp_path / "a.toml")
    assert code == 0, err
    assert load_config(tmp_path / "a.toml").model.family == "wan"
    a14b = job.replace("ARCH", "wan22_14b, model_kwargs: {train_high_noise: false, "
                       "train_low_noise: true}").replace("IMAGES", images.as_posix())
    a14b += "      train: {switch_boundary_every: 5}\n"
    (tmp_path / "b.yaml").write_text(a14b, encoding="utf-8")
    code, out, err = _import(capsys, "ai-toolkit", tmp_path / "b.yaml", "--out",
                             tmp_path / "b.toml")
    assert code == 0, err
    cfg = load_config(tmp_path / "b.toml")
    assert (cfg.model.family, cfg.model.variant) == ("wan", "2.2-t2v-a14b")
    assert (cfg.train.experts, cfg.train.expert_switch_every) == (["low"], 5)
    # without switch_boundary_every: ai-toolkit's default, every step
    (tmp_path / "c.yaml").write_text(a14b.replace("switch_boundary_every: 5", "lr: 0.0001"),
                                     encoding="utf-8")
    code, _, err = _import(capsys, "ai-toolkit", tmp_path / "c.yaml", "--out",
                           tmp_path / "c.toml")
    assert code == 0, err
    assert load_config(tmp_path / "c.toml").train.expert_switch_every == 1
    # the image-to-video archs: both I2V A14B experts, and Wan 2.1 I2V 14B (its size after ':')
    for n, (arch, variant) in enumerate((("wan22_14b_i2v", "2.2-i2v-a14b"),
                                         ("wan21_i2v:14b480p", "2.1-i2v-14b"))):
        (tmp_path / f"i{n}.yaml").write_text(job.replace("ARCH", arch).replace(
            "IMAGES", images.as_posix()), encoding="utf-8")
        code, _, err = _import(capsys, "ai-toolkit", tmp_path / f"i{n}.yaml", "--out",
                               tmp_path / f"i{n}.toml")
        assert code == 0, err
        cfg = load_config(tmp_path / f"i{n}.toml")
        assert (cfg.model.family, cfg.model.variant) == ("wan", variant)
