"""Load Anima from local files only: a diffusers folder and/or the single files ComfyUI keeps.

`model.path` is a diffusers folder in the layout of AnimaModularPipeline's components
(transformer/ (CosmosTransformer3DModel), text_conditioner/ (AnimaTextConditioner, the LLM
adapter), vae/ (AutoencoderKLQwenImage), text_encoder/ (Qwen3Model), tokenizer/,
t5_tokenizer/, scheduler/). `model.transformer`, `model.vae` and `model.text_encoder` are the
single files circlestone-labs releases for ComfyUI (`anima-base-v1.0.safetensors`: the
Cosmos-Predict2 DiT and its `llm_adapter.*` in the original layout, converted with diffusers'
Cosmos converter; `qwen_image_vae.safetensors`; `qwen_3_06b_base.safetensors`); a single file
overrides the folder's component, and the tokenizers always come from the folder. Weights are
read through safetensors only; a missing or wrong file raises `ModelFileError` naming it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from difftune.errors import ModelFileError
from difftune.families.anima.conditioner import AnimaTokenEmbedding
from difftune.families.anima.cosmos_compat import ensure_padding_mask_resize
from difftune.families.common import frame_vae
from difftune.families.common.folders import check_folder, folder_files, from_folder
from difftune.families.common.qwen3 import load_qwen3_file
from difftune.families.common.single_file import (assign_state, cast_state, count_blocks,
                                                  fingerprint, missing_error, prefixed,
                                                  read_safetensors, strip_prefix)

if TYPE_CHECKING:
    from difftune.config import ModelConfig
    from difftune.files.single import Layout

WHAT = "Anima"
# The released transformer (Cosmos-Predict2 2B text-to-image, as ComfyUI's model_detection
# reads Anima: no per-block absolute position embedding, RoPE extrapolated 4x in height and
# width, the padding mask as a 17th input channel).
TRANSFORMER_CONFIG: dict[str, Any] = {
    "in_channels": 16, "out_channels": 16, "num_attention_heads": 16, "attention_head_dim": 128,
    "num_layers": 28, "mlp_ratio": 4.0, "text_embed_dim": 1024, "adaln_lora_dim": 256,
    "max_size": (128, 240, 240), "patch_size": (1, 2, 2), "rope_scale": (1.0, 4.0, 4.0),
    "concat_padding_mask": True, "extra_pos_embed_type": None,
}
# The LLM adapter (ComfyUI's comfy/ldm/anima LLMAdapter defaults: 6 blocks of 1024 over
# Qwen3-0.6B's 1024-wide states, T5's 32128-token vocabulary).
CONDITIONER_CONFIG: dict[str, Any] = {
    "source_dim": 1024, "target_dim": 1024, "model_dim": 1024, "num_layers": 6,
    "num_attention_heads": 16, "mlp_ratio": 4.0, "target_vocab_size": 32128,
    "use_self_attention": True, "use_layer_norm": False, "min_sequence_length": 512,
}
# Qwen3-0.6B (Base), the text encoder.
TEXT_ENCODER_CONFIG: dict[str, Any] = {
    "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072,
    "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
    "head_dim": 128, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
}
# Flow matching with a fixed shift of 3 (ComfyUI's sampling settings for Anima).
SCHEDULER_CONFIG: dict[str, Any] = {"num_train_timesteps": 1000, "shift": 3.0,
                                    "use_dynamic_shifting": False}
_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "net.")
ADAPTER = "llm_adapter."


def transformer_config(sd: dict[str, torch.Tensor], path: Path) -> dict[str, Any]:
    """CosmosTransformer3DModel config from a diffusers-layout state dict's shapes."""
    try:
        hidden, patch_in = sd["patch_embed.proj.weight"].shape
        head = sd["transformer_blocks.0.attn1.norm_q.weight"].shape[0]
        return {**TRANSFORMER_CONFIG, "in_channels": patch_in // 4 - 1,
                "num_attention_heads": hidden // head, "attention_head_dim": head,
                "num_layers": count_blocks(sd, "transformer_blocks."),
                "text_embed_dim": sd["transformer_blocks.0.attn2.to_k.weight"].shape[1],
                "adaln_lora_dim": sd["transformer_blocks.0.norm1.linear_1.weight"].shape[0],
                "extra_pos_embed_type": ("learnable" if any(k.startswith("learnable_pos_embed")
                                                            for k in sd) else None)}
    except KeyError as err:
        raise missing_error(path, "an Anima (Cosmos-Predict2) transformer", err) from None


def conditioner_config(sd: dict[str, torch.Tensor], path: Path) -> dict[str, Any]:
    """AnimaTextConditioner config from its (llm_adapter) tensors' shapes."""
    try:
        vocab, target = sd["embed.weight"].shape
        model = sd["blocks.0.cross_attn.q_proj.weight"].shape[0]
        return {**CONDITIONER_CONFIG, "target_vocab_size": vocab, "target_dim": target,
                "model_dim": model, "num_layers": count_blocks(sd, "blocks."),
                "source_dim": sd["blocks.0.cross_attn.k_proj.weight"].shape[1],
                "num_attention_heads": model // sd["blocks.0.cross_attn.q_norm.weight"].shape[0],
                "mlp_ratio": sd["blocks.0.mlp.0.weight"].shape[0] / model,
                "use_self_attention": "blocks.0.self_attn.q_proj.weight" in sd,
                "use_layer_norm": "blocks.0.norm_cross_attn.bias" in sd}
    except KeyError as err:
        raise missing_error(path, "Anima's LLM adapter (llm_adapter.*)", err) from None


def load_transformer_file(path: Path, dtype: torch.dtype) -> tuple[Any, Any]:
    """(transformer, text conditioner) from one file: the original layout (`net.`,
    `diffusion_model.` or no prefix; the DiT converted by diffusers' Cosmos converter, its
    `llm_adapter.*` read as it is) or the diffusers layout (a file without the adapter is
    refused: it is Cosmos-Predict2, not Anima)."""
    from diffusers import AnimaTextConditioner, CosmosTransformer3DModel
    from diffusers.loaders.single_file_utils import (
        convert_cosmos_transformer_checkpoint_to_diffusers)

    sd = strip_prefix(read_safetensors(path, "Anima transformer"), _PREFIXES)
    adapter = prefixed(sd, ADAPTER)
    if not adapter:
        raise ModelFileError(f"{path} has no llm_adapter.* tensors: it is not an Anima "
                             "transformer (Cosmos-Predict2 files lack Anima's LLM adapter); "
                             "give anima-base-v1.0.safetensors or another Anima file")
    sd = {k: v for k, v in sd.items() if not k.startswith(ADAPTER)}
    if "patch_embed.proj.weight" not in sd:
        sd = convert_cosmos_transformer_checkpoint_to_diffusers(dict(sd))
    with torch.device("meta"):
        transformer = CosmosTransformer3DModel(**transformer_config(sd, path))
        conditioner = AnimaTextConditioner(**conditioner_config(adapter, path))
    return (assign_state(transformer, cast_state(sd, dtype), path, "Anima transformer"),
            assign_state(conditioner, cast_state(adapter, dtype), path, "Anima LLM adapter"))


def _folder(cfg: "ModelConfig") -> Path:
    """model.path, which Anima needs for its tokenizers (also with every single file given):
    a modular pipeline's folder (modular_model_index.json, as AnimaModularPipeline saves it)
    or a classic one (model_index.json)."""
    if cfg.path is None:
        raise ModelFileError("model.family = \"anima\" reads its Qwen3 and T5 tokenizers from a "
                             "diffusers folder; set model.path to a folder in Anima's diffusers "
                             "layout (tokenizer/, t5_tokenizer/ at least)")
    folder = Path(cfg.path).expanduser()
    singles = (cfg.transformer, cfg.vae, cfg.text_encoder)
    if any(s is None for s in singles) and not (folder / "modular_model_index.json").is_file():
        check_folder(folder, WHAT)
    return folder


def _denoiser(cfg: "ModelConfig", folder: Path, dtype: torch.dtype) -> tuple[Any, Any]:
    """(transformer, conditioner): from `model.transformer`, else the folder's subfolders."""
    from diffusers import AnimaTextConditioner, CosmosTransformer3DModel

    if cfg.transformer is not None:
        return load_transformer_file(Path(cfg.transformer), dtype)
    return (from_folder(CosmosTransformer3DModel, folder, "transformer", dtype, WHAT),
            from_folder(AnimaTextConditioner, folder, "text_conditioner", dtype, WHAT))


def load_anima_files(cfg: "ModelConfig", dtypes: dict[str, torch.dtype]) -> dict[str, Any]:
    """Every component in `dtypes` (single files over the folder's), plus "name" and
    "fingerprint" (of every weight file read)."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler

    ensure_padding_mask_resize()
    folder = _folder(cfg)
    transformer, conditioner = _denoiser(cfg, folder, dtypes["transformer"])
    vae = (frame_vae.load_file(Path(cfg.vae), dtypes["vae"], "Qwen-Image VAE") if cfg.vae
           else from_folder(AutoencoderKLQwenImage, folder, "vae", dtypes["vae"], WHAT))
    scheduler = (from_folder(FlowMatchEulerDiscreteScheduler, folder, "scheduler", None, WHAT)
                 if (folder / "scheduler").is_dir()
                 else FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG))
    singles = [Path(p) for p in (cfg.transformer, cfg.vae, cfg.text_encoder) if p is not None]
    given = {"transformer": cfg.transformer, "text_conditioner": cfg.transformer,
             "vae": cfg.vae, "text_encoder": cfg.text_encoder, "scheduler": None}
    subs = [sub for sub, file in given.items() if file is None and (folder / sub).is_dir()]
    return {"transformer": transformer, "text_conditioner": conditioner, "vae": vae,
            "scheduler": scheduler, **_tokenizers(folder),
            **_text_encoders(cfg, folder, dtypes["text_encoders"], conditioner.embed.weight),
            "name": Path(cfg.transformer).stem if cfg.transformer is not None else folder.name,
            "fingerprint": fingerprint(
                folder_files(folder, ["tokenizer", "t5_tokenizer", *subs])[1:] + singles)}


def _tokenizers(folder: Path) -> dict[str, Any]:
    """The Qwen3 and T5 tokenizers of the folder."""
    from transformers import AutoTokenizer

    return {name: from_folder(AutoTokenizer, folder, name, None, WHAT)
            for name in ("tokenizer", "t5_tokenizer")}


def _text_encoders(cfg: "ModelConfig", folder: Path, dtype: torch.dtype, table: torch.Tensor
                   ) -> dict[str, Any]:
    """Qwen3 (`model.text_encoder` if given, else the folder's) and the LLM adapter's T5-token
    `table` as its own module, in the text encoders' dtype."""
    from transformers import Qwen3Model

    qwen = (load_qwen3_file(Path(cfg.text_encoder), dtype, TEXT_ENCODER_CONFIG)
            if cfg.text_encoder is not None
            else from_folder(Qwen3Model, folder, "text_encoder", dtype, WHAT))
    return {"text_encoder": qwen, "t5_embedding": AnimaTokenEmbedding(table).to(dtype)}


def load_anima_text_encoders(cfg: "ModelConfig", dtype: torch.dtype) -> dict[str, Any]:
    """The text encoders alone (a reload after unloading), from the same files as
    `load_anima_files`: of the transformer file, only the adapter's T5 table is read."""
    from diffusers import AnimaTextConditioner
    from safetensors import safe_open

    folder = _folder(cfg)
    if cfg.transformer is None:
        conditioner = from_folder(AnimaTextConditioner, folder, "text_conditioner", dtype, WHAT)
        return _text_encoders(cfg, folder, dtype, conditioner.embed.weight)
    path = Path(cfg.transformer)
    with safe_open(str(path), framework="pt") as f:
        key = next((k for k in f.keys() if k.endswith(f"{ADAPTER}embed.weight")), None)
        if key is None:
            raise ModelFileError(f"{path} has no llm_adapter.embed.weight: it is not an Anima "
                                 "transformer file")
        table = f.get_tensor(key)
    return _text_encoders(cfg, folder, dtype, table)


def single_file_layout(model: torch.nn.Module) -> "Layout":
    """The transformer in the original (Cosmos-Predict2) layout Anima's files use, one tensor
    per diffusers tensor (`keys.to_original`; the inverse of diffusers' Cosmos converter).
    The LLM adapter is not the denoiser's, so it is not in it."""
    from difftune.families.anima.keys import to_original
    from difftune.files.single import Piece, check_complete

    names = list(model.state_dict())
    out = {}
    for name in names:
        module, param = name.rsplit(".", 1)
        out[f"{to_original(module)}.{param}"] = Piece((name,))
    return check_complete(out, names, "Anima original")
