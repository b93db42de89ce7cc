"""Anima's text side between the encoders and the transformer: the T5-token lookup that
stands as an encoder, and the LLM adapter (diffusers' AnimaTextConditioner) joining it with
Qwen3's hidden states.

The conditioner's forward embeds T5 token ids with its own table and cross-attends from them
to Qwen3's states. difftune caches the lookup's output like any encoder's (the
`AnimaTokenEmbedding` module holds a copy of that table), so the conditioner is run here with
its table's output replaced by the cached embeddings (a forward hook): every other step is
diffusers' own forward, unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.modeling_outputs import BaseModelOutput


class AnimaTokenEmbedding(torch.nn.Module):
    """The LLM adapter's T5-vocabulary embedding as a text encoder: token ids -> their rows
    (`last_hidden_state`), so that the generic encoding and caching read it (the mask and
    other arguments a transformers encoder takes are accepted and change nothing)."""

    def __init__(self, table: torch.Tensor) -> None:
        """A copy of the adapter's (vocabulary, target_dim) table (no random init)."""
        super().__init__()
        self.embed = torch.nn.Embedding.from_pretrained(table.detach().clone(), freeze=True)

    @property
    def dtype(self) -> torch.dtype:
        """The table's dtype (read by placement and cache keys, as for transformers models)."""
        return self.embed.weight.dtype

    def get_input_embeddings(self) -> torch.nn.Embedding:
        """The table (transformers' accessor)."""
        return self.embed

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                output_hidden_states: bool = False, **_: Any) -> BaseModelOutput:
        """The rows of `input_ids`."""
        return BaseModelOutput(last_hidden_state=self.embed(input_ids))


def _at_least_one(hidden: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of empty captions (no Qwen3 token) as AnimaTextEncoderStep gives it: one
    masked position of zeros (its `text_input_ids.new_zeros` fallback)."""
    if hidden.shape[1] > 0:
        return hidden, mask
    return (hidden.new_zeros(hidden.shape[0], 1, hidden.shape[2]),
            mask.new_zeros(mask.shape[0], 1))


def conditioned(conditioner: torch.nn.Module, qwen: dict[str, torch.Tensor],
                t5: dict[str, torch.Tensor]) -> torch.Tensor:
    """The conditioner's output (B, max(T5 tokens, 512), D) for Qwen3's outputs and the T5
    token embeddings ("hidden" and "mask" each), as AnimaTextConditioningStep computes it:
    the inputs moved to the conditioner's device, Qwen3's states in its dtype."""
    param = next(conditioner.parameters())
    hidden, mask = _at_least_one(qwen["hidden"], qwen["mask"])
    rows = t5["hidden"].to(param.device)
    handle = conditioner.embed.register_forward_hook(lambda module, args, out: rows)
    try:
        return conditioner(
            source_hidden_states=hidden.to(param.device, param.dtype),
            target_input_ids=torch.zeros(rows.shape[:2], dtype=torch.long, device=param.device),
            target_attention_mask=t5["mask"].to(param.device),
            source_attention_mask=mask.to(param.device))
    finally:
        handle.remove()
