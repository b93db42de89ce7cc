"""LoRA file formats: diffusers naming, safetensors I/O, and fused (kohya-style) layouts.

Everything here is family-agnostic. A family's key table (e.g. `families/flux_keys.py`) says which
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
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from difftune.errors import CheckpointError
from difftune.safefiles import is_pickle, pickle_refusal

LORA_A = "lora_A.weight"
LORA_B = "lora_B.weight"
# diffusers reads the LoraConfig kwargs of each component from this safetensors metadata entry
# (diffusers.loaders.lora_base.LORA_ADAPTER_METADATA_KEY), keys prefixed with the component name.
ADAPTER_METADATA_KEY = "lora_adapter_metadata"
# Prefixes peft puts in front of module names when a model is wrapped with `get_peft_model`.
_PEFT_WRAPPER_PREFIXES = ("base_model.model.",)


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

        Used for readers that ignore alpha for some modules (see `flux_keys`)."""
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
        "target_modules": "^(?:" + "|".join(re.escape(m) for m in modules) + ")$",
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
) -> Path:
    """Write a LoRA as safetensors with string metadata, atomically.

    Floating tensors with at least one dimension are cast to `dtype` (None keeps them); scalar
    tensors such as kohya alphas are kept as they are. The file is written
    to a temporary name in the destination folder and moved into place with `os.replace`, so a
    crash never leaves a half-written LoRA under the final name.
    """
    path = Path(path)
    bad = {k: type(v).__name__ for k, v in metadata.items() if not isinstance(k, str) or not isinstance(v, str)}
    if bad:
        raise TypeError(f"safetensors metadata must map str to str; got non-str entries {bad}")
    out = {}
    for key, value in tensors.items():
        value = value.detach().to("cpu")
        # Scalars (kohya alphas) keep their precision: bf16 cannot hold e.g. alpha=12.3 exactly.
        if dtype is not None and value.is_floating_point() and value.ndim > 0:
            value = value.to(dtype)
        out[key] = value.contiguous()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        save_file(out, tmp, metadata=dict(metadata))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


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


# ---------------------------------------------------------------- fused modules


def fuse_loras(parts: list[LoraPair]) -> LoraPair:
    """Fuse k LoRAs that read the same input into one LoRA of a concatenated-output module.

    down = cat(A_i) (k*r x in) and up = block-diag(B_i) ((sum out_i) x k*r), so
    up @ down = cat(B_i @ A_i) exactly. The rank grows k-fold, so alpha is multiplied by k to keep
    alpha/rank, the per-module scale, unchanged. All parts must share rank and alpha (one scale
    for the fused module); parts that differ are first baked to scale 1.
    """
    if not parts:
        raise ValueError("fuse_loras needs at least one LoRA")
    if len({(p.rank, p.alpha) for p in parts}) > 1:
        parts = [p.baked() for p in parts]
        if len({p.rank for p in parts}) > 1:
            parts = [_pad_rank(p, max(q.rank for q in parts)) for p in parts]
    down = torch.cat([p.down for p in parts], dim=0)
    up = torch.block_diag(*[p.up for p in parts])
    return LoraPair(down, up, parts[0].alpha * len(parts))


def _pad_rank(p: LoraPair, rank: int) -> LoraPair:
    """Zero-pad a scale-1 LoRA to a larger rank (same delta): alpha follows the rank."""
    extra = rank - p.rank
    down = torch.cat([p.down, p.down.new_zeros(extra, p.down.shape[1])])
    up = torch.cat([p.up, p.up.new_zeros(p.up.shape[0], extra)], dim=1)
    return LoraPair(down, up, float(rank))


def zero_lora(rank: int, in_features: int, out_features: int, like: torch.Tensor, alpha: float) -> LoraPair:
    """A LoRA with zero delta, used to fill a part of a fused module that was not trained."""
    return LoraPair(like.new_zeros(rank, in_features), like.new_zeros(out_features, rank), alpha)


def split_fused_lora(fused: LoraPair, out_dims: list[int]) -> list[LoraPair]:
    """Split a fused LoRA back into one LoRA per output chunk (`out_dims` rows each).

    When `up` is block-diagonal with equal blocks (what `fuse_loras` writes), each part gets its
    own rows of `down` and its diagonal block of `up`, with alpha / k: the exact inverse. Any other
    fused LoRA (e.g. trained as one module by kohya) is split exactly by sharing the full `down`
    and taking each part's rows of `up`, keeping the fused rank and alpha.
    """
    if sum(out_dims) != fused.up.shape[0]:
        raise CheckpointError(
            f"fused LoRA has {fused.up.shape[0]} output rows but the module parts need {sum(out_dims)} "
            f"({out_dims}); the file was made for a model of a different size."
        )
    k = len(out_dims)
    ups = torch.split(fused.up, out_dims, dim=0)
    if fused.rank % k == 0 and _is_block_diagonal(ups, fused.rank // k):
        r = fused.rank // k
        return [
            LoraPair(fused.down[i * r : (i + 1) * r], ups[i][:, i * r : (i + 1) * r], fused.alpha / k)
            for i in range(k)
        ]
    return [LoraPair(fused.down, up, fused.alpha) for up in ups]


def _is_block_diagonal(ups: tuple[torch.Tensor, ...], r: int) -> bool:
    """True when row-chunk i of `up` is zero outside columns [i*r, (i+1)*r)."""
    for i, up in enumerate(ups):
        outside = torch.cat([up[:, : i * r], up[:, (i + 1) * r :]], dim=1)
        if torch.count_nonzero(outside) > 0:
            return False
    return True


def is_zero(pair: LoraPair) -> bool:
    """True when a LoRA contributes nothing (its up or down factor is all zeros)."""
    return not bool(torch.count_nonzero(pair.up)) or not bool(torch.count_nonzero(pair.down))
