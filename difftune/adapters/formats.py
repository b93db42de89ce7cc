"""LoRA file formats: diffusers naming, safetensors I/O, and fused (kohya-style) layouts.

Everything here is family-agnostic. A family's key table (e.g. `families/flux/keys.py`) says which
diffusers modules map onto which original module; this module supplies the numerics to fuse and
split LoRAs and to read and write files.

Conventions:
- A "diffusers LoRA dict" maps `<prefix>.<module>.lora_A.weight` (rank x in) and
  `<prefix>.<module>.lora_B.weight` (out x rank) to tensors, exactly as
  `FluxPipeline.save_lora_weights` writes them. The effective weight change of a module is
  `delta = (alpha / rank) * B @ A`.
- A "kohya LoRA" stores `<name>.lora_down.weight` (A), `<name>.lora_up.weight` (B) and a scalar
  `<name>.alpha` per module, with the same `alpha / rank` scale.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from difftune.errors import CheckpointError, NonFiniteError
from difftune.files.safe import is_pickle, pickle_refusal

LORA_A = "lora_A.weight"
LORA_B = "lora_B.weight"
# diffusers reads the LoraConfig kwargs of each component from this safetensors metadata entry
# (diffusers.loaders.lora_base.LORA_ADAPTER_METADATA_KEY), keys prefixed with the component name.
ADAPTER_METADATA_KEY = "lora_adapter_metadata"
# Prefixes peft puts in front of module names when a model is wrapped with `get_peft_model`.
_PEFT_WRAPPER_PREFIXES = ("base_model.model.",)
# Where a CLIP text model's layers sit in the names every LoRA reader maps (diffusers,
# ComfyUI's `model_lora_keys_clip`, kohya): `text_encoder.text_model.encoder.layers.N...`.
# transformers 5 flattened CLIPTextModel (`encoder.layers.N` at its top), so a live model may
# lack the root; CLIPTextModelWithProjection keeps it, and its `text_projection` sits outside.
CLIP_ROOT = "text_model."
_OUTSIDE_CLIP_ROOT = ("text_projection",)
V = TypeVar("V")


@dataclass(frozen=True)
class LoraPair:
    """One module's LoRA: down (A, rank x in), up (B, out x rank) and alpha (scale = alpha/rank)."""

    down: torch.Tensor
    up: torch.Tensor
    alpha: float

    @property
    def rank(self) -> int:
        """The LoRA rank (rows of `down`)."""
        return int(self.down.shape[0])

    def delta(self) -> torch.Tensor:
        """The weight change `alpha/rank * up @ down` (out x in), in float32 for comparisons."""
        return (self.up.float() @ self.down.float()) * (self.alpha / self.rank)

    def baked(self) -> "LoraPair":
        """The same delta with the scale folded into `up` and alpha set to the rank (scale 1).

        Used for readers that ignore alpha for some modules (see `families.flux.keys`)."""
        scale = self.alpha / self.rank
        return LoraPair(self.down, self.up * scale, float(self.rank))


# ---------------------------------------------------------------- diffusers naming


def peft_state_to_diffusers(
    peft_state: dict[str, torch.Tensor], prefix: str = "transformer"
) -> dict[str, torch.Tensor]:
    """Name a peft LoRA state (`peft.get_peft_model_state_dict`) the way diffusers saves it.

    peft returns `<module>.lora_A.weight` (with `base_model.model.` in front when the model was
    wrapped by `get_peft_model`); diffusers files carry `<prefix>.<module>.lora_A.weight`. Any
    entry that is not a plain LoRA factor (DoRA magnitudes, LoRA biases, saved modules) has no
    place in these formats, so it is refused rather than dropped.
    """
    out: dict[str, torch.Tensor] = {}
    for key, value in peft_state.items():
        name = key
        for wrapper in _PEFT_WRAPPER_PREFIXES:
            name = name.removeprefix(wrapper)
        if not name.endswith((f".{LORA_A}", f".{LORA_B}")):
            raise CheckpointError(
                f"LoRA state entry {key!r} is not a plain LoRA factor (lora_A/lora_B weight); "
                "the diffusers and kohya LoRA formats cannot store it. Train a plain LoRA "
                "(no DoRA, no LoRA bias, no modules_to_save) to export to these formats."
            )
        out[f"{prefix}.{name}"] = value
    return out


def split_lora_key(key: str) -> tuple[str, str]:
    """`prefix.module.lora_A.weight` -> (`prefix.module`, `lora_A.weight`); error if not a LoRA key."""
    for suffix in (LORA_A, LORA_B):
        if key.endswith("." + suffix):
            return key[: -len(suffix) - 1], suffix
    raise CheckpointError(f"{key!r} is not a diffusers LoRA key (expected '.lora_A.weight' or '.lora_B.weight').")


def group_modules(state: dict[str, torch.Tensor], alpha: float | dict[str, float]) -> dict[str, LoraPair]:
    """Pair up the A and B factors of a diffusers LoRA dict: {`prefix.module`: LoraPair}.

    `alpha` is one value for every module or a {`prefix.module`: alpha} dict (as returned by a
    kohya reader). Every module must have both factors with matching ranks; a lone factor is an
    error because a file written from it would not load anywhere.
    """
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        module, suffix = split_lora_key(key)
        halves.setdefault(module, {})[suffix] = value
    pairs: dict[str, LoraPair] = {}
    for module, parts in halves.items():
        if set(parts) != {LORA_A, LORA_B}:
            raise CheckpointError(f"LoRA module {module!r} lacks {({LORA_A, LORA_B} - set(parts)).pop()}.")
        down, up = parts[LORA_A], parts[LORA_B]
        if down.ndim != 2 or up.ndim != 2 or up.shape[1] != down.shape[0]:
            raise CheckpointError(
                f"LoRA module {module!r} has mismatched factors: A {tuple(down.shape)}, B {tuple(up.shape)}."
            )
        module_alpha = alpha[module] if isinstance(alpha, dict) else alpha
        pairs[module] = LoraPair(down, up, float(module_alpha))
    return pairs


def pairs_to_diffusers(pairs: dict[str, LoraPair]) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """The inverse of `group_modules`: the diffusers tensors and the {`prefix.module`: alpha} dict."""
    out: dict[str, torch.Tensor] = {}
    for module, pair in pairs.items():
        out[f"{module}.{LORA_A}"] = pair.down
        out[f"{module}.{LORA_B}"] = pair.up
    return out, {module: pair.alpha for module, pair in pairs.items()}


def fold_scale(state: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """The same LoRA with `scale` (alpha/rank) multiplied into every up factor (`lora_B`).

    A file so written has scale 1 (alpha = rank) and reads right in every loader, including
    those that take alpha from neither metadata nor tensors (ComfyUI reads diffusers-layout
    files so). Other entries are left as they are.
    """
    return {k: (v * scale if k.endswith(f".{LORA_B}") else v) for k, v in state.items()}


def with_clip_root(state: dict[str, V], roots: dict[str, str]) -> dict[str, V]:
    """Rename the CLIP entries of a LoRA dict (keys `<prefix>.<module>...`) to a given root.

    `roots` maps each CLIP component prefix (`text_encoder`) to the root its modules should sit
    under: `CLIP_ROOT` for files, or the live model's own root (`families.common.text.clip_root`) to
    read a file into it. Keys with or without the root are accepted; other components pass
    unchanged.
    """
    out: dict[str, V] = {}
    for key, value in state.items():
        prefix, _, rest = key.partition(".")
        if prefix in roots and rest:
            rest = rest.removeprefix(CLIP_ROOT)
            rest = rest if rest.startswith(_OUTSIDE_CLIP_ROOT) else roots[prefix] + rest
            key = f"{prefix}.{rest}"
        out[key] = value
    return out


def _module_pattern(module: str) -> str:
    """An exact-name regex for one module; the CLIP root is optional, because diffusers strips
    `text_model.` from the keys before injecting into a flattened CLIPTextModel."""
    if module.startswith(CLIP_ROOT):
        return f"(?:{re.escape(CLIP_ROOT)})?{re.escape(module.removeprefix(CLIP_ROOT))}"
    return re.escape(module)


def diffusers_adapter_metadata(
    state: dict[str, torch.Tensor], rank: int, alpha: float, prefix: str = "transformer"
) -> dict[str, str]:
    """Safetensors metadata that makes diffusers' loader build the right `LoraConfig`.

    Without it, diffusers infers `lora_alpha = rank` from the tensor shapes (scale 1), so a LoRA
    trained with alpha != rank would load with the wrong strength. diffusers reads the JSON in
    `lora_adapter_metadata`, keeps the entries starting with `<prefix>.`, strips the prefix and
    passes the rest to `peft.LoraConfig(**kwargs)`. `target_modules` is written as an anchored
    regex of the exact module names: a plain list would match by suffix, so `proj_out` would also
    hit every `single_transformer_blocks.N.proj_out`.
    """
    modules = sorted({split_lora_key(k)[0].removeprefix(f"{prefix}.") for k in state if k.startswith(f"{prefix}.")})
    config = {
        "r": int(rank),
        "lora_alpha": float(alpha),
        "target_modules": "^(?:" + "|".join(_module_pattern(m) for m in modules) + ")$",
        "rank_pattern": {},
        "alpha_pattern": {},
        "use_dora": False,
        "lora_bias": False,
        "init_lora_weights": True,
    }
    packed = {f"{prefix}.{k}": v for k, v in config.items()}
    return {"format": "pt", ADAPTER_METADATA_KEY: json.dumps(packed, indent=2, sort_keys=True)}


def merged_adapter_metadata(
    state: dict[str, torch.Tensor], rank: int, alpha: float, prefixes: list[str]
) -> dict[str, str]:
    """`diffusers_adapter_metadata` for several components in one file (denoiser, encoders).

    diffusers keeps one JSON object whose keys carry each component's prefix, so the
    per-prefix objects are merged into it.
    """
    packed: dict[str, object] = {}
    for prefix in prefixes:
        one = diffusers_adapter_metadata(state, rank, alpha, prefix)
        packed.update(json.loads(one[ADAPTER_METADATA_KEY]))
    return {"format": "pt", ADAPTER_METADATA_KEY: json.dumps(packed, indent=2, sort_keys=True)}


# ---------------------------------------------------------------- file I/O


def save_lora(
    path: str | os.PathLike[str],
    tensors: dict[str, torch.Tensor],
    metadata: dict[str, str],
    dtype: torch.dtype | None = None,
    keep: tuple[str, ...] = (),
) -> Path:
    """Write a LoRA (or embedding) file as safetensors with string metadata, atomically.

    Floating tensors with at least one dimension are cast to `dtype` (None keeps them); scalar
    tensors such as kohya alphas, and those whose key ends with one of `keep`, are kept as
    they are. Tensors holding NaN or inf (before or
    after the cast) are refused with `NonFiniteError`: such a file would only make black images.
    The file is written to a temporary name in the destination folder and moved into place with
    `os.replace`, so a crash never leaves a half-written LoRA under the final name; it gets the
    mode the umask gives ordinary files.
    """
    path = Path(path)
    bad = {k: type(v).__name__ for k, v in metadata.items() if not isinstance(k, str) or not isinstance(v, str)}
    if bad:
        raise TypeError(f"safetensors metadata must map str to str; got non-str entries {bad}")
    out = {}
    for key, value in tensors.items():
        value = value.detach().to("cpu")
        # Scalars (kohya alphas) keep their precision: bf16 cannot hold e.g. alpha=12.3 exactly.
        if (dtype is not None and value.is_floating_point() and value.ndim > 0
                and not key.endswith(keep)):
            out[key] = value.to(dtype).contiguous()
        else:
            out[key] = value.contiguous()
    _refuse_non_finite(path, tensors, out, dtype)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        write_safetensors(tmp, out, dict(metadata))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor],
                      metadata: dict[str, str] | None = None) -> None:
    """`safetensors.torch.save_file`, but the file gets the mode the umask gives any new file.

    safetensors always makes its files 0600, so a ComfyUI or web server running as another
    user could not read a LoRA. The mode is learned by creating the file as `open()` would
    (0666 less the umask, and any default ACL), without touching the process-wide umask.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        mode = stat.S_IMODE(os.fstat(fd).st_mode)
    finally:
        os.close(fd)
    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, mode)


def non_finite(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """{key: "N NaN, M inf"} for every floating tensor that is not all finite."""
    found = {}
    for key, value in tensors.items():
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            nan = int(torch.isnan(value).sum())
            found[key] = f"{nan} NaN, {int(torch.isinf(value).sum())} inf"
    return found


def describe_non_finite(found: dict[str, str]) -> str:
    """`found` (from `non_finite`) as a short list: the first few tensors and the count."""
    named = "; ".join(f"{k}: {v}" for k, v in list(found.items())[:3])
    more = f"; and {len(found) - 3} more" if len(found) > 3 else ""
    return f"{len(found)} tensor(s) are not finite ({named}{more})"


def _refuse_non_finite(path: Path, source: dict[str, torch.Tensor],
                       cast: dict[str, torch.Tensor], dtype: torch.dtype | None) -> None:
    """Raise `NonFiniteError` naming the tensors and the likely fix, if any is not finite."""
    diverged = non_finite(source)
    if diverged:
        raise NonFiniteError(
            f"refusing to write {path}: {describe_non_finite(diverged)}: the trained weights "
            "diverged. Lower train.lr (and with precision.mixed = \"fp16\" try \"bf16\", whose "
            "range is far wider), then train again; earlier checkpoints are kept")
    overflow = non_finite(cast)
    if overflow:
        raise NonFiniteError(
            f"refusing to write {path}: {describe_non_finite(overflow)} once cast to {dtype}: "
            "the weights are too large for that dtype. Set save.dtype = \"bf16\" or \"fp32\" "
            "(or lower train.lr if such large weights are unexpected)")


def load_lora_file(path: str | os.PathLike[str]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Read a LoRA file's tensors and metadata, through safetensors only.

    Pickle-based files (.ckpt/.pt/.bin) can run arbitrary code when loaded, so they are refused
    with instructions to convert them once, in a trusted environment.
    """
    path = Path(path)
    if is_pickle(path):
        raise CheckpointError(pickle_refusal(path))
    if not path.is_file():
        raise CheckpointError(f"LoRA file {path} does not exist or is not a file.")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            metadata = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:  # safetensors raises its own error types for corrupt headers
        raise CheckpointError(
            f"{path} is not a readable safetensors file ({exc}); re-export or re-download it."
        ) from exc
    return tensors, metadata
