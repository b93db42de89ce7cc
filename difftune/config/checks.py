"""Cross-field checks of a run configuration, each returning the problems it finds.

`RunConfig` calls them when a config loads, so every conflict is reported at once, with the
dotted field and the fix, before anything heavy runs. What they know about a family comes from
its light spec (`families.registry.spec`, no torch), never from a table keyed by family name.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from difftune.config.base import QUANT_BACKENDS
from difftune.config.full import warn_ignored_full
from difftune.config.metrics import metrics_problems, metrics_warnings
from difftune.errors import ConfigError, ModelFileError
from difftune.families import registry
from difftune.files.names import COMFYUI_DORA, embedding_stem, name_too_long
from difftune.files.safe import is_pickle, pickle_refusal
from difftune.train.optimizers import specs as optimizer_specs

if TYPE_CHECKING:
    from difftune.config.run import RunConfig
    from difftune.config.adapter import AdapterConfig
    from difftune.config.sections import ModelConfig, PrecisionConfig, TrainConfig

log = logging.getLogger("difftune")


def text_encoder_problems(model: ModelConfig, adapter: AdapterConfig, fmt: str | None,
                          precision: PrecisionConfig | None = None) -> list[str]:
    """Text-encoder options the family cannot honour (unknown names, masks, skips, formats)."""
    family = model.family
    spec = registry.spec(family, model.variant)
    names = spec.encoder_names
    problems = [f"adapter.text_encoders: {n!r} is not a text encoder of model.family = "
                f"\"{family}\"; choose from {', '.join(names)}"
                for n in adapter.text_encoders if n not in names]
    if precision is not None and isinstance(precision.text_encoders, dict):
        problems += [f"precision.text_encoders: {n!r} is not a text encoder of model.family = "
                     f"\"{family}\"; choose from {', '.join(names)}"
                     for n in precision.text_encoders if n not in names]
    problems += [f"adapter.text_encoders: {n!r} of model.family = \"{family}\" cannot get a "
                 f"LoRA ({why}); remove it"
                 for n, why in spec.text_encoder_lora_refused
                 if n in adapter.text_encoders and adapter.type != "full"]
    if len(set(adapter.text_encoders)) != len(adapter.text_encoders):
        problems.append("adapter.text_encoders lists an encoder twice; list each once")
    if model.t5_mask and "t5" not in names:
        problems.append(f"model.t5_mask: model.family = \"{family}\" has no T5 encoder; remove it")
    if model.clip_skip and not spec.clip_hidden:
        problems.append(f"model.clip_skip: model.family = \"{family}\" reads no CLIP hidden "
                        "state (only CLIP's pooled output), so there is nothing to skip; remove it")
    refused = spec.kohya_text_encoders_refused
    if (fmt in ("kohya", "original") and adapter.text_encoders and refused is not None
            and adapter.type != "full"):
        problems.append(f"save.format = \"{fmt}\" cannot hold the text-encoder LoRA of "
                        f"model.family = \"{family}\" ({refused}); "
                        "use save.format = \"diffusers\" or train the denoiser only")
    return problems


def quantize_problems(p: PrecisionConfig, device: str) -> list[str]:
    """Quantization settings that cannot work here: conflicts, missing libraries, no CUDA."""
    import importlib.util

    problems = []
    for part in ("denoiser", "text_encoders"):
        q = getattr(p.quantize, part)
        if q == "none":
            continue
        if any(v == "fp8" for k, v in p.dtype_names().items() if k.startswith(part)):
            problems.append(f"precision.quantize.{part} = \"{q}\" and precision.{part} = "
                            "\"fp8\" both shrink the same weights; choose one")
        module, package = QUANT_BACKENDS[q]
        if importlib.util.find_spec(module.split(".")[0]) is None or (
                "." in module and importlib.util.find_spec(module) is None):
            problems.append(f"precision.quantize.{part} = \"{q}\" needs the {package} "
                            f"package; install it (pip install {package}) or choose another")
        if q == "nf4" and (device == "cpu" or not _cuda()):
            problems.append(f"precision.quantize.{part} = \"nf4\" needs a CUDA device "
                            "(bitsandbytes' 4-bit kernels); on this machine use \"int8\" or "
                            "\"qint8\"")
    return problems


def _cuda() -> bool:
    """Whether a CUDA device is there (torch imported only for the one setting that asks)."""
    import torch

    return torch.cuda.is_available()


def adapter_kind_problems(cfg: "RunConfig") -> list[str]:
    """LyCORIS-kind options the family or the file layout cannot honour."""
    a, spec = cfg.adapter, registry.spec(cfg.model.family, cfg.model.variant)
    problems = []
    if a.conv_rank is not None and not spec.conv_targets:
        problems.append(f"adapter.conv_rank: model.family = \"{cfg.model.family}\" has no "
                        "Conv2d layers to adapt (its denoiser is a transformer of Linear "
                        "layers), so conv options would do nothing; remove adapter.conv_rank "
                        "and adapter.conv_alpha")
    fmt = cfg.save.format
    if fmt is not None and fmt not in spec.formats:
        problems.append(f"save.format = \"{fmt}\" is not written for model.family = "
                        f"\"{cfg.model.family}\"; choose one of "
                        + ", ".join(f'"{f}"' for f in spec.formats))
    lycoris_layout = a.type in ("locon", "loha", "lokr") or a.dora
    if lycoris_layout and cfg.save.format is not None:
        problems.append(f"save.format = \"{cfg.save.format}\" chooses a plain LoRA layout; "
                        f"{'DoRA' if a.dora else a.type} files are written in the LyCORIS "
                        "layout ComfyUI and LyCORIS read; remove save.format")
    return problems + _dora_fp8_problems(cfg)


def _dora_fp8_problems(cfg: "RunConfig") -> list[str]:
    """DoRA on fp8-stored layers: peft computes DoRA's norm of the base weight plus the update
    in the weight's storage dtype, where float8 has no arithmetic (it fails when the adapter is
    added). Quantizing to fp8 (torchao) dequantizes instead, and works."""
    a, p = cfg.adapter, cfg.precision
    if not a.dora:
        return []
    table = isinstance(p.text_encoders, dict)
    parts = (["denoiser"] if p.denoiser == "fp8" else []) + sorted({
        f"text_encoders.{n}" if table else "text_encoders"
        for n in a.text_encoders if p.encoder_dtype(n) == "fp8"})
    return [f"adapter.dora with precision.{part} = \"fp8\": peft's DoRA cannot compute its "
            "weight norm on fp8-stored weights; store them in bf16, or quantize them instead "
            "(precision.quantize, e.g. \"fp8\" or \"int8\")" for part in parts]


def embedding_problems(cfg: "RunConfig") -> list[str]:
    """Textual-inversion settings that cannot work (checked at load, not mid-run)."""
    a, names = cfg.adapter, registry.spec(cfg.model.family, cfg.model.variant).encoder_names
    problems = []
    if a.type == "embedding" and not a.embeddings:
        problems.append("adapter.type = \"embedding\" needs at least one [[adapter.embeddings]] "
                        "table (name, tokens, init)")
    if a.type == "embedding" and a.text_encoders:
        problems.append("adapter.text_encoders trains text-encoder LoRAs, but adapter.type = "
                        "\"embedding\" trains no LoRA; use adapter.type = \"lora\" for both")
    seen = [e.name for e in a.embeddings]
    if len(set(seen)) != len(seen):
        problems.append("adapter.embeddings: a placeholder name is used twice; give each its own")
    problems += shared_file_problems(seen)
    for i, e in enumerate(a.embeddings):
        bad = [n for n in e.encoders or () if n not in names]
        if bad:
            problems.append(f"adapter.embeddings[{i}].encoders: {bad} not text encoders of "
                            f"model.family = \"{cfg.model.family}\"; choose from {', '.join(names)}")
    problems += _output_embedding_problems(cfg)
    refused = registry.spec(cfg.model.family, cfg.model.variant).embeddings_refused
    if a.embeddings and refused is not None:
        problems.append(f"adapter.embeddings: model.family = \"{cfg.model.family}\" cannot "
                        f"train embeddings ({refused}); remove them")
    if a.embeddings and cfg.cache.unload_text_encoders:
        problems.append("cache.unload_text_encoders with adapter.embeddings: captions with a "
                        "placeholder are encoded live every step, so the encoders must stay")
    return problems


def _output_embedding_problems(cfg: "RunConfig") -> list[str]:
    """Output embeddings in an encoder whose hidden states the family never reads (only its
    pooled output): they would change nothing, so they are refused before anything loads."""
    spec = registry.spec(cfg.model.family, cfg.model.variant)
    pooled_only = {e.name for e in spec.text_encoders if e.hidden == "none"}
    problems = []
    for e in cfg.adapter.embeddings:
        for name in e.encoders or spec.encoder_names:
            if e.kind == "output" and name in pooled_only:
                problems.append(f"adapter.embeddings {e.name!r}: output embeddings in {name} "
                                f"change nothing ({spec.name} reads only its pooled output); "
                                "use kind = \"input\" or leave it out of encoders")
    return problems


def control_problems(cfg: "RunConfig") -> list[str]:
    """Edit pairs (`control_path`) the family cannot take: none at all, or more references per
    pair than it reads. Checked at load, before the data is scanned."""
    spec = registry.spec(cfg.model.family, cfg.model.variant)
    problems = []
    for d, ds in enumerate(cfg.datasets):
        for s, sub in enumerate(ds.subsets):
            n, where = len(sub.control_path), f"datasets[{d}].subsets[{s}].control_path"
            if n and not spec.control_images:
                problems.append(f"{where}: model.family = \"{spec.name}\" trains no edit "
                                "model, so it takes no control images; remove control_path")
            elif n > spec.control_images:
                problems.append(f"{where}: {n} control folders, but model.family = "
                                f"\"{spec.name}\" reads at most {spec.control_images} per pair")
            # Refused rather than mirroring both images: an instruction may name a side ("move
            # the cup to the left"), which a mirrored pair would teach backwards.
            if n and sub.flip:
                problems.append(f"datasets[{d}].subsets[{s}].flip: edit pairs are not mirrored "
                                "(an instruction that names a side would be taught backwards); "
                                "set flip = false for a subset with control_path")
    return problems


def shared_file_problems(names: list[str]) -> list[str]:
    """Placeholders whose embedding files would have one name (the later would overwrite the
    earlier): a file name keeps only some characters, and some file systems ignore case."""
    first: dict[str, int] = {}
    problems = []
    for i, name in enumerate(names):
        stem = embedding_stem(name)
        j = first.setdefault(stem.casefold(), i)
        if j != i and names[j] != name:  # the same name twice is reported on its own
            problems.append(
                f"adapter.embeddings[{i}].name: {name!r} and adapter.embeddings[{j}].name "
                f"{names[j]!r} would both be saved as embeddings/{stem}.safetensors (file names "
                "keep only A-Z a-z 0-9 _ . - and may ignore case); rename one")
    return problems


def warmup_problems(cfg: "RunConfig") -> list[str]:
    """Token warm-ups that would not end before the run does (the full captions never trained)."""
    steps = cfg.train.steps
    return [f"datasets[{d}].subsets[{i}].token_warmup_steps ({sub.token_warmup_steps}) must be "
            f"smaller than train.steps ({steps}): the warm-up would not end before the run "
            "does, so the full captions would never be trained; lower it"
            for d, ds in enumerate(cfg.datasets) for i, sub in enumerate(ds.subsets)
            if sub.token_warmup_steps >= steps]


def unload_problems(cfg: "RunConfig") -> list[str]:
    """`cache.unload_text_encoders` needs every text the training steps use to be cached."""
    if not cfg.cache.unload_text_encoders:
        return []
    if cfg.cache.text == "none":
        return ["cache.unload_text_encoders needs cached text (cache.text = \"memory\" or "
                "\"disk\"): without a cache the encoders run every step"]
    live = [f"datasets[{d}].subsets[{i}]" for d, ds in enumerate(cfg.datasets)
            for i, sub in enumerate(ds.subsets)
            if sub.shuffle_caption or sub.caption_tag_dropout_rate > 0 or sub.wildcards]
    if live and not cfg.cache.caption_variants:
        return [f"cache.unload_text_encoders with random caption augmentations ({', '.join(live)})"
                " would reload the encoders every step; set cache.caption_variants = K to "
                "pre-encode K variants per caption"]
    return []


def model_file_problems(model: ModelConfig) -> list[str]:
    """Cheap checks of the model paths (exist, right kind, not pickle), all reported at once."""
    problems = []
    if model.path is not None and not model.path.is_dir():
        layout = registry.spec(model.family, model.variant).files.folder
        problems.append(f"model.path: {model.path} is not a folder; expected a diffusers-format "
                        f"model folder (with model_index.json) in the {layout} layout")
    for name in ("transformer", "vae", "clip_l", "t5", "text_encoder", "image_encoder"):
        path = getattr(model, name)
        if path is None:
            continue
        if is_pickle(path):
            problems.append(f"model.{name}: {pickle_refusal(path)}")
        elif not path.is_file():
            problems.append(f"model.{name}: {path} does not exist; expected a .safetensors file")
        elif path.suffix.lower() != ".safetensors":
            problems.append(f"model.{name}: {path} is not a .safetensors file")
    return problems


def folder_problem(field: str, folder: Path) -> str | None:
    """Why `folder` cannot be created or written into (it, or a folder above it, is a file)."""
    for place in (folder, *folder.parents):
        if place.is_dir():
            return None
        if place.exists():
            where = "" if place == folder else f" (above {field} = {folder})"
            return (f"{field}: {place}{where} is not a folder; choose a folder (it is created "
                    "when missing), or move that file away")
    return None


def output_problems(cfg: "RunConfig") -> list[str]:
    """Output paths a run could not write: a folder that is a file, file names too long for the
    file system (known now, instead of an ENAMETOOLONG after training)."""
    save, cache = cfg.save, cfg.cache.dir
    found = [folder_problem("save.dir", save.dir)]
    if cache is not None and not cache.is_relative_to(save.dir):
        found.append(folder_problem("cache.dir", cache))
    steps = cfg.train.steps
    extra = COMFYUI_DORA if cfg.adapter.dora and save.dora_comfyui else ""
    why = name_too_long(save.name, steps, save.dir, extra)
    found.append(f"save.name: {why}" if why else None)
    for i, e in enumerate(cfg.adapter.embeddings):
        stem = embedding_stem(e.name)
        why = name_too_long(stem, steps, save.dir / "embeddings")
        found.append(f"adapter.embeddings[{i}].name: {e.name!r} is saved as {stem!r}, and {why}"
                     if why else None)
    return [p for p in found if p is not None]


def check_paths(cfg: "RunConfig", source: str) -> None:
    """Refuse, all at once, model files and output paths that cannot work (cheap checks of the
    file system, after relative paths were resolved)."""
    model = model_file_problems(cfg.model) + metrics_problems(cfg.metrics, _cuda)
    output = output_problems(cfg)
    parts = ([("model files", model)] if model else []) + ([("output", output)] if output else [])
    if not parts:
        return
    error = ConfigError if output else ModelFileError
    raise error(f"{source}: " + "\n".join(f"{head}:\n  - " + "\n  - ".join(lines)
                                          for head, lines in parts))


def memory_problems(cfg: "RunConfig") -> list[str]:
    """Memory savers that cannot work with the rest of the config (known before any load)."""
    t, problems = cfg.train, []
    if t.fused_backward and cfg.precision.mixed == "fp16":
        problems.append("train.fused_backward cannot run with precision.mixed = \"fp16\": the "
                        "loss scaler must see every gradient before any step; use bf16")
    if optimizer_specs.OPTIMIZERS[t.optimizer].cuda_only and t.device == "cpu":
        problems.append(cuda_only(t.optimizer))
    spec = registry.spec(cfg.model.family, cfg.model.variant)
    if t.blocks_to_swap and not spec.swap_blocks and not spec.experts:  # experts: their own
        problems.append(no_swap(spec.name))
    if t.blocks_to_swap and t.compile:
        problems.append("train.compile with train.blocks_to_swap: a compiled block's weights "
                        "cannot be swapped between calls; choose one of the two")
    if t.blocks_to_swap and cfg.precision.quantize.denoiser == "nf4":
        problems.append("train.blocks_to_swap with precision.quantize.denoiser = \"nf4\": "
                        "bitsandbytes' 4-bit weights cannot be moved by block swap; use int8 or "
                        "fp8, or no block swap")
    return problems


def optimizer_problems(cfg: "RunConfig") -> list[str]:
    """Optimizer settings the rest of the run contradicts (its own options: TrainConfig)."""
    t, a = cfg.train, cfg.adapter
    spec = optimizer_specs.OPTIMIZERS[t.optimizer]
    rates = [f"adapter.{k} = {v}" for k, v in (("text_encoder_lr", a.text_encoder_lr),
                                                ("embedding_lr", a.embedding_lr))
             if v is not None and v != t.lr]
    if not rates:
        return []
    if spec.schedule(optimizer_specs.parse_args(t.optimizer, t.optimizer_args)) == "none":
        return [f"{', '.join(rates)}: {t.optimizer} with relative_step computes its own step "
                "size and never reads a learning rate; remove them, or set "
                "train.optimizer_args.relative_step = false"]
    if spec.single_lr:
        return [f"{', '.join(rates)}: {t.optimizer} runs every parameter group at one lr "
                f"(train.lr = {t.lr}; it estimates the step size itself); remove them"]
    return []


def no_swap(family: str) -> str:
    """The refusal of train.blocks_to_swap for a family whose spec lists no swap blocks."""
    return (f"train.blocks_to_swap: the {family} family cannot swap blocks (its checkpointing "
            "runs inside blocks); use gradient_checkpointing, an 8-bit optimizer or a low-bit "
            "base (precision.quantize) instead")


def cuda_only(optimizer: str) -> str:
    """The refusal of a CUDA-only optimizer (bitsandbytes' 8-bit ones) on another device."""
    plain = optimizer.removesuffix("8bit")
    return (f"train.optimizer = \"{optimizer}\" runs on CUDA only (bitsandbytes' 8-bit "
            f"optimizers have no CPU kernels); use optimizer = \"{plain}\" on the CPU")


def warn_ignored(cfg: RunConfig) -> None:
    """One warning for each option that is set but has no effect with the rest of the config."""
    warn_ignored_full(cfg)
    for line in optimizer_specs.warnings(cfg.train) + metrics_warnings(
            cfg.metrics, cfg.sample.prompts is not None):
        log.warning("%s", line)
    for d, ds in enumerate(cfg.datasets):
        for i, sub in enumerate(ds.subsets):
            for what in sub.ignored_caption_options():
                log.warning("datasets[%d].subsets[%d].%s is ignored", d, i, what)
    randomized = any(sub.shuffle_caption or sub.caption_tag_dropout_rate > 0 or sub.wildcards
                     for ds in cfg.datasets for sub in ds.subsets)
    t = cfg.train
    if t.blocks_to_swap and not t.gradient_checkpointing:
        log.warning("train.blocks_to_swap without gradient_checkpointing saves little: backward "
                    "keeps every block's weights alive; set gradient_checkpointing = true")
    if t.fused_backward and t.max_grad_norm is not None:
        log.warning("train.fused_backward: max_grad_norm = %s clips each tensor's gradient on "
                    "its own (no global norm exists while backward still runs)", t.max_grad_norm)
    if cfg.cache.caption_variants and not randomized:
        log.warning("cache.caption_variants is ignored: no subset has a random caption "
                    "augmentation (shuffle_caption, caption_tag_dropout_rate, wildcards)")


