"""The built-in tiny FLUX.1 flavor: real diffusers/transformers classes with tiny configs.

Tests, the demo and the CPU end-to-end runs need a whole FLUX.1-dev-like model that builds in
a second and needs no download. Every component here is the library class the real model uses
(FluxTransformer2DModel, AutoencoderKL, CLIPTextModel, T5EncoderModel, their tokenizers and
FlowMatchEulerDiscreteScheduler), only with tiny sizes, so code paths are the real ones.

The tokenizers and a small pretrained autoencoder ship as files in `difftune/assets/tiny/`
(made by `difftune/assets/make_tiny_assets.py`); the transformer and the text encoders are
random-initialised from a fixed seed, without touching the caller's global RNG state.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

import torch

# Sizes of the tiny model. T5's d_model feeds the transformer's context embedder and CLIP's
# pooled output feeds its vector embedder, so those widths must agree with the transformer.
TEXT_WIDTH = 32
T5_MAX_LENGTH = 32
CLIP_MAX_LENGTH = 77
SEED = 1234

TINY_TRANSFORMER_CONFIG: dict[str, Any] = {
    "patch_size": 1,
    "in_channels": 64,  # 16 latent channels packed 2x2, as FLUX.1 does
    "num_layers": 2,
    "num_single_layers": 2,
    # Width 4 x 64 = 256: the output projection must be able to express the 64 packed latent
    # features per token (a width of 32 could not), and the demo needs enough capacity to learn.
    "attention_head_dim": 64,
    "num_attention_heads": 4,
    "joint_attention_dim": TEXT_WIDTH,
    "pooled_projection_dim": TEXT_WIDTH,
    "guidance_embeds": True,
    "axes_dims_rope": (8, 28, 28),  # sums to attention_head_dim; the rule FLUX.1 follows at 128
}

# The autoencoder's architecture; scaling/shift factors are measured on its latents by
# make_tiny_assets.py and stored with the weights (vae_config.json).
TINY_VAE_ARCH: dict[str, Any] = {
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ["DownEncoderBlock2D"] * 4,  # 4 blocks: downscale 8, like FLUX.1
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "block_out_channels": [32, 32, 32, 32],
    "layers_per_block": 1,
    "latent_channels": 16,
    "norm_num_groups": 8,  # 4 channels a group: 1-channel groups would erase flat colors
    "sample_size": 64,
    "use_quant_conv": False,  # the FLUX.1 autoencoder has neither quant conv
    "use_post_quant_conv": False,
}

# FLUX.1-dev's sampling schedule (its scheduler_config.json).
FLUX_DEV_SCHEDULER_CONFIG: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
}


def assets_dir() -> Path:
    """Folder of the shipped tiny assets (works from a checkout and from an installed wheel)."""
    return Path(str(resources.files("difftune") / "assets" / "tiny"))


def demo_dir() -> Path:
    """Folder of the shipped demo dataset (images, same-stem captions, prompts.txt)."""
    return Path(str(resources.files("difftune") / "assets" / "demo"))


def load_tiny_tokenizers() -> tuple[Any, Any]:
    """The offline CLIP-style and T5-style tokenizers shipped in the assets folder."""
    from transformers import CLIPTokenizer, T5TokenizerFast

    base = assets_dir()
    clip = CLIPTokenizer.from_pretrained(str(base / "tokenizer"), local_files_only=True)
    t5 = T5TokenizerFast.from_pretrained(str(base / "tokenizer_2"), local_files_only=True)
    return clip, t5


def tiny_clip_config(vocab_size: int, bos_id: int, eos_id: int) -> Any:
    """CLIP text-encoder config: CLIP-L's shape (quick_gelu, 77 positions), tiny widths.

    eos_token_id must be the tokenizer's real id: CLIPTextModel pools at the first eos token
    (it only falls back to argmax(input_ids) for the legacy id 2).
    """
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=vocab_size,
        hidden_size=TEXT_WIDTH,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=CLIP_MAX_LENGTH,
        projection_dim=TEXT_WIDTH,
        hidden_act="quick_gelu",
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )


def tiny_t5_config(vocab_size: int, pad_id: int, eos_id: int) -> Any:
    """T5 v1.1 encoder config (gated-gelu, untied), tiny widths."""
    from transformers import T5Config

    return T5Config(
        vocab_size=vocab_size,
        d_model=TEXT_WIDTH,
        d_kv=16,
        d_ff=64,
        num_layers=2,
        num_heads=2,
        feed_forward_proj="gated-gelu",
        tie_word_embeddings=False,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        decoder_start_token_id=pad_id,
    )


def new_tiny_vae(extra: dict[str, Any] | None = None) -> Any:
    """An AutoencoderKL with the tiny architecture (random weights; global RNG is used)."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(**{**TINY_VAE_ARCH, **(extra or {})})


def load_tiny_vae() -> Any:
    """The pretrained tiny autoencoder from the assets folder, in eval mode.

    Building the module draws its (then overwritten) initial weights from the global RNG;
    `build_tiny_flux` shields callers from that.
    """
    from safetensors.torch import load_file

    base = assets_dir()
    cfg = json.loads((base / "vae_config.json").read_text(encoding="utf-8"))
    vae = new_tiny_vae({k: cfg[k] for k in ("scaling_factor", "shift_factor")})
    state = {k: v.float() for k, v in load_file(str(base / "vae.safetensors")).items()}
    vae.load_state_dict(state, strict=True)
    return vae.eval()


def _seeded_models(clip_tok: Any, t5_tok: Any) -> dict[str, Any]:
    """Random-init transformer and text encoders from SEED, inside a forked RNG."""
    from diffusers import FluxTransformer2DModel
    from transformers import CLIPTextModel, T5EncoderModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        transformer = FluxTransformer2DModel(**TINY_TRANSFORMER_CONFIG)
        clip = CLIPTextModel(
            tiny_clip_config(len(clip_tok), clip_tok.bos_token_id, clip_tok.eos_token_id)
        )
        t5 = T5EncoderModel(tiny_t5_config(len(t5_tok), t5_tok.pad_token_id, t5_tok.eos_token_id))
    return {"transformer": transformer.eval(), "text_encoder": clip.eval(),
            "text_encoder_2": t5.eval()}


def build_tiny_flux() -> dict[str, Any]:
    """All components of a tiny FLUX.1-dev-like model, keyed as FluxPipeline names them.

    Deterministic: the same weights on every call, whatever the caller's RNG state (the global
    RNG is forked and restored). Also returns "t5_max_length", the tiny T5 sequence length.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler

    clip_tok, t5_tok = load_tiny_tokenizers()
    parts = _seeded_models(clip_tok, t5_tok)
    with torch.random.fork_rng(devices=[]):  # its (overwritten) init would draw from the RNG
        vae = load_tiny_vae()
    return {
        **parts,
        "vae": vae,
        "tokenizer": clip_tok,
        "tokenizer_2": t5_tok,
        "scheduler": FlowMatchEulerDiscreteScheduler(**FLUX_DEV_SCHEDULER_CONFIG),
        "t5_max_length": T5_MAX_LENGTH,
    }
