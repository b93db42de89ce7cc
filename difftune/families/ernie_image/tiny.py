"""The built-in tiny ERNIE-Image flavor: real diffusers/transformers classes with tiny configs.

ErnieImageTransformer2DModel, FLUX.2's AutoencoderKLFlux2 (the shared tiny one, batch-norm
statistics randomized), a Mistral3Model text encoder (a tiny Ministral 3 language model with
Ministral 3's RoPE settings, and a one-layer Pixtral vision tower captions never use), a
byte-level BPE tokenizer holding Mistral's control tokens at their Tekken ids (BOS <s> = 1
added to every text as the released tokenizer does, <pad> = 11, [IMG] = 10), and
FlowMatchEulerDiscreteScheduler with the released settings. ErnieImagePipeline.encode_prompt
tokenizes captions without a chat template, so the tokenizer carries none. Nothing is
downloaded; weights are random from a fixed seed inside a forked RNG.
"""

from __future__ import annotations

from typing import Any

import torch

from difftune.families.common.bn_vae import TINY_LATENT_CHANNELS, tiny_vae
from difftune.families.common.tiny import TEXT_WIDTH
from difftune.families.ernie_image.files import SCHEDULER_CONFIG, TEXT_ENCODER_CONFIG

SEED = 4242
MAX_LENGTH = 2048  # the released tokenizer's model_max_length (encode_prompt truncates there)
# Mistral's control tokens in Tekken's id order (0-19): unk, BOS, EOS, the chat markers,
# Pixtral's image tokens, and <pad> at 11 (Ministral3Config's pad_token_id).
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]",
                  "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]",
                  "[IMG]", "<pad>", "[IMG_BREAK]", "[IMG_END]", "[PREFIX]", "[MIDDLE]",
                  "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[TOOL_CONTENT]")

TINY_TRANSFORMER_CONFIG: dict[str, Any] = {
    "hidden_size": 64, "num_attention_heads": 2, "num_layers": 2, "ffn_hidden_size": 128,
    "in_channels": TINY_LATENT_CHANNELS * 4, "out_channels": TINY_LATENT_CHANNELS * 4,
    "patch_size": 1, "text_in_dim": TEXT_WIDTH,
    "rope_axes_dim": (8, 12, 12),  # sums to the head size (64 / 2), ERNIE-Image's proportions
}


def tiny_mistral_tokenizer() -> Any:
    """Byte-level BPE over the 256 byte symbols after Mistral's 20 control tokens, adding BOS
    to every text (no EOS), padding with <pad>, truncating at 2048 tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    symbols = list(SPECIAL_TOKENS) + sorted(bytes_to_unicode().values())
    core = Tokenizer(models.BPE({s: i for i, s in enumerate(symbols)}, [], unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B",
                                                        special_tokens=[("<s>", 1)])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>",
                                  unk_token="<unk>", pad_token="<pad>",
                                  model_max_length=MAX_LENGTH)
    tok.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS[3:])})
    return tok


def tiny_mistral3(tok: Any) -> Any:
    """Mistral3Model: a 3-layer Ministral 3 language model (grouped-query attention, head size
    128 as released, YaRN RoPE as Ministral3Config's defaults) and a one-layer vision tower."""
    from transformers import (
        Ministral3Config,
        Mistral3Config,
        Mistral3Model,
        PixtralVisionConfig,
    )

    text = Ministral3Config(**{**TEXT_ENCODER_CONFIG, "vocab_size": len(tok),
                               "hidden_size": TEXT_WIDTH, "intermediate_size": 64,
                               "num_hidden_layers": 3, "num_attention_heads": 2,
                               "num_key_value_heads": 1, "pad_token_id": tok.pad_token_id})
    vision = PixtralVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, image_size=32, patch_size=8)
    return Mistral3Model(Mistral3Config(text_config=text, vision_config=vision,
                                        image_token_index=tok.convert_tokens_to_ids("[IMG]")))


def build_tiny_ernie_image() -> dict[str, Any]:
    """All components of a tiny ERNIE-Image model, keyed as ErnieImagePipeline names them.

    Deterministic: the same weights on every call, whatever the caller's RNG state.
    """
    from diffusers import ErnieImageTransformer2DModel, FlowMatchEulerDiscreteScheduler

    tok = tiny_mistral_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        transformer = ErnieImageTransformer2DModel(**TINY_TRANSFORMER_CONFIG)
        # diffusers zero-initializes the shared modulation and the output layer (a model that
        # predicts 0 and gates every block shut); random ones let tests see each layer.
        with torch.no_grad():
            for layer in (transformer.adaLN_modulation[-1], transformer.final_linear):
                layer.weight.normal_(0.0, 0.05)
                layer.bias.normal_(0.0, 0.05)
        vae = tiny_vae()
        encoder = tiny_mistral3(tok)
    return {"transformer": transformer.eval(), "vae": vae, "text_encoder": encoder.eval(),
            "tokenizer": tok, "scheduler": FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG)}
