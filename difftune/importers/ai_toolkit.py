"""ai-toolkit (ostris): a YAML job whose `config.process[0]` is an sd_trainer / ui_trainer with
`network`, `save`, `datasets`, `train`, `model` and `sample` tables."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from difftune.errors import ConfigError
from difftune.families import registry
from difftune.importers.notes import USED, Drop, NoEquivalent, Rule, To, Translation, src
from difftune.importers.values import (dtype, family, model_source, number, optimizer,
                                       optimizer_args, put_path, scheduler, sides, tables)
from difftune.importers.prompts import write_prompts

TRAINERS = ("sd_trainer", "ui_trainer", "diffusion_trainer")
# Older configs name the architecture by a flag instead of model.arch.
FLAGS = ("is_flux", "is_xl", "is_v3", "is_v2", "is_lumina2", "is_pixart", "is_pixart_sigma",
         "is_auraflow")  # each a name in the family tables (importers/families.py)
QUANT = {"qfloat8": "qfloat8", "float8": "fp8", "qint8": "qint8", "int8": "int8",
         "uint4": "nf4", "qint4": "nf4"}
TIMESTEPS = {"sigmoid": "sigmoid", "linear": "uniform", "shift": "shift",
             "flux_shift": "flux_shift"}
DEVICE = Drop("difftune picks the device (train.device = \"auto\": cuda when there is one)")
SD = USED


def _convert(table: dict[str, str], what: str) -> Any:
    def convert(value: Any) -> str:
        text = str(value).split("|")[0]  # qtype may name an adapter after a "|"
        if text not in table:
            raise NoEquivalent(f"difftune has no {what} {text!r}; it keeps its default")
        return table[text]
    return convert


def _ext(value: Any) -> str:
    return str(value) if str(value).startswith(".") else f".{value}"


def _quantize(t: Translation, key: str, value: Any, where: str) -> None:
    """quantize / quantize_te: on with qtype (ai-toolkit's default qfloat8)."""
    part = "text_encoders" if key.endswith("_te") else "denoiser"
    if value:
        model = t.context["model"]
        qtype = model.get("qtype_te" if part == "text_encoders" else "qtype", "qfloat8")
        t.rule(To(f"precision.quantize.{part}", _convert(QUANT, "quantization")),
               f"{key} = true, qtype", qtype)
    else:
        t.drop(f"{key} = false", "the default", builtin=True)


def _model(t: Translation, key: str, value: Any, where: str) -> None:
    model_source(t, value, src(key, value), t.base)


# model.model_kwargs of a two-stage model (wan22_14b): which stages train (both by default).
STAGES = {"train_high_noise": "high", "train_low_noise": "low"}


def _model_kwargs(t: Translation, key: str, value: Any, where: str) -> None:
    """A two-stage model's train_high_noise / train_low_noise are train.experts; other model
    kwargs are noted one by one."""
    kwargs = dict(value or {})
    given = {k: kwargs.pop(k) for k in STAGES if k in kwargs}
    if given:
        chosen = [name for k, name in STAGES.items() if given.get(k, True)]
        t.put("train.experts", chosen, ", ".join(src(f"model.{key}.{k}", v)
                                                 for k, v in given.items()))
    t.apply({}, kwargs, prefix=f"model.{key}.")


def _ema(t: Translation, key: str, value: Any, where: str) -> None:
    table = {"use_ema": To("train.ema.enabled"), "ema_decay": To("train.ema.decay")}
    t.apply(table, value or {}, prefix="train.ema_config.")


def _optimizer_params(t: Translation, key: str, value: Any, where: str) -> None:
    optimizer_args(t, dict(value or {}), f"train.{key}")


def _sampling_off(t: Translation, key: str, value: Any, where: str) -> None:
    if value:
        t.put("sample.at_end", False, f"train.{key} = true")
    else:
        t.drop(f"train.{key} = false", "the default", builtin=True)


def _first(t: Translation, key: str, value: Any, where: str) -> None:
    t.put("sample.at_start", not value, f"train.{key} = {str(value).lower()}")


NETWORK: dict[str, Rule] = {
    "type": To("adapter.type", _convert({"lora": "lora", "locon": "locon", "lokr": "lokr"},
                                        "network type")),
    "linear": To("adapter.rank"), "rank": To("adapter.rank"),
    "linear_alpha": To("adapter.alpha"), "alpha": To("adapter.alpha"),
    "conv": To("adapter.conv_rank"), "conv_alpha": To("adapter.conv_alpha"),
    "dropout": To("adapter.dropout"), "lokr_factor": To("adapter.factor"),
    "lokr_full_rank": Drop("difftune's LoKr is low-rank unless adapter.full_matrix = true"),
    "transformer_only": Drop("difftune trains the denoiser only unless adapter.text_encoders "
                             "names encoders", builtin=True),
    "network_kwargs": Drop("difftune picks layers by adapter.targets / target_modules"),
}
SAVE: dict[str, Rule] = {
    "dtype": To("save.dtype", dtype), "save_every": To("save.every_n_steps"),
    "max_step_saves_to_keep": To("save.keep_last"),
    "save_format": Drop("difftune writes .safetensors", builtin=True),
    "push_to_hub": Drop("difftune does not upload"), "hf_repo_id": Drop("difftune does not "
                                                                        "upload"),
    "hf_private": Drop("difftune does not upload"),
}
DATASET: dict[str, Rule] = {
    "caption_ext": To("datasets.{}.caption_ext", _ext),
    "caption_dropout_rate": To("datasets.{}.caption_dropout_rate"),
    "shuffle_tokens": To("datasets.{}.shuffle_caption"),
    "token_dropout_rate": To("datasets.{}.caption_tag_dropout_rate"),
    "keep_tokens": To("datasets.{}.keep_tokens"),
    "resolution": To("datasets.{}.resolution", sides),
    "num_repeats": To("datasets.{}.repeats"), "default_caption": To("datasets.{}."
                                                                   "default_caption"),
    "is_reg": To("datasets.{}.regularization"), "flip_x": To("datasets.{}.flip"),
    "random_crop": To("datasets.{}.crop", lambda v: "random" if v else "center"),
    "buckets": To("datasets.{}.buckets"), "alpha_mask": To("datasets.{}.alpha_mask"),
    "loss_multiplier": To("datasets.{}.loss_weight"),
    "cache_latents_to_disk": To("cache.latents", lambda v: "disk" if v else "memory"),
    "cache_latents": Drop("difftune caches latents in memory by default", builtin=True),
    "flip_y": Drop("difftune flips horizontally only"),
    "num_workers": Drop("difftune loads data in the training process"),
}
TRAIN: dict[str, Rule] = {
    "batch_size": To("train.batch_size"), "steps": To("train.steps"),
    "gradient_accumulation_steps": To("train.grad_accum"),
    "gradient_accumulation": To("train.grad_accum"), "lr": To("train.lr", number),
    "unet_lr": To("train.lr", number), "text_encoder_lr": To("adapter.text_encoder_lr", number),
    "optimizer": To("train.optimizer", optimizer), "optimizer_params": _optimizer_params,
    "lr_scheduler": To("train.scheduler", scheduler),
    "gradient_checkpointing": To("train.gradient_checkpointing"),
    "max_grad_norm": To("train.max_grad_norm"), "noise_offset": To("train.noise_offset"),
    "min_snr_gamma": To("train.min_snr_gamma"),
    "timestep_type": To("train.timesteps", _convert(TIMESTEPS, "timestep type")),
    "loss_type": To("train.loss", _convert({"mse": "l2", "huber": "huber"}, "loss")),
    "dtype": To("precision.mixed", _convert({"bf16": "bf16", "fp16": "fp16", "fp32": "no",
                                             "float32": "no"}, "dtype")),
    "ema_config": _ema, "skip_first_sample": _first, "disable_sampling": _sampling_off,
    "unload_text_encoder": To("cache.unload_text_encoders"),
    "cache_text_embeddings": Drop("difftune caches text embeddings in memory by default "
                                  "(cache.text)", builtin=True),
    "train_unet": Drop("difftune always trains the denoiser", builtin=True),
    "train_text_encoder": Drop("difftune trains text encoders named in adapter.text_encoders"),
    "noise_scheduler": Drop("difftune trains each family by its own objective", builtin=True),
    "content_or_style": Drop("difftune draws timesteps by train.timesteps"),
    "linear_timesteps": Drop("difftune draws timesteps by train.timesteps"),
    "switch_boundary_every": To("train.expert_switch_every", guess=(
        "ai-toolkit switches experts between micro-batches, difftune between optimizer steps "
        "(the same without gradient accumulation)")),
    "diff_output_preservation": USED,
    "diff_output_preservation_multiplier": To("preservation.weight"),
    "diff_output_preservation_class": To("preservation.replacement"),
}
MODEL: dict[str, Rule] = {
    "name_or_path": _model, "arch": SD, **{flag: SD for flag in FLAGS},
    "quantize": _quantize, "quantize_te": _quantize,
    "qtype": USED, "qtype_te": USED, "model_kwargs": _model_kwargs,
    "low_vram": Drop("difftune's memory savers: train.blocks_to_swap, cache.offload"),
    "layer_offloading": Drop("difftune's memory saver is train.blocks_to_swap"),
    "assistant_lora_path": Drop("difftune trains without an assistant LoRA; train on a base "
                                "(not distilled) model"),
}
SAMPLE: dict[str, Rule] = {
    "sample_every": To("sample.every_n_steps"), "width": To("sample.width"),
    "height": To("sample.height"), "seed": To("sample.seed"),
    "guidance_scale": To("sample.guidance"), "sample_steps": To("sample.steps"),
    "prompts": USED, "neg": USED,
    "samples": USED,
    "sampler": Drop("difftune samples with each family's pipeline scheduler", builtin=True),
    "walk_seed": Drop("difftune samples each prompt at its own --d seed (sample.seed)"),
    "sample_start_step": Drop("difftune samples every N steps from the start"),
}
PROCESS: dict[str, Rule] = {
    "type": USED,
    "device": DEVICE, "performance_log_every": Drop("difftune logs every train.log_every"),
    "logging": Drop("difftune writes metrics.jsonl and TensorBoard files into save.dir"),
    "training_folder": USED,
    "trigger_word": USED,
}
# ai-toolkit's defaults where difftune's differ (an alpha of 1, not the rank).
DEFAULTS = {"network": {"linear_alpha": 1.0},
            "train": {"lr": 1e-6, "steps": 1000, "gradient_checkpointing": True},
            "save": {"dtype": "float16", "save_every": 1000, "max_step_saves_to_keep": 5}}
TABLES = {"network": NETWORK, "save": SAVE, "train": TRAIN, "model": MODEL, "sample": SAMPLE}


def parse(text: str) -> dict[str, Any]:
    """The file's YAML (ValueError for bad syntax or a file that is no mapping)."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ValueError(f"not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ValueError("not a YAML mapping")
    return data


def translate(data: dict[str, Any], path: Path, t: Translation) -> None:
    """Fill `t` from an ai-toolkit training job."""
    process = _process(data, path)
    t.context["model"] = process.get("model") or {}
    if t.get("model.family") is None:
        model = t.context["model"]
        arch = model.get("arch") or next((f for f in FLAGS if model.get(f)), None)
        source = src("model.arch", arch) if model.get("arch") else "model.is_* flag"
        if arch is None:
            raise ConfigError(f"{path}: model.arch is not set (nor an is_flux-style flag); "
                              "pass --family")
        family(t, str(arch).split(":")[0], source, path)
    _defaults(t, process)
    name = str(data["config"].get("name", "lora"))
    _save(t, process, name)
    for key, value in process.items():
        if key in TABLES and isinstance(value, dict):
            t.apply(TABLES[key], value, prefix=f"{key}.")
        elif key != "datasets":
            t.rule(PROCESS.get(key), key, value)
    _datasets(t, process, path)
    _preservation(t, process)
    write_prompts(t, process.get("sample") or {}, str(process.get("trigger_word") or ""))
    for key in data:
        if key not in ("job", "config"):
            t.drop(f"{key} = ...", "ai-toolkit's own metadata")


def _defaults(t: Translation, process: dict[str, Any]) -> None:
    """ai-toolkit's defaults where difftune's differ, for the keys the job leaves out (a
    two-stage model's: experts switched every step)."""
    every = dict(DEFAULTS)
    if registry.spec(str(t.get("model.family")), t.get("model.variant")).experts:
        every["train"] = {**DEFAULTS["train"], "switch_boundary_every": 1}
    for section, defaults in every.items():
        table = process.setdefault(section, {})
        if isinstance(table, dict):
            given = {k: v for k, v in defaults.items()
                     if not (k == "linear_alpha" and "alpha" in table)}
            t.fill(table, given, f"{section}.")


def _process(data: dict[str, Any], path: Path) -> dict[str, Any]:
    """The trainer process, or a clear refusal of any other file."""
    processes = (data.get("config") or {}).get("process") if isinstance(data.get("config"),
                                                                         dict) else None
    if not isinstance(processes, list) or not processes or not isinstance(processes[0], dict):
        raise ConfigError(f"{path} is not an ai-toolkit job: it has no config.process list")
    kind = processes[0].get("type")
    if kind not in TRAINERS:
        raise ConfigError(f"{path}: config.process[0].type = {kind!r} is not an ai-toolkit "
                          f"training process ({', '.join(TRAINERS)})")
    return processes[0]


def _save(t: Translation, process: dict[str, Any], name: str) -> None:
    """save.dir and save.name: ai-toolkit writes into <training_folder>/<name>."""
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", name) or "lora"
    folder = str(Path(process.get("training_folder", "output")) / name)
    put_path(t, "save.dir", folder, src("training_folder/config.name", folder), t.base)
    t.put("save.name", stem, src("config.name", name),
          None if stem == name else "characters a file name cannot hold became _")


def _datasets(t: Translation, process: dict[str, Any], path: Path) -> None:
    """Each ai-toolkit dataset is one difftune dataset of one folder; the trigger word, which
    ai-toolkit adds to captions lacking it, becomes each dataset's caption prefix."""
    trigger = process.get("trigger_word")
    for d, dataset in enumerate(tables(process.get("datasets"), "datasets", path)):
        where = str(d)
        if "folder_path" in dataset:
            put_path(t, f"datasets.{d}.path", dataset["folder_path"],
                     src(f"datasets[{d}].folder_path", dataset["folder_path"]), t.base)
        if "control_path" in dataset:
            put_path(t, f"datasets.{d}.control_path", dataset["control_path"],
                     src(f"datasets[{d}].control_path", dataset["control_path"]), t.base)
        rest = {k: v for k, v in dataset.items() if k not in ("folder_path", "control_path")}
        t.apply(DATASET, rest, where, prefix=f"datasets[{d}].")
        if trigger:
            t.put(f"datasets.{d}.caption_prefix", str(trigger), src("trigger_word", trigger),
                  "ai-toolkit adds the trigger word only to captions without it (and replaces "
                  "[trigger]); difftune's caption_prefix adds it to every caption")


def _preservation(t: Translation, process: dict[str, Any]) -> None:
    """ai-toolkit's differential output preservation is difftune's [preservation]."""
    train, trigger = process.get("train") or {}, process.get("trigger_word")
    if train.get("diff_output_preservation") and trigger:
        t.put("preservation.trigger", str(trigger), "train.diff_output_preservation = true")
