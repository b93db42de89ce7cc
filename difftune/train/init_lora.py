"""`--init-lora PATH`: a new run that starts from an existing LoRA file's weights.

LoCon, LoHa, LoKr and DoRA files (the LyCORIS layout, `adapters.lycoris_files`) are read
into the run's peft layers with the update they mean; a file of another kind than
adapter.type is refused.

Any layout difftune writes is read (diffusers/PEFT keys, or kohya/ComfyUI keys through the
family's converter), through safetensors only. Each module's effect is kept exactly: the file's
up factor is rescaled when its alpha/rank differs from this run's. Modules of the file that
this run does not train are an error (widen the targets); modules this run trains that the
file lacks start as usual (B = 0) and are named in a warning. A LoRA difftune trained for
another family is read where this family declares it reads that family's (`adapters.across`).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from difftune.adapters.across import layout_source, lora_source, module_names, read_across
from difftune.adapters.fit import check_fit, component_modules
from difftune.adapters.formats import (ADAPTER_METADATA_KEY, LORA_B, describe_non_finite,
                                       non_finite, split_lora_key, with_clip_root)
from difftune.adapters.dora_comfyui import refuse_comfyui_file
from difftune.adapters.kinds import uses_lycoris_layout
from difftune.adapters.lycoris_files import adapted_layers, file_kind, load_into
from difftune.errors import ConfigError, CheckpointError, NonFiniteError
from difftune.families.common.text import file_clip_roots, model_clip_roots
from difftune.files.safe import is_pickle, pickle_refusal
from difftune.train.checkpoint import CheckpointManager
from difftune.train.checkpoint.lora import BUNDLE
from difftune.train.experts import pair, under

log = logging.getLogger("difftune")


def read_lora(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and metadata of a .safetensors LoRA; pickles are refused unopened."""
    if is_pickle(path):
        raise CheckpointError(pickle_refusal(path))
    if not path.is_file():
        raise CheckpointError(f"--init-lora {path}: no such file")
    try:
        with safe_open(str(path), "pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})
    except (SafetensorError, OSError, ValueError) as err:
        raise CheckpointError(f"--init-lora {path} is not a readable .safetensors LoRA "
                              f"({type(err).__name__}: {err})") from None


def load_init_lora(path: Path, manager: CheckpointManager) -> None:
    """Copy a LoRA file's factors into this run's trainable parameters; of a two-expert
    model, the file's into its expert and its twin's beside it (`<name>_low_noise` beside
    `<name>_high_noise`) into the other (`train.experts.pair`).

    CLIP modules are matched whether the file names them under `text_model.` (what every
    reader maps, and difftune writes) or not (difftune's files before that), and a file
    holding NaN or inf, or a bad alpha, is refused before anything is copied."""
    if not manager.family.experts:
        _load_one(path, manager, None)
        return
    # (before `pair` asks which expert a file of another family would be for)
    lora_source("--init-lora", path, read_lora(path)[1], manager.family.spec)
    for file, part in pair(manager.family, path):
        _load_one(file, manager, part)


def _load_one(path: Path, manager: CheckpointManager, part: str | None) -> None:
    """One file into the trainable parameters (of the expert in pipeline part `part`)."""
    if manager.cfg.adapter.type == "full":
        raise ConfigError(f"--init-lora {path}: adapter.type = \"full\" trains the weights "
                          "themselves; merge the LoRA into the base model first, or train a LoRA")
    raw, meta = read_lora(path)
    refuse_comfyui_file("--init-lora", path, meta)
    source = lora_source("--init-lora", path, meta, manager.family.spec)
    bad = non_finite(raw)
    if bad:
        raise NonFiniteError(f"--init-lora {path}: {describe_non_finite(bad)}; this file would "
                             "start the run from broken weights. Use a LoRA saved before its "
                             "training diverged (an earlier -stepNNNNNN file or checkpoint)")
    file_alpha = _file_alpha(path, meta)
    raw = _take_embeddings(path, raw, meta, manager)
    if not raw:
        return
    source = source or layout_source(manager.family, manager.comps, raw)
    if source is not None:  # read in this family's names, the scale folded (alpha = rank)
        present = module_names(component_modules(manager.family, manager.comps))
        raw = read_across("--init-lora", path, raw, meta, source, manager.comps, present)
        file_alpha = None
    a = manager.cfg.adapter
    _refuse_other_kind(path, raw, meta, a.type, a.dora)
    check_fit(f"--init-lora {path}", raw, manager.family, manager.comps, meta)
    if uses_lycoris_layout(a.type, a.dora):
        layers = adapted_layers(manager.family, manager.modules(), file_clip_roots(manager.family))
        missing = load_into(path, layers, raw)
        if missing:
            log.warning("--init-lora %s lacks %d trained module(s) (e.g. %s); they start from "
                        "zero", path, len(missing), missing[0])
        log.info("initialized %d %s modules from %s", len(layers) - len(missing), a.type, path)
        return
    tensors, alphas = manager.family.lora_from_format(manager.comps, raw)
    if part is not None:  # the two-expert module names each expert's modules `<part>.<...>`
        tensors, alphas = (under(d, manager.family.denoiser_prefix, part)
                           for d in (tensors, alphas))
    roots = model_clip_roots(manager.family, manager.comps)
    tensors, alphas = with_clip_root(tensors, roots), with_clip_root(alphas, roots)
    for module, alpha in alphas.items():
        _positive(path, f"{module}.alpha", alpha)
    params = {k: v for k, v in manager.trainable().items() if not k.startswith("emb.")}
    unknown = sorted(k for k in tensors if k not in params)
    if unknown:
        raise CheckpointError(f"--init-lora {path} has modules this run does not train "
                              f"({', '.join(unknown[:4])}{', ...' if len(unknown) > 4 else ''}); "
                              "set adapter.targets / target_modules / text_encoders to cover them")
    ours = manager.cfg.adapter.scale_alpha / manager.cfg.adapter.rank
    with torch.no_grad():
        for key, value in tensors.items():
            target = params[key]
            if value.shape != target.shape:
                raise CheckpointError(f"--init-lora {path}: {key} has shape {tuple(value.shape)}"
                                      f", this run {tuple(target.shape)}; set adapter.rank to "
                                      "the file's rank")
            module, suffix = split_lora_key(key)
            rank = value.shape[1] if suffix == LORA_B else value.shape[0]
            scale = alphas.get(module, file_alpha or rank) / rank
            target.copy_(value.float() * (scale / ours if suffix == LORA_B else 1.0))
    missing = sorted({split_lora_key(k)[0] for k in params} - {split_lora_key(k)[0] for k in tensors})
    if missing:
        log.warning("--init-lora %s lacks %d trained module(s) (e.g. %s); they start from zero",
                    path, len(missing), missing[0])
    log.info("initialized %d LoRA tensors from %s", len(tensors), path)


def _refuse_other_kind(path: Path, raw: dict[str, torch.Tensor], meta: dict[str, str],
                       run_type: str, run_dora: bool) -> None:
    """A file of another adapter kind than adapter.type (a LoKr file for a LoHa run, a DoRA
    file for a plain LoRA run) is refused, naming both and the fix."""
    def label(kind: str, dora: bool) -> str:
        return "dora" if dora else "lora" if kind in ("lora", "locon") else kind
    found = file_kind(raw)
    if "difftune.adapter" in meta:
        found = label(meta["difftune.adapter"], meta.get("difftune.dora") == "true")
    wanted = label(run_type, run_dora)
    if found != wanted:
        fix = ("adapter.type = \"lora\" with adapter.dora = true" if found == "dora" else
               f"adapter.type = \"{found}\"" + (" (adapter.dora = false)" if run_dora else ""))
        raise CheckpointError(f"--init-lora {path} holds a {_NAMES[found]} adapter, but this run "
                              f"trains a {_NAMES[wanted]}; set {fix} to continue from it")


_NAMES = {"lora": "LoRA/LoCon", "dora": "DoRA", "loha": "LoHa", "lokr": "LoKr"}


def _take_embeddings(path: Path, raw: dict[str, torch.Tensor], meta: dict[str, str],
                     manager: CheckpointManager) -> dict[str, torch.Tensor]:
    """Load the embeddings a file holds (a LoRA's bundle, or an embedding file of this run's
    placeholder) into the run's placeholders; returns the LoRA tensors that remain."""
    emb = manager.embeddings
    bundle = {k: v for k, v in raw.items() if k.startswith(BUNDLE)}
    files: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in bundle.items():
        name, _, part = key.removeprefix(BUNDLE).rpartition(".")
        files.setdefault(name, {})[part] = value
    rest = {k: v for k, v in raw.items() if k not in bundle}
    placeholder = meta.get("difftune.placeholder")
    if placeholder is not None:  # an embedding file: every tensor is one encoder's vectors
        files[placeholder], rest = rest, {}
    if files and emb is None:
        raise CheckpointError(f"--init-lora {path} holds embeddings ({', '.join(files)}) but this "
                              "run learns none; add them as [[adapter.embeddings]]")
    if files:
        count = emb.load_vectors(files)
        log.info("initialized %d embedding(s) from %s", count, path)
    return rest


def _file_alpha(path: Path, meta: dict[str, str]) -> float | None:
    """A diffusers-layout file's alpha, from difftune's or PEFT's metadata (None: alpha = rank).

    The alpha of the file's tensors: files since the scale is folded say the rank, older ones
    the trained alpha with unscaled up factors; both give the delta they were saved with. A
    value that is not a positive finite number is refused, naming the file and the key."""
    if "difftune.alpha" in meta:
        return _positive(path, "difftune.alpha", meta["difftune.alpha"])
    packed = meta.get(ADAPTER_METADATA_KEY)
    if not packed:
        return None
    try:
        config = json.loads(packed)
    except json.JSONDecodeError as err:
        raise CheckpointError(f"--init-lora {path}: its {ADAPTER_METADATA_KEY} metadata is not "
                              f"valid JSON ({err}); re-export the LoRA") from None
    values = {v for k, v in config.items() if k.endswith("lora_alpha")} if isinstance(
        config, dict) else set()
    if len(values) == 1:
        return _positive(path, f"{ADAPTER_METADATA_KEY} lora_alpha", values.pop())
    return None


def _positive(path: Path, key: str, value: object) -> float:
    """`value` as a positive finite float, or a CheckpointError naming the file and the key."""
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        number = math.nan
    if not math.isfinite(number) or number <= 0:
        raise CheckpointError(
            f"--init-lora {path}: metadata {key} = {value!r} is not a positive number, so the "
            "LoRA's strength is unknown; fix that metadata entry (or remove it, if the "
            "file's other metadata gives the alpha) and try again")
    return number
