"""OneTrainer: a saved training config (JSON, TrainConfig's fields by name), its concepts
(inline `concepts` or the `concept_file_name` file) and its samples.

A saved config lists every field, most at their defaults; keys set to off or empty carry
nothing over and are counted in one line instead of listed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from difftune.errors import ConfigError
from difftune.importers.notes import USED, Drop, NoEquivalent, Rule, To, Translation, src
from difftune.importers.onetrainer_parts import (LAYER_SKIPS, OFF, concepts, layer_skips,
                                                 parts, samples, schedule_every)
from difftune.importers.values import (dtype, family, model_source, optimizer, optimizer_args,
                                       put_path, scheduler, sides, steps_from_epochs)

OWN = Drop("OneTrainer's own setting (its UI, logging, devices, backups or cloud)")
MIXED = {"BFLOAT_16": "bf16", "FLOAT_16": "fp16", "FLOAT_32": "no"}
METHODS = {"LORA": "lora", "FINE_TUNE": "full"}
PEFT = {"LORA": "lora", "LOHA": "loha", "LOKR": "lokr"}
PRESETS = {"attn-only": "attention", "attn-mlp": "attention_mlp", "full": "all_linear"}
TIMESTEPS = {"UNIFORM": "uniform", "LOGIT_NORMAL": "sigmoid"}
# OneTrainer's defaults (TrainConfig.default_values) where difftune's differ: a saved preset
# leaves out what it does not change, and OneTrainer then trains with these.
DEFAULTS = {"training_method": "FINE_TUNE", "learning_rate": 3e-6, "epochs": 100,
            "batch_size": 1, "resolution": "512", "lora_rank": 16, "lora_alpha": 1.0,
            "learning_rate_warmup_steps": 200.0, "train_dtype": "FLOAT_16",
            "timestep_distribution": "UNIFORM", "output_model_destination":
            "models/model.safetensors", "output_dtype": "FLOAT_32"}
# OneTrainer's model parts -> difftune's precision part (text encoders by their order).
PARTS = {"transformer": "denoiser", "unet": "denoiser", "prior": "denoiser", "vae": "vae",
         "text_encoder": "text_encoders:0", "text_encoder_2": "text_encoders:1",
         "text_encoder_3": "text_encoders:2", "text_encoder_4": "text_encoders:3"}


def _table(table: dict[str, str], what: str) -> Any:
    def convert(value: Any) -> str:
        if str(value) not in table:
            raise NoEquivalent(f"difftune has no {what} {value!r}; it keeps its default")
        return table[str(value)]
    return convert


def _model(t: Translation, key: str, value: Any, where: str) -> None:
    model_source(t, value, src(key, value), t.base)


def _destination(t: Translation, key: str, value: Any, where: str) -> None:
    """output_model_destination: the file's folder is save.dir, its stem save.name."""
    path = Path(str(value))
    put_path(t, "save.dir", path.parent.as_posix() or ".", src(key, value), t.base)
    t.put("save.name", path.stem or "lora", src(key, value))


def _ema(t: Translation, key: str, value: Any, where: str) -> None:
    if value in ("GPU", "CPU"):
        t.put("train.ema.enabled", True, src(key, value))
        t.put("train.ema.cpu", value == "CPU", src(key, value))
    else:
        t.drop(src(key, value), "the default (no EMA)", builtin=True)


def _optimizer(t: Translation, key: str, value: Any, where: str) -> None:
    """The optimizer table: its name, the shared options, the rest where difftune's takes them."""
    value = dict(value or {})
    t.rule(To("train.optimizer", optimizer), f"{key}.optimizer", value.pop("optimizer", "ADAMW"))
    betas = [value.pop(b, None) for b in ("beta1", "beta2")]
    if None not in betas:
        t.put("train.betas", betas, f"{key}.beta1, beta2 = {betas}")
    given = {k: v for k, v in value.items() if v not in (None, False, 0, "", [], {})}
    optimizer_args(t, {k: v for k, v in given.items() if k in ("weight_decay", "eps")}, key)
    rest = {k: v for k, v in given.items() if k not in ("weight_decay", "eps")}
    if rest:
        optimizer_args(t, rest, key)


def _gradient_checkpointing(value: Any) -> bool:
    return value not in (False, "OFF", None)


def _layers(t: Translation, key: str, value: Any, where: str) -> None:
    t.rule(To("adapter.targets", _table(PRESETS, "layer preset"),
              guess="OneTrainer's preset chooses layers by name; difftune's targets are the "
                    "family's own sets of the same kind"), key, value)


ARGS: dict[str, Rule] = {
    "model_type": USED,
    "base_model_name": _model,
    "training_method": To("adapter.type", _table(METHODS, "training method")),
    "peft_type": To("adapter.type", _table(PEFT, "PEFT type")),
    "lora_rank": To("adapter.rank"), "lora_alpha": To("adapter.alpha"),
    "lora_decompose": To("adapter.dora"), "dropout_probability": To("adapter.dropout"),
    "lokr_decompose_both": To("adapter.decompose_both"),
    "lokr_decompose_factor": To("adapter.factor"), "lokr_full_matrix": To("adapter.full_matrix"),
    "layer_filter_preset": _layers,
    "layer_filter": Drop("difftune picks layers by adapter.targets / target_modules"),
    "learning_rate": To("train.lr"),
    "learning_rate_scheduler": To("train.scheduler", scheduler),
    "learning_rate_warmup_steps": To("train.warmup_steps", int),
    "learning_rate_cycles": Drop("difftune's cosine decays once"),
    "learning_rate_min_factor": Drop("difftune's schedules decay to 0"),
    "epochs": USED,
    "batch_size": To("train.batch_size"),
    "gradient_accumulation_steps": To("train.grad_accum"),
    "optimizer": _optimizer, "clip_grad_norm": To("train.max_grad_norm"),
    "train_dtype": To("precision.mixed", _table(MIXED, "train dtype")),
    "ema": _ema, "ema_decay": To("train.ema.decay"),
    "ema_update_step_interval": To("train.ema.every_n_steps"),
    "timestep_distribution": To("train.timesteps", _table(TIMESTEPS, "timestep distribution")),
    "dynamic_timestep_shifting": To("train.timesteps", lambda v: "flux_shift",
                                    guess="resolution-dependent shift is difftune's "
                                          "flux_shift"),
    "gradient_checkpointing": To("train.gradient_checkpointing", _gradient_checkpointing),
    "compile": To("train.compile"),
    "offset_noise_weight": To("train.noise_offset"),
    "rescale_noise_scheduler_to_zero_terminal_snr": To("train.zero_terminal_snr"),
    "force_v_prediction": To("train.prediction", lambda v: "v_prediction"),
    "force_epsilon_prediction": To("train.prediction", lambda v: "epsilon"),
    "output_model_destination": _destination, "output_dtype": To("save.dtype", dtype),
    "output_model_format": Drop("difftune writes .safetensors in its save.format",
                                builtin=True),
    "resolution": USED,
    "aspect_ratio_bucketing": USED,
    "latent_caching": To("cache.latents", lambda v: "memory" if v else "none"),
    "concept_file_name": USED,
    "concepts": USED,
    "sample_definition_file_name": USED,
    "samples": USED,
    "sample_after": USED,
    "sample_after_unit": schedule_every("sample.every_n_steps", "sample_after"),
    "save_every": USED,
    "save_every_unit": schedule_every("save.every_n_steps", "save_every"),
    "masked_training": Drop("OneTrainer's -masklabel images: put the masks in a folder of their "
                            "own and set the subset's mask_path"),
    "weight_dtype": Drop("difftune sets storage per part (precision.denoiser, text_encoders, vae)"),
    "quantization": Drop("difftune quantizes by precision.quantize, per part"),
    "workspace_dir": Drop("difftune writes samples and checkpoints into save.dir"),
    "cache_dir": Drop("difftune's disk caches go to cache.dir (default: inside save.dir)"),
    "backup_after": OWN, "backup_after_unit": OWN, "rolling_backup": OWN,
    "rolling_backup_count": OWN, "backup_before_save": OWN, "tensorboard": OWN,
    "train_device": OWN, "temp_device": OWN, "dataloader_threads": OWN, "debug_mode": OWN,
    "debug_dir": OWN, "secrets": OWN, "cloud": OWN, "__version": OWN, "multi_gpu": OWN,
    "device_indexes": OWN, "continue_last_backup": OWN, "huggingface_cache_dir": OWN,
    "samples_to_tensorboard": OWN, "sample_image_format": OWN, "non_ema_sampling": OWN,
    "attention_mechanism": Drop("difftune uses PyTorch's scaled-dot-product attention",
                                builtin=True),
}


def parse(text: str) -> dict[str, Any]:
    """The file's JSON (ValueError for bad syntax, or a list: a concepts or samples file)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise ValueError("a JSON list, not a training config (a concepts or samples file? "
                         "import the training config that names it)")
    return data


def translate(data: dict[str, Any], path: Path, t: Translation) -> None:
    """Fill `t` from a OneTrainer training config."""
    if not {"model_type", "training_method", "base_model_name"} & set(data):
        raise ConfigError(f"{path} is not a OneTrainer training config: it has none of "
                          "model_type, training_method, base_model_name")
    t.fill(data, DEFAULTS)
    t.context["source"] = data
    if t.get("model.family") is None:
        name = str(data.get("model_type", "STABLE_DIFFUSION_15"))
        family(t, name, src("model_type", name), path)
    off = 0
    layer_skips(t, data)
    for key, value in data.items():
        if key in LAYER_SKIPS and value not in OFF:
            continue  # read above
        if key in ARGS:
            t.rule(ARGS[key], key, value)
        elif isinstance(value, dict) and key in PARTS:
            parts(t, key, value, PARTS[key])
        elif key.startswith("text_encoder"):
            t.drop(src(key, value), "difftune encodes text as each family's pipeline does")
        elif value in (None, False, 0, "", [], {}):
            off += 1
        else:
            t.unknown(src(key, value))
    if off:
        t.drop(f"{off} keys set to off, zero or empty", "nothing to carry over", builtin=True)
    concepts(t, data, path)
    for d in range(len(t.get("datasets", []))):
        if "resolution" in data:
            t.rule(To("datasets.{}.resolution", sides), "resolution", data["resolution"], str(d))
        if "aspect_ratio_bucketing" in data:
            t.put(f"datasets.{d}.buckets", bool(data["aspect_ratio_bucketing"]),
                  src("aspect_ratio_bucketing", data["aspect_ratio_bucketing"]))
    samples(t, data, path)
    if "epochs" in data:
        label = "epochs" + (" (OneTrainer's default)" if "epochs" in t.defaulted else "")
        steps_from_epochs(t, int(data["epochs"]), src(label, data["epochs"]))
