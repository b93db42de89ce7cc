"""The built-in tiny Anima flavor: real diffusers/transformers classes with tiny configs.

CosmosTransformer3DModel (Cosmos-Predict2's text-to-image settings: no learnable position
embedding, RoPE scaled 4x in height and width, padding-mask channel), AnimaTextConditioner
(the LLM adapter; its output padded to 512 positions as released), AutoencoderKLQwenImage
(released depth, narrow), a Qwen3Model text encoder with a Qwen2 byte-level BPE tokenizer built
here (the 256 byte symbols and Qwen3's special tokens, <|endoftext|> padding), the shipped
offline T5 tokenizer (whose </s> ends every caption), and FlowMatchEulerDiscreteScheduler with
Anima's shift. Nothing is downloaded; weights are random from a fixed seed inside a forked RNG.
"""

from __future__ import annotations

from typing import Any

import torch

from difftune.families.anima.conditioner import AnimaTokenEmbedding
from difftune.families.anima.cosmos_compat import ensure_padding_mask_resize
from difftune.families.anima.files import (CONDITIONER_CONFIG, SCHEDULER_CONFIG,
                                           TEXT_ENCODER_CONFIG, TRANSFORMER_CONFIG)
from difftune.families.common.frame_vae import RELEASED_CONFIG as VAE_CONFIG
from difftune.families.common.tiny import TEXT_WIDTH, load_tiny_tokenizers

SEED = 2468
# Qwen3's special tokens (its tokenizer's first added tokens), in their id order.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

TINY_TRANSFORMER_CONFIG: dict[str, Any] = {
    **TRANSFORMER_CONFIG, "num_attention_heads": 2, "attention_head_dim": 16, "num_layers": 2,
    "text_embed_dim": TEXT_WIDTH, "adaln_lora_dim": 16,
}
TINY_VAE_CONFIG: dict[str, Any] = {**VAE_CONFIG, "base_dim": 8}  # released depth, narrow


def tiny_qwen3_tokenizer() -> Any:
    """A Qwen2 byte-level BPE tokenizer over the 256 byte symbols with Qwen3's special tokens
    (<|endoftext|> pads); it adds no BOS or EOS, as Qwen3's does not."""
    from transformers import AddedToken, Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    symbols = sorted(bytes_to_unicode().values()) + list(SPECIAL_TOKENS)
    tok = Qwen2Tokenizer(vocab={s: i for i, s in enumerate(symbols)}, merges=[], unk_token=None,
                         eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.add_tokens([AddedToken(t, special=True) for t in SPECIAL_TOKENS], special_tokens=True)
    return tok


def build_tiny_anima() -> dict[str, Any]:
    """All components of a tiny Anima model, keyed as AnimaModularPipeline names them, plus
    "t5_embedding" (the conditioner's T5-token table as an encoder).

    Deterministic: the same weights on every call, whatever the caller's RNG state.
    """
    from diffusers import (AnimaTextConditioner, AutoencoderKLQwenImage,
                           CosmosTransformer3DModel, FlowMatchEulerDiscreteScheduler)
    from transformers import Qwen3Config, Qwen3Model

    ensure_padding_mask_resize()
    tok, t5_tok = tiny_qwen3_tokenizer(), load_tiny_tokenizers()[1]
    encoder_config = Qwen3Config(**{
        **TEXT_ENCODER_CONFIG, "vocab_size": len(tok), "hidden_size": TEXT_WIDTH,
        "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 16, "max_position_embeddings": 1024,
        "pad_token_id": tok.pad_token_id})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        transformer = CosmosTransformer3DModel(**TINY_TRANSFORMER_CONFIG)
        conditioner = AnimaTextConditioner(**{
            **CONDITIONER_CONFIG, "source_dim": TEXT_WIDTH, "target_dim": TEXT_WIDTH,
            "model_dim": TEXT_WIDTH, "num_layers": 2, "num_attention_heads": 2,
            "target_vocab_size": len(t5_tok)})
        encoder = Qwen3Model(encoder_config)
        vae = AutoencoderKLQwenImage(**TINY_VAE_CONFIG)
    return {"transformer": transformer.eval(), "text_conditioner": conditioner.eval(),
            "text_encoder": encoder.eval(), "tokenizer": tok, "t5_tokenizer": t5_tok,
            "t5_embedding": AnimaTokenEmbedding(conditioner.embed.weight).eval(), "vae": vae.eval(),
            "scheduler": FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG)}
