"""The built-in tiny Chroma flavor: real diffusers/transformers classes with tiny configs.

Tests, the demo and the CPU end-to-end runs need a whole Chroma1-HD-like model that builds in a
second and needs no download. Every component is the library class the released model uses
(ChromaTransformer2DModel, AutoencoderKL, T5EncoderModel, T5TokenizerFast,
FlowMatchEulerDiscreteScheduler), only with tiny sizes, so code paths are the real ones.

The T5 tokenizer (with T5's real special tokens) and the small pretrained autoencoder are the
shared tiny assets (`families.common.tiny`); the transformer and T5 are random-initialised from
a fixed seed, without touching the caller's global RNG state.
"""

from __future__ import annotations

from typing import Any

import torch

from difftune.families.chroma.files import SCHEDULER_CONFIG
from difftune.families.common.tiny import (TEXT_WIDTH, load_tiny_tokenizers, load_tiny_vae,
                                           tiny_t5_config)

T5_MAX_LENGTH = 32
SEED = 1234

TINY_TRANSFORMER_CONFIG: dict[str, Any] = {
    "patch_size": 1,
    "in_channels": 64,  # 16 latent channels packed 2x2, as Chroma (like FLUX.1) does
    "num_layers": 2,
    "num_single_layers": 2,
    # Width 4 x 64 = 256, as the tiny FLUX.1: the output projection must express the 64 packed
    # latent features per token.
    "attention_head_dim": 64,
    "num_attention_heads": 4,
    "joint_attention_dim": TEXT_WIDTH,
    "axes_dims_rope": (8, 28, 28),  # sums to attention_head_dim
    # The modulation approximator: Chroma1-HD's 64 input channels, a tiny hidden width.
    "approximator_num_channels": 64,
    "approximator_hidden_dim": 64,
    "approximator_layers": 2,
}


def build_tiny_chroma() -> dict[str, Any]:
    """All components of a tiny Chroma1-HD-like model, keyed as ChromaPipeline names them.

    Deterministic: the same weights on every call, whatever the caller's RNG state (the global
    RNG is forked and restored). Also returns "t5_max_length", the tiny T5 sequence length.
    """
    from diffusers import ChromaTransformer2DModel, FlowMatchEulerDiscreteScheduler
    from transformers import T5EncoderModel

    _, t5_tok = load_tiny_tokenizers()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        transformer = ChromaTransformer2DModel(**TINY_TRANSFORMER_CONFIG)
        t5 = T5EncoderModel(tiny_t5_config(len(t5_tok), t5_tok.pad_token_id, t5_tok.eos_token_id))
    return {
        "transformer": transformer.eval(),
        "text_encoder": t5.eval(),
        "tokenizer": t5_tok,
        "vae": load_tiny_vae(),
        "scheduler": FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG),
        "t5_max_length": T5_MAX_LENGTH,
    }
