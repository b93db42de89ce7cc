"""A Qwen3 text encoder from one file, as ComfyUI keeps them (`qwen_3_4b.safetensors` for
Z-Image, `qwen_3_06b_base.safetensors` for Anima): the causal LM's `model.*` tensors (any
`lm_head` dropped) or a bare Qwen3Model state, its sizes read from the tensors' shapes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from difftune.families.common.components import pretrained_from_state
from difftune.families.common.single_file import (cast_state, count_blocks, missing_error,
                                                  read_safetensors, strip_prefix)


def load_qwen3_file(path: Path, dtype: torch.dtype, defaults: dict[str, Any]) -> Any:
    """Qwen3Model from `path` in `dtype`; `defaults` is the released config, for what the
    shapes do not tell (RoPE base, norm epsilon, tied embeddings, positions)."""
    from transformers import Qwen3Config, Qwen3Model

    sd = strip_prefix(read_safetensors(path, "Qwen3 text encoder"), ("model.",))
    sd = {k: v for k, v in sd.items() if not k.startswith("lm_head.")}
    try:
        vocab, hidden = sd["embed_tokens.weight"].shape
        head = sd["layers.0.self_attn.q_norm.weight"].shape[0]
        config = Qwen3Config(**{
            **defaults, "vocab_size": vocab, "hidden_size": hidden, "head_dim": head,
            "num_hidden_layers": count_blocks(sd, "layers."),
            "num_attention_heads": sd["layers.0.self_attn.q_proj.weight"].shape[0] // head,
            "num_key_value_heads": sd["layers.0.self_attn.k_proj.weight"].shape[0] // head,
            "intermediate_size": sd["layers.0.mlp.gate_proj.weight"].shape[0]})
    except KeyError as err:
        raise missing_error(path, "a Qwen3 text encoder", err) from None
    return pretrained_from_state(Qwen3Model, config, cast_state(sd, dtype), dtype, path, "Qwen3",
                                 "model.text_encoder")
