"""Reading model components from single safetensors files, safely.

Used by the family loaders: safetensors reading with clear errors (pickle refused), prefix
stripping and casting, meta-device assignment, and the single-file autoencoder, CLIP and T5
loaders whose configs are derived from tensor shapes (standard CLIP-L / T5-XXL values where the
shapes are silent).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

from difftune.errors import ModelFileError
from difftune.safefiles import is_pickle, pickle_refusal

_CLIP_PREFIXES = ("cond_stage_model.transformer.", "transformer.", "clip_l.", "te1.")
_CLIP_TOWER = ("embeddings", "encoder", "final_layer_norm")
_T5_PREFIXES = ("text_encoders.t5xxl.transformer.", "t5xxl.transformer.", "t5xxl.", "te2.")

# ---------------------------------------------------------------------------------------------
# Safe file access


def pickle_error(path: Path) -> ModelFileError:
    """The refusal for pickle-based weights, with the conversion recipe."""
    return ModelFileError(pickle_refusal(path))


def count_blocks(state: dict[str, torch.Tensor], prefix: str) -> int:
    """Number of `prefix.<i>.` blocks in a state dict."""
    ids = {int(k[len(prefix):].split(".", 1)[0]) for k in state if k.startswith(prefix)}
    return max(ids) + 1 if ids else 0


def _check_weights_file(path: Path, what: str) -> Path:
    """A path that exists, is a file and is safetensors by name; else a ModelFileError."""
    path = Path(path).expanduser()
    if is_pickle(path):
        raise pickle_error(path)
    if not path.exists():
        raise ModelFileError(f"{path} does not exist; expected the {what} as a .safetensors file")
    if not path.is_file():
        raise ModelFileError(f"{path} is not a file; expected the {what} as a .safetensors file")
    if path.suffix.lower() != ".safetensors":
        raise ModelFileError(
            f"{path} is not a .safetensors file; expected the {what} in safetensors format")
    return path


def read_safetensors(path: Path, what: str) -> dict[str, torch.Tensor]:
    """All tensors of a safetensors file (memory-mapped); a clear error for corrupt files."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = _check_weights_file(path, what)
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        raise ModelFileError(
            f"{path} could not be read as safetensors ({err}); expected the {what} — the file "
            "may be truncated or not a safetensors file (re-download or re-convert it)"
        ) from None


def strip_prefix(state: dict[str, torch.Tensor], prefixes: tuple[str, ...]) -> dict:
    """Drop the first of `prefixes` that every matching key carries (checkpoint wrappers)."""
    for prefix in prefixes:
        if any(k.startswith(prefix) for k in state):
            return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    return state


def cast_state(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Cast floating tensors (fp8 included) to `dtype`, applying ComfyUI fp8 scales if present.

    "scaled fp8" files store `<w>.scale_weight` beside each fp8 weight: the real weight is
    their product, computed in fp32 before the final cast.
    """
    out = {}
    for key, value in state.items():
        if key.endswith((".scale_weight", ".scale_input")) or key == "scaled_fp8":
            continue
        scale = state.get(key[: -len(".weight")] + ".scale_weight") if key.endswith(
            ".weight") else None
        if value.is_floating_point():
            value = value.to(torch.float32) * scale.to(torch.float32) if scale is not None else value
            value = value.to(dtype)
        out[key] = value
    return out


def fingerprint(paths: list[Path]) -> str:
    """Identity of the weights: sha256 over each file's path, size and mtime (no content read)."""
    h = hashlib.sha256()
    for p in sorted({Path(p).resolve() for p in paths}):
        st = p.stat()
        h.update(f"{p}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:32]



def assign_state(model: torch.nn.Module, sd: dict[str, torch.Tensor], path: Path, what: str) -> Any:
    """Load a full state dict into a meta-initialised model (no fp32 copy of the weights)."""
    try:
        model.load_state_dict(sd, strict=True, assign=True)
    except RuntimeError as err:
        raise ModelFileError(f"{path} does not match the {what} its shapes describe: "
                             f"{str(err)[:500]}") from None
    return model.eval()


# ---------------------------------------------------------------------------------------------
# Single-file autoencoder and text encoders


def load_vae_file(path: Path, dtype: torch.dtype) -> Any:
    """The FLUX.1 autoencoder from `ae.safetensors` (BFL/LDM layout) or a diffusers-layout file."""
    from diffusers import AutoencoderKL
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint

    sd = read_safetensors(path, "FLUX.1 autoencoder (ae.safetensors)")
    ldm = "encoder.conv_in.weight" in sd and any(k.startswith("encoder.down.") for k in sd)
    if not ldm and "encoder.conv_in.weight" not in sd:
        sd = strip_prefix(sd, ("first_stage_model.", "vae."))
        ldm = any(k.startswith("encoder.down.") for k in sd)
    if "encoder.conv_in.weight" not in sd or "decoder.conv_out.weight" not in sd:
        raise ModelFileError(f"{path} does not look like an autoencoder: no encoder.conv_in / "
                             "decoder.conv_out tensors")
    config = _vae_config(sd, ldm)
    if ldm:
        sd = convert_ldm_vae_checkpoint(sd, config)
    with torch.device("meta"):
        model = AutoencoderKL(**config)
    return assign_state(model, cast_state(sd, dtype), path, "FLUX.1 autoencoder")


def _vae_config(sd: dict[str, torch.Tensor], ldm: bool) -> dict[str, Any]:
    """AutoencoderKL config from shapes; FLUX.1's scaling/shift (not stored in the file)."""
    down = "encoder.down.{}.block.0.conv1.weight" if ldm else \
        "encoder.down_blocks.{}.resnets.0.conv1.weight"
    n = count_blocks(sd, "encoder.down." if ldm else "encoder.down_blocks.")
    block0 = "encoder.down.0.block." if ldm else "encoder.down_blocks.0.resnets."
    return {
        "in_channels": sd["encoder.conv_in.weight"].shape[1],
        "out_channels": sd["decoder.conv_out.weight"].shape[0],
        "down_block_types": ["DownEncoderBlock2D"] * n,
        "up_block_types": ["UpDecoderBlock2D"] * n,
        "block_out_channels": [sd[down.format(i)].shape[0] for i in range(n)],
        "layers_per_block": count_blocks(sd, block0),
        "latent_channels": sd["encoder.conv_out.weight"].shape[0] // 2,
        "norm_num_groups": _norm_groups(sd["encoder.conv_in.weight"].shape[0]),
        "use_quant_conv": "quant_conv.weight" in sd,
        "use_post_quant_conv": "post_quant_conv.weight" in sd,
        "scaling_factor": 0.3611, "shift_factor": 0.1159,  # FLUX.1's ae
    }


def _norm_groups(first_width: int) -> int:
    """GroupNorm groups (not visible in shapes): FLUX.1's 32, or 4-channel groups when narrower.

    The FLUX.1 autoencoder starts at 128 channels with 32 groups; small test autoencoders
    (such as the tiny flavor's, 32 channels, 8 groups) keep 4 channels a group.
    """
    return 32 if first_width >= 128 else max(1, first_width // 4)


def load_clip_file(path: Path, dtype: torch.dtype, tokenizer: Any) -> Any:
    """CLIP-L text encoder from `clip_l.safetensors`; sizes derived from shapes."""
    from transformers import CLIPTextConfig, CLIPTextModel

    sd = strip_prefix(read_safetensors(path, "CLIP-L text encoder"), _CLIP_PREFIXES)
    # Files name tensors "text_model.*" (transformers 4 / ComfyUI) or without it (transformers
    # 5); keep the text tower under the names without it, dropping projection and logit scale.
    sd = strip_prefix(sd, ("text_model.",))
    sd = {k: v for k, v in sd.items() if k.split(".", 1)[0] in _CLIP_TOWER}
    try:
        vocab, hidden = sd["embeddings.token_embedding.weight"].shape
        config = CLIPTextConfig(
            vocab_size=vocab, hidden_size=hidden,
            intermediate_size=sd["encoder.layers.0.mlp.fc1.weight"].shape[0],
            num_hidden_layers=count_blocks(sd, "encoder.layers."),
            # CLIP-L has 64-wide heads; tiny variants use 16-wide ones.
            num_attention_heads=hidden // 64 if hidden >= 64 else max(1, hidden // 16),
            max_position_embeddings=sd["embeddings.position_embedding.weight"].shape[0],
            projection_dim=hidden, hidden_act="quick_gelu",
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id)
    except KeyError as err:
        raise ModelFileError(f"{path} does not look like a CLIP text encoder: tensor {err} is "
                             "missing") from None
    return _pretrained_from_state(CLIPTextModel, config, cast_state(sd, dtype), dtype, path, "CLIP-L")


def load_t5_file(path: Path, dtype: torch.dtype) -> Any:
    """T5 encoder (T5-XXL v1.1) from `t5xxl_*.safetensors`, fp16/bf16/fp8; sizes from shapes."""
    sd = strip_prefix(read_safetensors(path, "T5-XXL text encoder"), _T5_PREFIXES)
    return t5_from_state(sd, path, dtype)


def t5_from_state(sd: dict[str, torch.Tensor], path: Path, dtype: torch.dtype) -> Any:
    """T5 encoder from transformers-layout tensors (prefix removed); `path` names the source."""
    from transformers import T5Config, T5EncoderModel

    if "shared.weight" not in sd and "encoder.embed_tokens.weight" in sd:
        sd["shared.weight"] = sd["encoder.embed_tokens.weight"]
    sd = {k: v for k, v in sd.items() if not k.startswith("decoder.") and k != "lm_head.weight"}
    try:
        vocab, d_model = sd["shared.weight"].shape
        heads = sd["encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"].shape
        gated = "encoder.block.0.layer.1.DenseReluDense.wi_0.weight" in sd
        wi = "wi_0" if gated else "wi"
        config = T5Config(
            vocab_size=vocab, d_model=d_model, num_heads=heads[1],
            relative_attention_num_buckets=heads[0],
            d_kv=sd["encoder.block.0.layer.0.SelfAttention.q.weight"].shape[0] // heads[1],
            d_ff=sd[f"encoder.block.0.layer.1.DenseReluDense.{wi}.weight"].shape[0],
            num_layers=count_blocks(sd, "encoder.block."),
            feed_forward_proj="gated-gelu" if gated else "relu", tie_word_embeddings=False)
    except KeyError as err:
        raise ModelFileError(f"{path} does not look like a T5 encoder: tensor {err} is "
                             "missing") from None
    sd.setdefault("encoder.embed_tokens.weight", sd["shared.weight"])
    return _pretrained_from_state(T5EncoderModel, config, cast_state(sd, dtype), dtype, path, "T5")


def _pretrained_from_state(cls: Any, config: Any, sd: dict, dtype: torch.dtype, path: Path,
                           what: str) -> Any:
    """A transformers model from an in-memory state dict (meta init, buffers handled)."""
    missing = {k for k in _expected_keys(cls, config) if k not in sd}
    if missing:
        raise ModelFileError(f"{path} is not a complete {what} text encoder: "
                             f"{len(missing)} tensors missing, e.g. {sorted(missing)[:3]}")
    model = cls.from_pretrained(None, config=config, state_dict=sd, torch_dtype=dtype)
    return model.eval()


def _expected_keys(cls: Any, config: Any) -> list[str]:
    """Persistent parameter/buffer names of a model class, without allocating its weights."""
    with torch.device("meta"):
        model = cls(config)
    return list(model.state_dict().keys())
