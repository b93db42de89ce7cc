"""The built-in tiny FLUX.1 flavor: real diffusers/transformers classes with tiny configs.

Tests, the demo and the CPU end-to-end runs need a whole FLUX.1-dev-like model that builds in
a second and needs no download. Every component here is the library class the real model uses
(FluxTransformer2DModel, AutoencoderKL, CLIPTextModel, T5EncoderModel, their tokenizers and
FlowMatchEulerDiscreteScheduler), only with tiny sizes, so code paths are the real ones.

The tokenizers and the small pretrained autoencoder are the shared tiny assets
(`families.common.tiny`); the transformer and the text encoders are random-initialised from a
fixed seed, without touching the caller's global RNG state.
"""

from __future__ import annotations

from typing import Any

import torch

from difftune.families.common.tiny import (TEXT_WIDTH, load_tiny_tokenizers, load_tiny_vae,
                                           tiny_clip_config, tiny_t5_config)
from difftune.families.flux.files import DEV_SCHEDULER_CONFIG

T5_MAX_LENGTH = 32
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


def build_tiny_flux(variant: str | None = None) -> dict[str, Any]:
    """All components of a tiny FLUX.1-dev-like model, keyed as FluxPipeline names them.

    `variant` "kontext" (None and "base": the default) gets the same components: FLUX.1
    Kontext is the guidance-embedding transformer with FluxKontextPipeline's component names,
    which are FluxPipeline's, so only the pipeline class and the conditioning differ.

    Deterministic: the same weights on every call, whatever the caller's RNG state (the global
    RNG is forked and restored). Also returns "t5_max_length", the tiny T5 sequence length.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler

    clip_tok, t5_tok = load_tiny_tokenizers()
    return {
        **_seeded_models(clip_tok, t5_tok),
        "vae": load_tiny_vae(),
        "tokenizer": clip_tok,
        "tokenizer_2": t5_tok,
        "scheduler": FlowMatchEulerDiscreteScheduler(**DEV_SCHEDULER_CONFIG),
        "t5_max_length": T5_MAX_LENGTH,
    }
