"""Tiny captioning models for tests, saved as the folders users have: real transformers
classes at tiny sizes with offline tokenizers (the families' tiny builders), and a WD14-style
ONNX tagger made with the onnx library. Nothing is downloaded; weights come from fixed seeds.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import torch

# A Qwen-VL chat template of the released kind: content lists with image entries, and the
# Qwen3 switch that opens an empty thinking block when thinking is off (and a thinking one
# when it is on, which captioning must never ask for).
QWEN_VL_TEMPLATE = (
    "{%- for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{%- else %}{{ part['text'] }}{%- endif %}{%- endfor %}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{%- else %}<think>\n{%- endif %}{%- endif %}"
)


def qwen_image_folder(root: Path) -> Path:
    """A Qwen-Image diffusers folder's captioning part: text_encoder/ (a tiny Qwen2.5-VL) and
    tokenizer/ (a text-only chat template, as a diffusers tokenizer folder may have)."""
    from difftune.families.qwen_image.tiny import build_tiny_qwen_image

    parts = build_tiny_qwen_image()
    parts["text_encoder"].save_pretrained(root / "text_encoder")
    parts["tokenizer"].save_pretrained(root / "tokenizer")
    return root


def krea2_folder(root: Path, tied: bool = True) -> Path:
    """A Krea 2 diffusers folder's captioning part: text_encoder/ (a bare tiny Qwen3VLModel,
    its embeddings tied as Qwen3-VL-4B's are, or not) and tokenizer/."""
    from difftune.families.krea2.tiny import tiny_qwen_vl_tokenizer, tiny_text_encoder

    tok = tiny_qwen_vl_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(2)
        encoder = tiny_text_encoder(tok)
    encoder.config.tie_word_embeddings = tied
    encoder.save_pretrained(root / "text_encoder")
    _nonempty(root / "text_encoder", tok)
    tok.save_pretrained(root / "tokenizer")
    return root


def qwen25_vl_folder(root: Path) -> Path:
    """A Qwen2.5-VL instruct folder as published: weights, tokenizer with a content-list chat
    template, and the image processor's settings."""
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil

    from difftune.families.qwen_image.tiny import tiny_qwen2_tokenizer, tiny_qwen25_vl_config

    tok = tiny_qwen2_tokenizer()
    tok.chat_template = QWEN_VL_TEMPLATE
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        model = Qwen2_5_VLForConditionalGeneration(tiny_qwen25_vl_config(tok))
    model.save_pretrained(root)
    tok.save_pretrained(root)
    Qwen2VLImageProcessorPil(size={"shortest_edge": 3136, "longest_edge": 128 * 128}
                             ).save_pretrained(root)
    return root


def tagger_folder(root: Path, side: int = 16, batch: str | int = "N") -> Path:
    """A WD14-style tagger: model.onnx maps a (N, side, side, 3) BGR 0-255 batch to one
    sigmoid per tag of selected_tags.csv: "rating:general" (rating, always high), "red_hair"
    (the red channel's mean), "blue_sky" (the blue channel's), "hatsune_miku" (a character,
    red again) and "^_^" (blue). Its batch axis is dynamic ("N"), as the released taggers'
    is, or fixed (1), as some exports have it."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    import numpy as np

    root.mkdir(parents=True, exist_ok=True)
    tags = [("general", "9"), ("red_hair", "0"), ("blue_sky", "0"), ("hatsune_miku", "4"),
            ("^_^", "0")]
    with open(root / "selected_tags.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["tag_id", "name", "category", "count"])
        w.writerows([i, name, cat, 100] for i, (name, cat) in enumerate(tags))
    # channel means (B, G, R order) / 255, scaled so a pure channel gives a logit of +6, an
    # absent one -6; the rating tag's bias keeps it high always.
    weights = np.zeros((3, len(tags)), np.float32)
    weights[2, 1] = weights[2, 3] = 12 / 255
    weights[0, 2] = weights[0, 4] = 12 / 255
    bias = np.array([6, -6, -6, -6, -6], np.float32)
    graph = helper.make_graph(
        [helper.make_node("ReduceMean", ["pixels", "axes"], ["mean"], keepdims=0),
         helper.make_node("MatMul", ["mean", "w"], ["logits0"]),
         helper.make_node("Add", ["logits0", "b"], ["logits"]),
         helper.make_node("Sigmoid", ["logits"], ["predictions_sigmoid"])],
        "tiny_tagger",
        [helper.make_tensor_value_info("pixels", TensorProto.FLOAT, [batch, side, side, 3])],
        [helper.make_tensor_value_info("predictions_sigmoid", TensorProto.FLOAT,
                                       [batch, len(tags)])],
        [numpy_helper.from_array(np.array([1, 2], np.int64), "axes"),
         numpy_helper.from_array(weights, "w"), numpy_helper.from_array(bias, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    onnx.checker.check_model(model)
    onnx.save(model, str(root / "model.onnx"))
    return root


def images_folder(root: Path, colors: dict[str, Any]) -> Path:
    """A dataset folder: one small PNG of each color, named by its key."""
    from PIL import Image

    root.mkdir(parents=True, exist_ok=True)
    for name, color in colors.items():
        Image.new("RGB", (40, 32), color).save(root / f"{name}.png")
    return root


def _nonempty(folder: Path, tok: Any) -> None:
    """Random tiny models often answer with an end token at once: the generation config saved
    in `folder` asks for a few tokens and no special ones but the end, so captions are visible."""
    from transformers import GenerationConfig

    cfg = (GenerationConfig.from_pretrained(folder)
           if (folder / "generation_config.json").is_file() else GenerationConfig())
    ends = {cfg.eos_token_id, cfg.forced_eos_token_id, tok.eos_token_id}
    cfg.min_new_tokens = 3
    cfg.suppress_tokens = sorted(set(tok.all_special_ids) - ends)
    cfg.save_pretrained(folder)


def florence2_folder(root: Path) -> Path:
    """A Florence-2 folder in transformers' native format: a tiny DaViT + BART model, a
    byte-level BART tokenizer (with Florence-2's <image> token) and its processor."""
    from transformers import (BartTokenizer, CLIPImageProcessorPil, Florence2Config,
                              Florence2ForConditionalGeneration, Florence2Processor)
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    symbols = sorted(bytes_to_unicode().values())
    vocab = {s: i for i, s in enumerate(["<s>", "<pad>", "</s>", "<unk>", *symbols, "<mask>"])}
    tok = BartTokenizer(vocab=vocab, merges=[], extra_special_tokens={"image_token": "<image>"})
    # 64x64 pixels: a 2x2 grid after DaViT's 32x downscale, plus the pooled token.
    images = CLIPImageProcessorPil(size={"height": 64, "width": 64}, do_center_crop=False,
                                   image_seq_length=5)
    text = {"vocab_size": len(tok), "d_model": 32, "encoder_layers": 1, "decoder_layers": 1,
            "encoder_attention_heads": 2, "decoder_attention_heads": 2, "encoder_ffn_dim": 64,
            "decoder_ffn_dim": 64, "max_position_embeddings": 128,
            "pad_token_id": tok.pad_token_id, "bos_token_id": tok.bos_token_id,
            "eos_token_id": tok.eos_token_id, "decoder_start_token_id": tok.eos_token_id}
    vision = {"depths": (1, 1, 1, 1), "embed_dim": (8, 16, 16, 32), "num_heads": (1, 2, 2, 4),
              "num_groups": (1, 2, 2, 4), "projection_dim": 32, "window_size": 2,
              "max_temporal_embeddings": 4, "max_position_embeddings": 8}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        model = Florence2ForConditionalGeneration(Florence2Config(
            text_config=text, vision_config=vision, image_token_id=tok.image_token_id))
    model.save_pretrained(root)
    _nonempty(root, tok)
    Florence2Processor(image_processor=images, tokenizer=tok).save_pretrained(root)
    return root


LLAVA_TEMPLATE = (
    "{%- for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{%- for part in message['content'] %}{%- if part['type'] == 'image' %}<image>\n"
    "{%- else %}{{ part['text'] }}{%- endif %}{%- endfor %}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


def llava_folder(root: Path) -> Path:
    """A LLaVA folder (JoyCaption's architecture at tiny sizes): a CLIP vision tower, a Qwen2
    language model, the tiny Qwen2 tokenizer with LLaVA's <image> token, and its processor."""
    from transformers import (AddedToken, CLIPImageProcessorPil, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor)

    from difftune.families.qwen_image.tiny import tiny_qwen2_tokenizer

    tok = tiny_qwen2_tokenizer()
    tok.add_tokens([AddedToken("<image>", special=True)], special_tokens=True)
    images = CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32,
                                                                          "width": 32})
    vision = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
              "num_attention_heads": 2, "image_size": 32, "patch_size": 8, "projection_dim": 16}
    text = {"vocab_size": len(tok), "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
            "pad_token_id": tok.pad_token_id, "eos_token_id": tok.eos_token_id}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(9)
        model = LlavaForConditionalGeneration(LlavaConfig(
            vision_config={"model_type": "clip_vision_model", **vision},
            text_config={"model_type": "qwen2", **text},
            image_token_id=tok.convert_tokens_to_ids("<image>"), vision_feature_layer=-1))
    model.save_pretrained(root)
    _nonempty(root, tok)
    LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=8,
                   vision_feature_select_strategy="default", num_additional_image_tokens=1,
                   chat_template=LLAVA_TEMPLATE).save_pretrained(root)
    return root
