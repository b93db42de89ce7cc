"""The built-in tiny Krea 2 flavor: real diffusers/transformers classes with tiny configs.

Krea2Transformer2DModel, AutoencoderKLQwenImage (random weights, the released latent
statistics), a Qwen3VLModel text encoder with as many layers as Qwen3-VL-4B (36, so the
pipeline's default layer taps apply unchanged) at tiny widths, and a Qwen2 byte-level BPE
tokenizer built here with Qwen's real special tokens and whole-word merges for the words of
Krea 2's prompt template, so its system prefix is 34 tokens and its assistant suffix 5, as with
the real tokenizer. Nothing is downloaded; weights come from a fixed seed in a forked RNG.
"""

from __future__ import annotations

from typing import Any

import torch

from difftune.families.common.tiny import TEXT_WIDTH, qwen_bpe_tokenizer
from difftune.families.krea2.files import SCHEDULER_CONFIG
from difftune.families.common.frame_vae import RELEASED_CONFIG as VAE_CONFIG
from difftune.families.krea2.released import TEXT_CONFIG, VISION_CONFIG
from difftune.families.krea2.spec import PREFIX, SUFFIX

SEED = 4321
# Qwen3-VL's ChatML prompt format, for the messages a text encoder sees.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
TINY_TRANSFORMER_CONFIG: dict[str, Any] = {
    "in_channels": 64, "num_layers": 2, "attention_head_dim": 16, "num_attention_heads": 4,
    "num_key_value_heads": 2, "intermediate_size": 96, "timestep_embed_dim": 32,
    "text_hidden_dim": TEXT_WIDTH, "num_text_layers": 12, "text_num_attention_heads": 2,
    "text_num_key_value_heads": 2, "text_intermediate_size": 64, "num_layerwise_text_blocks": 1,
    "num_refiner_text_blocks": 1, "axes_dims_rope": (4, 6, 6),
}
TINY_VAE_CONFIG: dict[str, Any] = {**VAE_CONFIG, "base_dim": 16, "num_res_blocks": 1}


def tiny_qwen_vl_tokenizer() -> Any:
    """A Qwen2 byte-level BPE tokenizer with whole-word merges for the template's words (see
    `qwen_bpe_tokenizer`), Qwen's special tokens and the chat template."""
    return qwen_bpe_tokenizer(PREFIX + SUFFIX, CHAT_TEMPLATE)


def tiny_text_encoder(tok: Any) -> Any:
    """Qwen3VLModel with Qwen3-VL-4B's depth (36 text layers) and mRoPE layout at tiny widths,
    and a one-block vision tower (unused by text prompts)."""
    from transformers import Qwen3VLConfig, Qwen3VLModel

    ids = {name: tok.convert_tokens_to_ids(t) for name, t in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"),
        ("vision_end_token_id", "<|vision_end|>"))}
    text = {**TEXT_CONFIG, "vocab_size": len(tok), "hidden_size": TEXT_WIDTH,
            "intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1,
            "head_dim": 16, "max_position_embeddings": 2048, "pad_token_id": tok.pad_token_id,
            "rope_parameters": {**TEXT_CONFIG["rope_parameters"], "mrope_section": [4, 2, 2]}}
    # [4, 2, 2]: Qwen3-VL's [24, 20, 20] split rule at head size 16 (single.mrope_section)
    vision = {**VISION_CONFIG, "depth": 1, "hidden_size": 16, "intermediate_size": 32,
              "num_heads": 2, "out_hidden_size": TEXT_WIDTH, "deepstack_visual_indexes": [0]}
    return Qwen3VLModel(Qwen3VLConfig(text_config=text, vision_config=vision, **ids))


def build_tiny_krea2() -> dict[str, Any]:
    """All components of a tiny Krea 2 model, keyed as Krea2Pipeline names them.

    Deterministic: the same weights on every call, whatever the caller's RNG state.
    """
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler,
                           Krea2Transformer2DModel)

    tok = tiny_qwen_vl_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        transformer = Krea2Transformer2DModel(**TINY_TRANSFORMER_CONFIG)
        # Zero-initialized in diffusers (identity modulation, zero-centred norms); random
        # values exercise them in tests.
        with torch.no_grad():
            for name, p in transformer.named_parameters():
                if "scale_shift_table" in name or "norm" in name:
                    p.normal_(std=0.1)
        encoder = tiny_text_encoder(tok)
        vae = AutoencoderKLQwenImage(**TINY_VAE_CONFIG)
    return {"transformer": transformer.eval(), "text_encoder": encoder.eval(),
            "tokenizer": tok, "vae": vae.eval(),
            "scheduler": FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG)}
