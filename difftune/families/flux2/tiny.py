"""The built-in tiny FLUX.2 flavors (klein and dev): real diffusers/transformers classes, tiny.

Flux2Transformer2DModel, AutoencoderKLFlux2 (its batch-norm statistics randomized so the latent
normalization is exercised), FlowMatchEulerDiscreteScheduler with the released settings, and
per variant its text encoder: klein a Qwen3ForCausalLM with a Qwen2 byte-level tokenizer
(Qwen3's special tokens and prompt format), dev a Mistral3ForConditionalGeneration with a
byte-level tokenizer holding Mistral's control tokens and prompt format. The encoders have just
enough layers for the hidden states the pipelines read (27 and 30). Tokenizers are built here
over the 256 byte symbols, offline; weights are random from a fixed seed in a forked RNG.
"""

from __future__ import annotations

from typing import Any

import torch

from difftune.families.flux2.files import SCHEDULER_CONFIG

SEED = 2024
WIDTH = 16  # the encoders' hidden size; the transformer reads three layers: 3 * WIDTH features
LATENT_CHANNELS = 8  # patchified 2x2: 32 transformer input channels
QWEN_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
QWEN_THINK = ("<think>", "</think>")
# Qwen3's ChatML prompt format for the turns a text encoder sees, with the empty think block
# Qwen3 writes after the generation prompt when enable_thinking is false.
QWEN_TEMPLATE = (
    "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
    "'<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)
MISTRAL_SPECIAL = ("<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]",
                   "[/SYSTEM_PROMPT]", "[IMG]")
# Mistral Small 3.1's prompt format: BOS, the system prompt in its markers, each user turn in
# [INST] ... [/INST]; content given as a string or as typed text parts.
MISTRAL_TEMPLATE = (
    "{%- macro text(c) -%}{%- if c is string -%}{{- c -}}{%- else -%}"
    "{%- for p in c -%}{%- if p['type'] == 'text' -%}{{- p['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}{%- endmacro -%}"
    "{{- bos_token -}}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}{{- '[SYSTEM_PROMPT]' + text(m['content']) + "
    "'[/SYSTEM_PROMPT]' -}}"
    "{%- elif m['role'] == 'user' -%}{{- '[INST]' + text(m['content']) + '[/INST]' -}}"
    "{%- else -%}{{- text(m['content']) + eos_token -}}{%- endif -%}"
    "{%- endfor -%}"
)


def tiny_transformer_config(variant: str) -> dict[str, Any]:
    """Flux2Transformer2DModel config: one double and two single blocks, head size 16 split
    over the four RoPE axes as (32, 32, 32, 32) is at 128; dev has the guidance embedding."""
    return {"in_channels": LATENT_CHANNELS * 4, "num_layers": 1, "num_single_layers": 2,
            "attention_head_dim": 16, "num_attention_heads": 2, "joint_attention_dim": 3 * WIDTH,
            "timestep_guidance_channels": 32, "axes_dims_rope": (4, 4, 4, 4),
            "guidance_embeds": variant == "dev"}


TINY_VAE_CONFIG: dict[str, Any] = {
    "block_out_channels": (16, 16, 16, 16), "layers_per_block": 1, "norm_num_groups": 8,
    "latent_channels": LATENT_CHANNELS,
}


def tiny_qwen_tokenizer() -> Any:
    """Qwen2 byte-level BPE over the 256 byte symbols with Qwen3's special tokens (pad
    <|endoftext|>, end <|im_end|>) and its prompt format."""
    from transformers import AddedToken, Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    symbols = sorted(bytes_to_unicode().values()) + list(QWEN_SPECIAL) + list(QWEN_THINK)
    tok = Qwen2Tokenizer(vocab={s: i for i, s in enumerate(symbols)}, merges=[],
                         unk_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.add_tokens([AddedToken(t, special=True) for t in QWEN_SPECIAL], special_tokens=True)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN_THINK])
    tok.chat_template = QWEN_TEMPLATE
    return tok


def tiny_mistral_tokenizer() -> Any:
    """A byte-level BPE tokenizer with Mistral's control tokens first (BOS <s>, EOS </s>, pad
    <pad>), no automatic BOS (the prompt format writes it) and Mistral's prompt format."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    symbols = list(MISTRAL_SPECIAL) + sorted(bytes_to_unicode().values())
    core = Tokenizer(models.BPE({s: i for i, s in enumerate(symbols)}, [], unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>",
                                  unk_token="<unk>", pad_token="<pad>")
    tok.add_special_tokens({"additional_special_tokens": list(MISTRAL_SPECIAL[4:])})
    tok.chat_template = MISTRAL_TEMPLATE
    return tok


def tiny_qwen3(tok: Any) -> Any:
    """Qwen3ForCausalLM with 28 tiny layers (hidden_states up to 28; klein reads 9, 18, 27)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(
        vocab_size=len(tok), hidden_size=WIDTH, intermediate_size=32, num_hidden_layers=28,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=1024,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id))


def tiny_mistral3(tok: Any) -> Any:
    """Mistral3ForConditionalGeneration: a 30-layer tiny Mistral text model (dev reads hidden
    states 10, 20, 30) and a one-layer Pixtral vision tower the captions never use."""
    from transformers import (
        Mistral3Config,
        Mistral3ForConditionalGeneration,
        MistralConfig,
        PixtralVisionConfig,
    )

    text = MistralConfig(vocab_size=len(tok), hidden_size=WIDTH, intermediate_size=32,
                         num_hidden_layers=30, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=8, max_position_embeddings=1024, rms_norm_eps=1e-5,
                         pad_token_id=tok.pad_token_id, sliding_window=None)
    vision = PixtralVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, image_size=32, patch_size=8)
    return Mistral3ForConditionalGeneration(Mistral3Config(
        text_config=text, vision_config=vision, tie_word_embeddings=False,
        image_token_index=tok.convert_tokens_to_ids("[IMG]")))


def tiny_vae() -> Any:
    """AutoencoderKLFlux2 at the tiny size from the caller's RNG, its batch-norm statistics
    away from (0, 1) so the latent normalization shows."""
    from diffusers import AutoencoderKLFlux2

    vae = AutoencoderKLFlux2(**TINY_VAE_CONFIG)
    with torch.no_grad():
        vae.bn.running_mean.normal_(0.0, 0.5)
        vae.bn.running_var.uniform_(0.5, 2.0)
    return vae


def build_tiny_flux2(variant: str) -> dict[str, Any]:
    """All components of a tiny FLUX.2 `variant` ("klein" or "dev"), keyed as its pipeline
    names them. Deterministic: the same weights on every call, whatever the caller's RNG."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel

    tok = tiny_mistral_tokenizer() if variant == "dev" else tiny_qwen_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        transformer = Flux2Transformer2DModel(**tiny_transformer_config(variant))
        vae = tiny_vae()
        encoder = tiny_mistral3(tok) if variant == "dev" else tiny_qwen3(tok)
    return {"transformer": transformer.eval(), "vae": vae.eval(), "text_encoder": encoder.eval(),
            "tokenizer": tok, "scheduler": FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG)}
