"""The built-in tiny Wan flavors: real diffusers/transformers classes with tiny configs.

WanTransformer3DModel with diffusers' own test configuration for Wan (2 blocks, 2 heads of 12,
patches (1, 2, 2), RMS q/k norms across heads, the cross-attention norm), AutoencoderKLWan at
the released depth but 12x narrower, a UMT5EncoderModel (gated-GELU, untied, per-layer relative
attention bias, as UMT5-XXL) over the shipped offline T5 tokenizer (a SentencePiece unigram
T5TokenizerFast, the class UMT5's tokenizer is), and UniPCMultistepScheduler with Wan's released
settings. Each variant has its own weights (the 14B kinds one head wider); the 2.2 low-noise
expert comes as the pipeline's `transformer_2`, and the 2.2 A14B pairs (T2V, and I2V with its
36 input channels) as both (the high-noise expert in `transformer`, each with its own
weights) with the released pipeline config's `boundary_ratio`, so the pipeline saves the
released model_index.json. Nothing is downloaded; weights are random from a fixed seed inside
a forked RNG.
"""

from __future__ import annotations

from typing import Any

import torch

from difftune.families.common.frame_vae import RELEASED_CONFIG as VAE_CONFIG
from difftune.families.common.tiny import TEXT_WIDTH, load_tiny_tokenizers
from difftune.families.wan.files import SCHEDULER_CONFIG, TEXT_ENCODER_CONFIG
from difftune.families.wan.spec import BOUNDARY, IMAGE_ENCODED

# Each variant's weights are its own (a LoRA of one does not fit another's tiny model alike).
SEEDS = {"2.1-t2v-1.3b": 2468, "2.1-t2v-14b": 2469, "2.2-t2v-a14b-low": 2470,
         "2.2-t2v-a14b": 2471, "2.2-i2v-a14b": 2472, "2.1-i2v-14b": 2473}
DEFAULT = "2.1-t2v-1.3b"
# diffusers' tests/pipelines/wan/test_wan.py transformer (rope_max_seq_len raised from 32 so
# that tiny runs at 512 pixels, 32 patches a side, still fit).
TINY_TRANSFORMER_CONFIG: dict[str, Any] = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 2,
    "attention_head_dim": 12,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": TEXT_WIDTH,
    "freq_dim": 256,
    "ffn_dim": 32,
    "num_layers": 2,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "rope_max_seq_len": 64,
}
# The 14B kinds are wider than the 1.3B, as released (40 heads against 12).
WIDER = {"num_attention_heads": 3, "ffn_dim": 48}
VARIANT_CONFIGS: dict[str, dict[str, Any]] = {
    "2.1-t2v-1.3b": TINY_TRANSFORMER_CONFIG,
    "2.1-t2v-14b": {**TINY_TRANSFORMER_CONFIG, **WIDER},
    "2.2-t2v-a14b-low": {**TINY_TRANSFORMER_CONFIG, **WIDER},
    "2.2-t2v-a14b": {**TINY_TRANSFORMER_CONFIG, **WIDER},
    # 16 noisy latent channels + 4 of the first-frame mask + 16 of the start-frame condition
    "2.2-i2v-a14b": {**TINY_TRANSFORMER_CONFIG, **WIDER, "in_channels": 36},
    # and the image cross-attention over the CLIP vision features (their width in, the
    # transformer's out: diffusers' WanImageEmbedding feeds add_k_proj/add_v_proj its width)
    "2.1-i2v-14b": {**TINY_TRANSFORMER_CONFIG, **WIDER, "in_channels": 36, "image_dim": 32,
                    "added_kv_proj_dim": 36},
}
# Wan 2.1 I2V's CLIP vision encoder (open-clip ViT-H/14's kind: its penultimate hidden
# states are read), tiny: 32 wide, 32-pixel images in 8-pixel patches, and its processor.
TINY_CLIP_VISION: dict[str, Any] = {"hidden_size": 32, "intermediate_size": 37,
                                    "num_hidden_layers": 3, "num_attention_heads": 4,
                                    "image_size": 32, "patch_size": 8, "projection_dim": 32,
                                    "hidden_act": "gelu"}  # ViT-H/14's, as released
# The variants of two experts (`transformer` the high-noise one, `transformer_2` the low).
PAIRS = ("2.2-t2v-a14b", "2.2-i2v-a14b")
TINY_VAE_CONFIG: dict[str, Any] = {**VAE_CONFIG, "base_dim": 8}  # released depth, 12x narrower


def tiny_umt5_config(vocab_size: int, pad_id: int, eos_id: int) -> Any:
    """UMT5 encoder config (UMT5-XXL's kind: gated-GELU, untied, relative attention bias in
    every layer), tiny widths."""
    from transformers import UMT5Config

    return UMT5Config(**{**TEXT_ENCODER_CONFIG, "vocab_size": vocab_size, "d_model": TEXT_WIDTH,
                         "d_kv": 16, "d_ff": 64, "num_layers": 2, "num_heads": 2,
                         "pad_token_id": pad_id, "eos_token_id": eos_id,
                         "decoder_start_token_id": pad_id})


def build_tiny_wan(variant: str | None = None) -> dict[str, Any]:
    """All components of a tiny Wan model of `variant`, keyed as WanPipeline names them (the
    2.2 low-noise expert as `transformer_2`, `transformer` then None; the A14B pair with its
    `boundary_ratio`, as the released folder's model_index.json has it).

    Deterministic: the same weights on every call, whatever the caller's RNG state."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel
    from transformers import UMT5EncoderModel

    variant = variant or DEFAULT
    _, tok = load_tiny_tokenizers()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEEDS[variant])
        transformer = WanTransformer3DModel(**VARIANT_CONFIGS[variant]).eval()
        encoder = UMT5EncoderModel(tiny_umt5_config(len(tok), tok.pad_token_id,
                                                    tok.eos_token_id)).eval()
        vae = AutoencoderKLWan(**TINY_VAE_CONFIG).eval()
    if variant in PAIRS:  # both experts: the low-noise one of its own weights
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(SEEDS[variant] + 1000)
            low = WanTransformer3DModel(**VARIANT_CONFIGS[variant]).eval()
        pair = {"transformer": transformer, "transformer_2": low,
                "boundary_ratio": BOUNDARY["i2v" if "i2v" in variant else "t2v"]}
    else:
        expert = variant == "2.2-t2v-a14b-low"
        pair = {"transformer": None if expert else transformer,
                "transformer_2": transformer if expert else None}
    return {**pair, **(_image_encoder(variant) if variant in IMAGE_ENCODED else {}),
            "text_encoder": encoder, "tokenizer": tok, "vae": vae,
            "scheduler": UniPCMultistepScheduler(**SCHEDULER_CONFIG)}


def _image_encoder(variant: str) -> dict[str, Any]:
    """Wan 2.1 I2V's tiny CLIP vision encoder and its image processor (CLIP's mean and std,
    resized and center-cropped to 32 pixels), as its pipeline names them."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEEDS[variant] + 2000)
        encoder = CLIPVisionModel(CLIPVisionConfig(**TINY_CLIP_VISION)).eval()
    processor = CLIPImageProcessor(size={"shortest_edge": 32},
                                   crop_size={"height": 32, "width": 32})
    return {"image_encoder": encoder, "image_processor": processor}
