"""kohya sd-scripts: a training config (the TOML `--config_file` of train_network.py,
sdxl_/sd3_/flux_train_network.py: their command-line arguments by name, sections flattened),
with the dataset config it names (`dataset_config`) or its `train_data_dir` folders."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from difftune.errors import ConfigError
from difftune.families import registry
from difftune.importers import kohya_data, kohya_script
from difftune.importers.families import GUESSED, KOHYA, KOHYA_KEYS
from difftune.importers.notes import USED, Drop, NoEquivalent, Rule, To, Translation, src
from difftune.importers.values import (dtype, family, model_source, optimizer,
                                       optimizer_args, parse_kv, put_path, scheduler,
                                       steps_from_epochs)

LOGGING = Drop("difftune writes metrics.jsonl and TensorBoard files into save.dir")
LOADER = Drop("difftune loads data in the training process")
ATTENTION = Drop("difftune uses PyTorch's scaled-dot-product attention", builtin=True)
# sd-scripts' defaults where difftune's differ (a config leaving them out trains with these).
DEFAULTS = {"network_dim": 4, "network_alpha": 1, "learning_rate": 2e-6}
TIMESTEPS = {"uniform": "uniform", "sigmoid": "sigmoid", "shift": "shift",
             "flux_shift": "flux_shift"}
LOSSES = {"l2": "l2", "huber": "huber", "smooth_l1": "smooth_l1"}


def _timesteps(value: Any) -> str:
    if value not in TIMESTEPS:
        raise NoEquivalent("difftune draws timesteps uniform, sigmoid (logit-normal), shift "
                           "or flux_shift; it keeps its sigmoid default (train.timesteps)")
    return TIMESTEPS[value]


def _loss(value: Any) -> str:
    if value not in LOSSES:
        raise NoEquivalent("difftune's losses are l2, huber and smooth_l1 (train.loss)")
    return LOSSES[value]


def _precision(value: Any) -> str:
    if value not in ("no", "fp16", "bf16"):
        raise NoEquivalent("difftune's precision.mixed is no, fp16 or bf16")
    return value


def _model(t: Translation, key: str, value: Any, where: str) -> None:
    model_source(t, value, src(key, value), t.base)


def _file(dst: str) -> Any:
    def rule(t: Translation, key: str, value: Any, where: str) -> None:
        put_path(t, dst, value, src(key, value), t.base)
    return rule


def _fp8(t: Translation, key: str, value: Any, where: str) -> None:
    if value:
        t.put("precision.denoiser", "fp8", f"{key} = true")
    else:
        t.drop(f"{key} = false", "the default", builtin=True)


def _cache(dst: str, kind: str) -> Any:
    """cache_latents(_to_disk) / cache_text_encoder_outputs(_to_disk): memory or disk."""
    def rule(t: Translation, key: str, value: Any, where: str) -> None:
        if value and (kind == "disk" or t.get(dst) != "disk"):
            t.put(dst, kind, f"{key} = true")
        else:
            t.drop(f"{key} = {str(value).lower()}", f"difftune caches in memory by default "
                   f"({dst} = \"memory\"); \"none\" turns it off", builtin=True)
    return rule


def _optimizer_args(t: Translation, key: str, value: Any, where: str) -> None:
    optimizer_args(t, parse_kv(value), key)


def _network_args(t: Translation, key: str, value: Any, where: str) -> None:
    """network_args "k=v" strings: LyCORIS's algo, conv and DoRA options; the rest dropped."""
    for name, arg in parse_kv(value).items():
        t.rule(NETWORK_ARGS.get(name), f"{key}.{name}", arg)


def _warmup(t: Translation, key: str, value: Any, where: str) -> None:
    """lr_warmup_steps: steps, or (below 1) a fraction of the run's steps."""
    if isinstance(value, float) and value < 1:
        steps = int(value * int(t.get("train.steps", 1000)))
        t.put("train.warmup_steps", steps, f"{key} = {value}", "a fraction of train.steps")
    else:
        t.put("train.warmup_steps", int(value), f"{key} = {value}")


def _clip_skip(t: Translation, key: str, value: Any, where: str) -> None:
    """clip_skip N: train_network.py (SD 1.x) reads CLIP's `hidden_states[-N]` through its final
    layer norm, which is difftune's model.clip_skip = N - 1 where the family reads CLIP's last
    hidden state (spec.py); the other scripts ignore it (SDXL's reads the penultimate state
    whatever N is), so it is dropped there."""
    spec = registry.spec(t.get("model.family"), t.get("model.variant"))
    if not any(e.is_clip and e.hidden == "last" for e in spec.text_encoders):
        t.drop(src(key, value), "difftune reads the hidden state each family's pipeline reads; "
               "model.clip_skip skips more beyond it")
    elif int(value) <= 1:
        t.drop(src(key, value), "CLIP's last hidden state, which difftune reads by default",
               builtin=True)
    else:
        t.put("model.clip_skip", int(value) - 1, src(key, value))  # kohya's 1 is the last


NETWORK_ARGS: dict[str, Rule] = {
    "algo": To("adapter.type", lambda v: _algo(v)),
    "conv_dim": To("adapter.conv_rank"), "conv_alpha": To("adapter.conv_alpha"),
    "dora_wd": To("adapter.dora"), "factor": To("adapter.factor"),
    "decompose_both": To("adapter.decompose_both"), "full_matrix": To("adapter.full_matrix"),
    "dropout": To("adapter.dropout"),
}


def _algo(value: Any) -> str:
    """LyCORIS's algo as difftune's adapter.type."""
    if value not in ("lora", "locon", "loha", "lokr"):
        raise NoEquivalent(f"difftune trains lora, locon, loha and lokr, not {value!r}")
    return str(value)


ARGS: dict[str, Rule] = {
    "pretrained_model_name_or_path": _model,
    "ae": _file("model.vae"), "vae": _file("model.vae"), "clip_l": _file("model.clip_l"),
    "t5xxl": _file("model.t5"),
    "qwen3": _file("model.text_encoder"),  # anima_train_network.py's Qwen3 file
    "clip_g": Drop("difftune reads SD3's CLIP-G from model.path (a diffusers folder)"),
    "network_module": USED,
    "model_type": USED,
    "v2": USED, kohya_script.GUI_FLAG: USED,  # which script networks.lora is for (kohya_script)
    "network_dim": To("adapter.rank"), "network_alpha": To("adapter.alpha"),
    "network_dropout": To("adapter.dropout"), "network_args": _network_args,
    "network_weights": Drop("start from a LoRA with `difftune train --init-lora FILE`"),
    "network_train_unet_only": Drop("difftune trains the denoiser only unless "
                                    "adapter.text_encoders names encoders", builtin=True),
    "learning_rate": To("train.lr"), "unet_lr": To("train.lr"),
    "text_encoder_lr": To("adapter.text_encoder_lr",
                          lambda v: v[0] if isinstance(v, list) else v),
    "optimizer_type": To("train.optimizer", optimizer), "optimizer_args": _optimizer_args,
    "lr_scheduler": To("train.scheduler", scheduler), "lr_warmup_steps": _warmup,
    "lr_scheduler_num_cycles": Drop("difftune's cosine decays once"),
    "max_train_steps": To("train.steps"),
    "train_batch_size": To("train.batch_size"),
    "gradient_accumulation_steps": To("train.grad_accum"),
    "max_grad_norm": To("train.max_grad_norm"),
    "gradient_checkpointing": To("train.gradient_checkpointing"),
    "seed": To("train.seed"), "blocks_to_swap": To("train.blocks_to_swap"),
    "fused_backward_pass": To("train.fused_backward"), "torch_compile": To("train.compile"),
    "mixed_precision": To("precision.mixed", _precision),
    "full_bf16": Drop("difftune keeps trained weights in fp32 under bf16 autocast"),
    "full_fp16": Drop("difftune keeps trained weights in fp32 under fp16 autocast"),
    "fp8_base": _fp8, "fp8_base_unet": _fp8,
    "timestep_sampling": To("train.timesteps", _timesteps),
    "sigmoid_scale": To("train.sigmoid_std"), "discrete_flow_shift": To("train.shift"),
    "guidance_scale": To("train.guidance"), "apply_t5_attn_mask": To("model.t5_mask"),
    "model_prediction_type": Drop("difftune trains on the model's raw prediction (kohya's "
                                  "\"raw\")"),
    "t5xxl_max_token_length": Drop("difftune uses each family's pipeline token length"),
    "weighting_scheme": Drop("difftune draws timesteps by train.timesteps, unweighted"),
    "clip_skip": _clip_skip,
    "noise_offset": To("train.noise_offset"), "min_snr_gamma": To("train.min_snr_gamma"),
    "zero_terminal_snr": To("train.zero_terminal_snr"),
    "v_parameterization": To("train.prediction", lambda v: "v_prediction" if v else "auto"),
    "loss_type": To("train.loss", _loss), "huber_c": To("train.huber_delta"),
    "huber_schedule": To("train.huber_schedule"),
    "output_dir": _file("save.dir"), "output_name": To("save.name"),
    "save_every_n_steps": To("save.every_n_steps"), "save_precision": To("save.dtype", dtype),
    "save_model_as": Drop("difftune writes .safetensors", builtin=True),
    "save_state": Drop("difftune writes a resume checkpoint with each save", builtin=True),
    "save_every_n_epochs": Drop("difftune saves every N steps (save.every_n_steps)"),
    "save_last_n_steps": Drop("difftune keeps the K newest checkpoints (save.keep_last)"),
    "cache_latents": _cache("cache.latents", "memory"),
    "cache_latents_to_disk": _cache("cache.latents", "disk"),
    "cache_text_encoder_outputs": _cache("cache.text", "memory"),
    "cache_text_encoder_outputs_to_disk": _cache("cache.text", "disk"),
    "sample_prompts": _file("sample.prompts"),
    "sample_every_n_steps": To("sample.every_n_steps"), "sample_at_first": To("sample.at_start"),
    "sample_every_n_epochs": Drop("difftune samples every N steps (sample.every_n_steps)"),
    "sample_sampler": Drop("difftune samples with each family's pipeline scheduler"),
    "masked_loss": USED,
    "prior_loss_weight": Drop("set on the regularization subsets (loss_weight)"),
    "logging_dir": LOGGING, "log_with": LOGGING, "log_prefix": LOGGING,
    "log_tracker_name": LOGGING, "wandb_run_name": LOGGING, "wandb_api_key": LOGGING,
    "max_data_loader_n_workers": LOADER, "persistent_data_loader_workers": LOADER,
    "xformers": ATTENTION, "sdpa": ATTENTION, "mem_eff_attn": ATTENTION,
    "lowram": Drop("difftune loads weights memory-mapped", builtin=True),
    "highvram": Drop("difftune frees caches' models by cache.offload"),
    "dataset_config": USED,
    "train_data_dir": USED,
    "reg_data_dir": USED,
    "max_train_epochs": USED,
}


def parse(text: str) -> dict[str, Any]:
    """The file's TOML (ValueError for bad syntax)."""
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"not valid TOML: {err}") from None


def flatten(data: dict[str, Any]) -> dict[str, Any]:
    """kohya's read_config_from_file: the keys of every section at the top level."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        flat.update(value if isinstance(value, dict) else {key: value})
    return flat


def translate(data: dict[str, Any], path: Path, t: Translation) -> None:
    """Fill `t` from a kohya training config (and the datasets it names)."""
    if "datasets" in data and not set(flatten(data)) & set(ARGS):
        raise ConfigError(f"{path} is a kohya dataset config; import the training config "
                          "that names it (dataset_config = ...)")
    args = flatten(data)
    if not set(args) & set(ARGS):
        raise ConfigError(f"{path} is not a kohya sd-scripts training config: none of its "
                          "keys (pretrained_model_name_or_path, network_module, ...) is there")
    if t.get("model.family") is None:
        _family(t, args, path)
    t.fill(args, DEFAULTS if "max_train_epochs" in args else {**DEFAULTS,
                                                               "max_train_steps": 1600})
    if str(args.get("network_module", "")).startswith("lycoris"):
        t.put("adapter.type", "lora", src("network_module", args["network_module"]),
              "LyCORIS's algo (network_args) picks the kind; lora when it names none")
    t.apply(ARGS, {k: v for k, v in args.items()
                   if k not in kohya_data.SUBSET_RULES and k not in kohya_data.DATASET_RULES})
    _datasets(t, args, path)
    if "max_train_epochs" in args and "max_train_steps" not in args:
        steps_from_epochs(t, args["max_train_epochs"], f"max_train_epochs = "
                          f"{args['max_train_epochs']}")


def _family(t: Translation, args: dict[str, Any], path: Path) -> None:
    """model.family from the network module (one several scripts share: the script the
    config was written for, kohya_script.py), flux_train_network's model_type, or a key only
    one script takes."""
    module = args.get("network_module")
    shared = kohya_script.script(args, t.base, _resolution(args, path)) \
        if module in GUESSED else None
    if module == "networks.lora_flux" and args.get("model_type") in KOHYA:
        family(t, args["model_type"], src("model_type", args["model_type"]), path)
    elif shared is not None:
        family(t, shared[0], shared[1], path, shared[2])
    elif module in KOHYA:
        family(t, module, src("network_module", module), path, GUESSED.get(module))
    else:
        hint = next((k for k in KOHYA_KEYS if k in args), None)
        if hint is None:
            raise ConfigError(f"{path}: cannot tell which model this kohya config trains "
                              "(no network_module difftune knows); pass --family")
        family(t, KOHYA_KEYS[hint], f"{hint} = ...", path, f"only that script takes {hint}")


def _dataset_config(args: dict[str, Any], path: Path) -> tuple[dict[str, Any], Path]:
    """The dataset config `args` names (dataset_config, relative to `path`'s folder) and
    where it is; ConfigError when it cannot be read."""
    where = Path(args["dataset_config"]).expanduser()
    where = where if where.is_absolute() else (path.resolve().parent / where).resolve()
    try:
        return tomllib.loads(where.read_text(encoding="utf-8")), where
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
        raise ConfigError(f"{path}: dataset_config {where} cannot be read as TOML ({err}); "
                          "fix that file or the path") from None


def _resolution(args: dict[str, Any], path: Path) -> Any:
    """The training resolution a config gives: its own, else its dataset config's first
    dataset's (its own, else inherited from [general]); None when none is given or the dataset
    config is unreadable (that is said when the datasets are read)."""
    if "resolution" in args or "dataset_config" not in args:
        return args.get("resolution")
    try:
        config, _ = _dataset_config(args, path)
    except ConfigError:
        return None
    datasets = config.get("datasets") if isinstance(config.get("datasets"), list) else []
    tables = [*datasets[:1], config.get("general")]
    return next((d["resolution"] for d in tables if isinstance(d, dict) and "resolution" in d),
                None)


def _datasets(t: Translation, args: dict[str, Any], path: Path) -> None:
    """The datasets: a dataset config file, or train_data_dir folders with the arguments'
    dataset options."""
    if "dataset_config" in args:
        config, where = _dataset_config(args, path)
        kohya_data.from_config(t, config, args, where)
        return
    for key, reg in (("train_data_dir", False), ("reg_data_dir", True)):
        if key in args:
            kohya_data.from_folders(t, args, key, reg)
    if t.get("datasets"):
        kohya_data.subset_args(t, args)
        return
    for key, value in args.items():
        if key in kohya_data.SUBSET_RULES or key in kohya_data.DATASET_RULES:
            t.drop(src(key, value), "no dataset to apply it to")
