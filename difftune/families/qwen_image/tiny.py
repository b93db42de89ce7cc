"""The built-in tiny Qwen-Image flavor: real diffusers/transformers classes with tiny configs.

QwenImageTransformer2DModel, AutoencoderKLQwenImage (the video-style VAE, three spatial
downsamples as released), a Qwen2_5_VLForConditionalGeneration text encoder with a tiny vision
tower, and a Qwen2 byte-level BPE tokenizer built here: the 256 byte symbols, Qwen2's real
special tokens (ChatML and vision tokens), and merges for the words of QwenImagePipeline's
prompt template, so that its system prefix is the same 34 tokens it is for the real
tokenizer (the pipeline drops exactly 34). FlowMatchEulerDiscreteScheduler with the released
settings. The edit variants' tokenizer also merges the edit template's words, and comes inside
a Qwen2VLProcessor (Qwen2VLImageProcessorPil's defaults: 14-pixel patches merged 2x2, as
released) whose image tokens the tiny vision tower reads. Nothing is downloaded; weights are
random from a fixed seed inside a forked RNG.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from difftune.families.common.tiny import TEXT_WIDTH
from difftune.families.common.frame_vae import RELEASED_CONFIG as VAE_CONFIG
from difftune.families.qwen_image.files import SCHEDULER_CONFIG, vl_processor
from difftune.families.qwen_image.spec import EDIT_TEMPLATE, TEMPLATE

SEED = 4321
# Qwen2's special tokens (its tokenizer's added special tokens), in their id order.
SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
)
# ChatML, Qwen2.5-VL's prompt format for text-only messages.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Words given whole-word merges besides the template's (short captions in tests and examples).
EXTRA_WORDS = ("a", "red", "blue", "circle", "square", "on", "in", "pink", "ring", "photo")

# Pieces Qwen2's vocabulary holds whole in the edit template (" (", "),", " user", "'s"): with
# them its prefix is the same 64 tokens the edit pipelines drop.
EDIT_MERGES = (("Ġ", "("), (")", ","), ("Ġ", "user"), ("'", "s"))

TINY_TRANSFORMER_CONFIG: dict[str, Any] = {
    "patch_size": 2,
    "in_channels": 64,
    "out_channels": 16,
    "num_layers": 2,
    "attention_head_dim": 16,
    "num_attention_heads": 2,
    "joint_attention_dim": TEXT_WIDTH,
    "guidance_embeds": False,
    "axes_dims_rope": (4, 6, 6),  # sums to the head size, Qwen-Image's (16, 56, 56) kind
}
TINY_VAE_CONFIG: dict[str, Any] = {**VAE_CONFIG, "base_dim": 8}  # released depth, 12x narrower


def template_words(edit: bool = False) -> list[str]:
    """The byte-level pre-tokens of the template and extra words that get merges (" the" as
    "Ġthe"), in first-seen order; then the edit template's (`edit`)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte = bytes_to_unicode()
    text = re.sub(r"<\|[a-z_]+\|>", "\n", TEMPLATE.replace("{}", " ")) + " " + " ".join(EXTRA_WORDS)
    if edit:
        text += re.sub(r"<\|[a-z_]+\|>", "\n", EDIT_TEMPLATE.replace("{}", " "))
    words = re.findall(r" ?[A-Za-z]+", text)
    out: list[str] = []
    for w in words:
        mapped = "".join(byte[b] for b in w.encode("utf-8"))
        if len(mapped) > 1 and mapped not in out:
            out.append(mapped)
    return out


def tiny_qwen2_tokenizer(edit: bool = False) -> Any:
    """A Qwen2 byte-level BPE tokenizer: the 256 byte symbols, a merge chain for each template
    word (so each is one token, as in Qwen2's real vocabulary), Qwen2's special tokens
    (<|endoftext|> pads, <|im_end|> ends) and a ChatML chat template."""
    from transformers import AddedToken, Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    symbols = sorted(bytes_to_unicode().values())
    merges: list[tuple[str, str]] = []
    for word in template_words(edit):
        for i in range(1, len(word)):
            left, piece = word[:i], word[: i + 1]
            if piece not in symbols:
                merges.append((left, word[i]))
                symbols.append(piece)
    for left, right in EDIT_MERGES if edit else ():
        merges.append((left, right))
        symbols.append(left + right)
    vocab = {s: i for i, s in enumerate(symbols + list(SPECIAL_TOKENS))}
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges, unk_token=None, eos_token="<|im_end|>",
                         pad_token="<|endoftext|>")
    tok.add_tokens([AddedToken(t, special=True) for t in SPECIAL_TOKENS], special_tokens=True)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_qwen25_vl_config(tok: Any) -> Any:
    """Qwen2.5-VL config at tiny widths: a 3-layer text model (multimodal RoPE sections that
    fit its head size) and a 1-block vision tower projecting to the text width; the vision
    token ids are the tiny tokenizer's."""
    from transformers import Qwen2_5_VLConfig

    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    text = {"vocab_size": len(tok), "hidden_size": TEXT_WIDTH, "intermediate_size": 64,
            "num_hidden_layers": 3, "num_attention_heads": 2, "num_key_value_heads": 1,
            "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0,
                                "mrope_section": [2, 3, 3]},
            "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"]}
    vision = {"depth": 1, "hidden_size": 80, "intermediate_size": 32, "num_heads": 1,
              "out_hidden_size": TEXT_WIDTH, "fullatt_block_indexes": [0]}
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision,
                            image_token_id=ids["<|image_pad|>"],
                            video_token_id=ids["<|video_pad|>"],
                            vision_start_token_id=ids["<|vision_start|>"],
                            vision_end_token_id=ids["<|vision_end|>"],
                            tie_word_embeddings=False)


def tiny_processor(tok: Any) -> Any:
    """Qwen2.5-VL's processor over `tok` and the image processor's defaults."""
    from transformers import Qwen2VLImageProcessorPil

    return vl_processor(Qwen2VLImageProcessorPil(), tok)


def build_tiny_qwen_image(variant: str | None = None) -> dict[str, Any]:
    """All components of a tiny Qwen-Image model, keyed as QwenImagePipeline names them (as
    the edit pipelines name them for an edit `variant`: a "processor" holding the tokenizer).

    Deterministic: the same weights on every call, whatever the caller's RNG state.
    """
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLForConditionalGeneration

    edit = variant is not None and variant != "base"
    tok = tiny_qwen2_tokenizer(edit)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        transformer = QwenImageTransformer2DModel(**TINY_TRANSFORMER_CONFIG)
        encoder = Qwen2_5_VLForConditionalGeneration(tiny_qwen25_vl_config(tok))
        vae = AutoencoderKLQwenImage(**TINY_VAE_CONFIG)
    parts = {"transformer": transformer.eval(), "text_encoder": encoder.eval(), "tokenizer": tok,
             "vae": vae.eval(), "scheduler": FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG)}
    if edit:
        parts["processor"] = tiny_processor(tok)
    return parts
