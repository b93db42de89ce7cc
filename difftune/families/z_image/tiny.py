"""The built-in tiny Z-Image flavor: real diffusers/transformers classes with tiny configs.

ZImageTransformer2DModel, the FLUX.1-style AutoencoderKL (the shared tiny one), a Qwen3Model
text encoder and a Qwen2 byte-level BPE tokenizer built here from a tiny vocabulary (the 256
byte symbols) with Qwen3's real special tokens and a chat template producing Qwen3's prompt
format, and FlowMatchEulerDiscreteScheduler with Z-Image (Base)'s settings (the model one trains; Turbo
is step-distilled). Nothing is
downloaded; weights are random from a fixed seed inside a forked RNG.
"""

from __future__ import annotations

from typing import Any

import torch

from difftune.families.common.tiny import TEXT_WIDTH, load_tiny_vae
from difftune.families.z_image.files import BASE_SCHEDULER_CONFIG, TEXT_ENCODER_CONFIG

SEED = 1234
# Qwen3's special tokens (added tokens of its tokenizer), in its id order.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
THINK_TOKENS = ("<think>", "</think>")
# Qwen3's prompt format (ChatML with its thinking switch), written for the messages a text
# encoder sees: system/user/assistant turns, the generation prompt, and the empty think block
# Qwen3 inserts when enable_thinking is false.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)

TINY_TRANSFORMER_CONFIG: dict[str, Any] = {
    "all_patch_size": (2,),
    "all_f_patch_size": (1,),
    "in_channels": 16,
    "dim": 64,
    "n_layers": 2,
    "n_refiner_layers": 1,
    "n_heads": 2,
    "n_kv_heads": 2,
    "cap_feat_dim": TEXT_WIDTH,
    "axes_dims": [8, 12, 12],  # sums to the head size (64 / 2), Z-Image's proportions
    "axes_lens": [1024, 512, 512],
}


def tiny_qwen_tokenizer() -> Any:
    """A Qwen2 byte-level BPE tokenizer over the 256 byte symbols, Qwen3's special tokens
    (<|endoftext|> pads, <|im_end|> ends) and the chat template."""
    from transformers import AddedToken, Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    symbols = sorted(bytes_to_unicode().values()) + list(SPECIAL_TOKENS) + list(THINK_TOKENS)
    vocab = {ch: i for i, ch in enumerate(symbols)}
    tok = Qwen2Tokenizer(vocab=vocab, merges=[], unk_token=None, eos_token="<|im_end|>",
                         pad_token="<|endoftext|>")
    tok.add_tokens([AddedToken(t, special=True) for t in SPECIAL_TOKENS], special_tokens=True)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_qwen3_config(vocab_size: int, pad_id: int) -> Any:
    """Qwen3 decoder config (grouped-query attention, q/k norms), tiny widths; RoPE base, norm
    epsilon and tied embeddings as Qwen3-4B (what single files do not record)."""
    from transformers import Qwen3Config

    return Qwen3Config(**{**TEXT_ENCODER_CONFIG, "vocab_size": vocab_size,
                          "hidden_size": TEXT_WIDTH, "intermediate_size": 64,
                          "num_hidden_layers": 3, "num_attention_heads": 2,
                          "num_key_value_heads": 1, "head_dim": 16,
                          "max_position_embeddings": 1024, "pad_token_id": pad_id})


def build_tiny_z_image() -> dict[str, Any]:
    """All components of a tiny Z-Image model, keyed as ZImagePipeline names them.

    Deterministic: the same weights on every call, whatever the caller's RNG state.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImageTransformer2DModel
    from transformers import Qwen3Model

    tok = tiny_qwen_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        transformer = ZImageTransformer2DModel(**TINY_TRANSFORMER_CONFIG)
        # The pad embeddings start at zero in diffusers; random ones exercise them in tests.
        with torch.no_grad():
            transformer.x_pad_token.normal_()
            transformer.cap_pad_token.normal_()
        encoder = Qwen3Model(tiny_qwen3_config(len(tok), tok.pad_token_id))
    return {"transformer": transformer.eval(), "text_encoder": encoder.eval(),
            "tokenizer": tok, "vae": load_tiny_vae(),
            "scheduler": FlowMatchEulerDiscreteScheduler(**BASE_SCHEDULER_CONFIG)}
