"""The built-in tiny Qwen-Image 2.1 flavor: real diffusers/transformers classes, tiny configs.

QwenImage21Transformer2DModel (two single-stream blocks), AutoencoderKLQwenImage21 at the
released depth (RGBA in, 64 latent channels, 16x downscale, the released latent statistics) at
tiny widths, a Qwen3VLForConditionalGeneration text encoder with a one-block vision tower, and a
Qwen2 byte-level BPE tokenizer built here with Qwen's real special tokens, a chat template that
renders typed content parts as Qwen3-VL's does, and the real vocabulary's pieces for the system
prompt, so that its system message is the same 14 tokens the pipeline drops. Nothing is
downloaded; weights come from a fixed seed in a forked RNG.
"""

from __future__ import annotations

from typing import Any

import torch

from difftune.families.common.tiny import TEXT_WIDTH, qwen_bpe_tokenizer
from difftune.families.qwen_image_21.files import (SCHEDULER_CONFIG, TEXT_CONFIG, VAE_CONFIG,
                                                   VISION_CONFIG, no_final_norm, processor)
from difftune.families.qwen_image_21.spec import TEMPLATE

SEED = 4321
# Qwen3-VL's ChatML format as its chat template renders it: a message's content a string, or
# typed parts (text as it is, an image as its vision tokens).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}"
    "{%- else %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Words the real Qwen vocabulary splits, as its pieces (byte-level: Ġ is a leading space).
SPLITS = {"Comprehend": ("Com", "preh", "end")}
# Short captions of tests and examples get whole-word tokens too.
EXTRA_WORDS = " a red circle on a blue background pink ring photo square"

TINY_TRANSFORMER_CONFIG: dict[str, Any] = {
    "patch_size": 1, "in_channels": 64, "out_channels": 64, "num_layers": 2,
    "attention_head_dim": 16, "num_attention_heads": 2, "context_in_dim": TEXT_WIDTH,
    "mlp_ratio": 3, "axes_dims_rope": (4, 6, 6),  # sums to the head size, as (16, 56, 56)
}
# The released depth (five levels, 16x down) at a tenth of its widths, one block a level.
TINY_VAE_CONFIG: dict[str, Any] = {**VAE_CONFIG, "base_dim": 8, "decoder_base_dim": 8,
                                   "num_res_blocks": 1}


def tiny_qwen3_tokenizer() -> Any:
    """The Qwen2 BPE tokenizer of the tiny flavor (see the module's docstring)."""
    return qwen_bpe_tokenizer(TEMPLATE.replace("{}", EXTRA_WORDS), CHAT_TEMPLATE, SPLITS)


def tiny_text_encoder(tok: Any) -> Any:
    """Qwen3VLForConditionalGeneration at tiny widths (3 text layers; Qwen3-VL's mRoPE
    layout) with a one-block vision tower, read before its final norm as the pipeline reads
    it (`no_final_norm`)."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    ids = {name: tok.convert_tokens_to_ids(t) for name, t in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"),
        ("vision_end_token_id", "<|vision_end|>"))}
    text = {**TEXT_CONFIG, "vocab_size": len(tok), "hidden_size": TEXT_WIDTH,
            "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 16, "max_position_embeddings": 8192,
            "pad_token_id": tok.pad_token_id,
            "rope_parameters": {**TEXT_CONFIG["rope_parameters"], "mrope_section": [4, 2, 2]}}
    vision = {**VISION_CONFIG, "depth": 1, "hidden_size": 16, "intermediate_size": 32,
              "num_heads": 2, "out_hidden_size": TEXT_WIDTH, "deepstack_visual_indexes": [0]}
    model = Qwen3VLForConditionalGeneration(Qwen3VLConfig(text_config=text, vision_config=vision,
                                                          tie_word_embeddings=False, **ids))
    return no_final_norm(model)


def build_tiny_qwen_image_21(variant: str | None = None) -> dict[str, Any]:
    """All components of a tiny Qwen-Image 2.1 model, keyed as QwenImage21Pipeline names them
    (the tokenizer besides the processor that holds it); the same for every `variant` (the
    edit variant is the same checkpoint's image-conditioned mode).

    Deterministic: the same weights on every call, whatever the caller's RNG state.
    """
    from diffusers import (AutoencoderKLQwenImage21, FlowMatchEulerDiscreteScheduler,
                           QwenImage21Transformer2DModel)
    from transformers import Qwen2VLImageProcessorPil

    tok = tiny_qwen3_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        transformer = QwenImage21Transformer2DModel(**TINY_TRANSFORMER_CONFIG)
        # The text norm is zero-centred (stored as scale - 1, zero in diffusers' init):
        # random values exercise it in tests. The shared modulation's gates (tanh of its
        # output) are near zero at the default init, so the blocks, and a LoRA on them, would
        # barely change an image: larger weights make a training step show in samples.
        with torch.no_grad():
            transformer.txt_in.text_norm.weight.normal_(std=0.1)
            transformer.modulation[1].weight.normal_(std=0.5)
        encoder = tiny_text_encoder(tok)
        vae = AutoencoderKLQwenImage21(**TINY_VAE_CONFIG)
    # References from 32 x 32 to 2048 x 2048 pixels reach Qwen3-VL at the autoencoder's size.
    images = Qwen2VLImageProcessorPil(patch_size=16, size={"shortest_edge": 32 * 32,
                                                           "longest_edge": 2048 * 2048})
    return {"transformer": transformer.eval(), "text_encoder": encoder.eval(), "tokenizer": tok,
            "processor": processor(tok, images), "vae": vae.eval(),
            "scheduler": FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG)}
