"""Text encoders of any kind, driven by their declared `TextEncoderSpec`.

Only transformers' public API is used: the tokenizer call, the model's forward with
`output_hidden_states`, and its output fields. Nothing probes model internals by attribute
name, so CLIP, CLIP-with-projection and T5 go through the same two functions.
"""

from __future__ import annotations

from typing import Any

import torch

from difftune.families.base import TextEncoderSpec


def module_device(module: torch.nn.Module) -> torch.device:
    """The device of a module's first parameter (cpu for a module without parameters)."""
    for p in module.parameters():
        return p.device
    return torch.device("cpu")


def tokenize(tokenizer: Any, texts: list[str], max_length: int) -> dict[str, torch.Tensor]:
    """Pad/truncate every text to `max_length` tokens, as the pipelines do at inference."""
    enc = tokenizer(
        texts,
        padding="max_length",
        max_length=max_length,
        truncation=True,
        return_tensors="pt",
    )
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}


@torch.no_grad()
def encode(
    spec: TextEncoderSpec,
    model: torch.nn.Module,
    tokenizer: Any,
    texts: list[str],
    max_length: int,
) -> dict[str, torch.Tensor]:
    """Encode texts with one encoder; returns "hidden" and/or "pooled" (and "mask" if used).

    `hidden` is the last or penultimate hidden state as the spec declares; `pooled` is the
    model's pooled (CLIP) or projected (CLIP with projection) output.
    """
    tokens = tokenize(tokenizer, texts, max_length)
    device = module_device(model)
    ids = tokens["input_ids"].to(device)
    mask = tokens["attention_mask"].to(device)
    want_states = spec.hidden == "penultimate"
    kwargs: dict[str, Any] = {"output_hidden_states": want_states}
    if spec.mask:
        kwargs["attention_mask"] = mask
    out = model(ids, **kwargs)
    result: dict[str, torch.Tensor] = {}
    if spec.hidden == "last":
        result["hidden"] = out.last_hidden_state
    elif spec.hidden == "penultimate":
        result["hidden"] = out.hidden_states[-2]
    if spec.pooled:
        projected = spec.kind == "clip_projection"
        result["pooled"] = out.text_embeds if projected else out.pooler_output
    if spec.mask:
        result["mask"] = mask
    return result
