"""The built-in tiny FLUX.3 flavor: real diffusers/transformers classes with tiny configs.

Flux3Transformer2DModel (one per-mode block per mode, two joint blocks), FLUX.2's autoencoder
at FLUX.2's tiny size (its batch-norm statistics randomized so the latent normalization shows),
FlowMatchEulerDiscreteScheduler with the modular pipeline's constant shift, and a Qwen3-VL text
encoder with Qwen3-VL-4B's 36 layers at tiny widths (the pipeline taps layers 4, 8, ..., 32)
over a Qwen2 byte-level tokenizer with Qwen's special tokens and ChatML template (Krea 2's tiny
encoder and tokenizer: the same Qwen3-VL-4B). Nothing is downloaded; weights come from a fixed
seed in a forked RNG.
"""

from __future__ import annotations

from typing import Any

import torch

from difftune.families.common.tiny import TEXT_WIDTH
from difftune.families.common.bn_vae import TINY_LATENT_CHANNELS as LATENT_CHANNELS
from difftune.families.common.bn_vae import tiny_vae
from difftune.families.flux3.files import SCHEDULER_CONFIG
from difftune.families.flux3.spec import LAYERS
from difftune.families.krea2.tiny import tiny_qwen_vl_tokenizer, tiny_text_encoder

SEED = 3303


def tiny_transformer_config(flow_map: bool = False) -> dict[str, Any]:
    """Flux3Transformer2DModel config: one per-mode and two joint blocks, head size 16 split
    over the four RoPE axes as (32, 32, 32, 32) is at 128, the eight tapped encoder layers
    stacked per token; `flow_map` the step-distilled checkpoint's second timestep embedder."""
    return {"in_channels": LATENT_CHANNELS * 4, "cond_in_channels": LATENT_CHANNELS * 4,
            "num_layers": 1, "num_single_layers": 2, "attention_head_dim": 16,
            "num_attention_heads": 2, "joint_attention_dim": len(LAYERS) * TEXT_WIDTH,
            "timestep_channels": 32, "axes_dims_rope": (4, 4, 4, 4), "flow_map": flow_map}


def build_tiny_flux3(flow_map: bool = False) -> dict[str, Any]:
    """All components of a tiny FLUX.3 model (the base; `flow_map`: the step-distilled kind),
    keyed as Flux3ModularPipeline names them. Deterministic: the same weights on every call,
    whatever the caller's RNG state."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux3Transformer2DModel

    tok = tiny_qwen_vl_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        transformer = Flux3Transformer2DModel(**tiny_transformer_config(flow_map))
        vae = tiny_vae()
        encoder = tiny_text_encoder(tok)
    return {"transformer": transformer.eval(), "vae": vae.eval(), "text_encoder": encoder.eval(),
            "tokenizer": tok, "scheduler": FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG)}
