"""Chroma (Chroma1-HD and its kin): a FLUX.1-shaped flow-matching transformer with T5 only.

Latents are packed into 2x2 patches with (0, row, col) position ids exactly as FLUX.1's
(`families.common.latents`). What differs: one T5-XXL encoder whose attention mask is applied
inside T5 and also reaches the transformer (text tokens plus the first padding token attend;
the rest are masked, as ChromaPipeline builds it), no pooled text vector, modulation from a
small "distilled guidance" approximator instead of per-block linears, and real CFG rather than
a distilled guidance input.
"""

from __future__ import annotations

from typing import Any

import torch

from difftune.families.base import Components, Conditioning, TextEmbeds
from difftune.families.chroma.spec import SPEC
from difftune.families.common.bfl import ATTENTION_PATTERNS, MLP_PATTERNS
from difftune.families.common.family import BlockTableFamily, Loaders
from difftune.families.common.latents import image_ids, pack, unpack

# Module-name patterns (full match against the transformer's module names) for LoRA presets.
# Chroma's blocks have no modulation linears (their norms are "pruned"), so all_linear is the
# attention and MLP projections.
PRESETS: dict[str, list[str]] = {
    "attention": ATTENTION_PATTERNS,
    "attention_mlp": ATTENTION_PATTERNS + MLP_PATTERNS,
    "all_linear": ATTENTION_PATTERNS + MLP_PATTERNS,
}


def denoiser_text_mask(tokens_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The transformer's text mask from T5's tokenizer mask: the text tokens and the first
    padding token are 1, the rest 0, in `dtype` (ChromaPipeline._get_t5_prompt_embeds)."""
    lengths = tokens_mask.sum(dim=1)
    positions = torch.arange(tokens_mask.shape[1], device=tokens_mask.device)
    return (positions[None, :] <= lengths[:, None]).to(dtype=dtype)


class ChromaFamily(BlockTableFamily):
    """The Chroma family."""

    spec = SPEC
    presets = PRESETS
    loaders = Loaders("build_tiny_chroma", "load_chroma_files", "load_chroma_text_encoders")

    def combine_text(self, c: Components, outputs: dict[str, dict[str, torch.Tensor]]) -> TextEmbeds:
        """T5's masked last hidden states and the transformer's text mask, as
        ChromaPipeline.encode_prompt returns them (`prompt_embeds`, `prompt_attention_mask`)."""
        hidden = outputs["t5"]["hidden"]
        mask = denoiser_text_mask(outputs["t5"]["mask"].to(hidden.device), hidden.dtype)
        return TextEmbeds({"prompt_embeds": hidden, "prompt_attention_mask": mask})

    def predict(self, c: Components, noisy: torch.Tensor, embeds: TextEmbeds, t: torch.Tensor,
                cond: Conditioning) -> torch.Tensor:
        """Velocity prediction for noisy latents at t in [0, 1] (1 = pure noise)."""
        b, _, h, w = noisy.shape
        dtype = noisy.dtype
        prompt = embeds.tensors["prompt_embeds"]
        text_mask = embeds.tensors["prompt_attention_mask"].to(dtype)
        tokens = pack(noisy)
        # Image tokens always attend (ChromaPipeline._prepare_attention_mask).
        mask = torch.cat([text_mask, torch.ones(b, tokens.shape[1], device=noisy.device,
                                                dtype=dtype)], dim=1)
        out = c.denoiser(
            hidden_states=tokens,
            encoder_hidden_states=prompt,
            timestep=t.to(dtype),
            img_ids=image_ids(h, w, noisy.device, dtype),
            txt_ids=torch.zeros(prompt.shape[1], 3, device=noisy.device, dtype=dtype),
            attention_mask=mask,
            return_dict=False,
        )[0]
        return unpack(out, h, w)

    def pipeline_inputs(self, embeds: TextEmbeds, negative: TextEmbeds | None,
                        guidance: float, cfg: float) -> dict[str, Any]:
        """ChromaPipeline arguments: precomputed (negative) embeddings with their masks, CFG.

        Chroma is not guidance-distilled, so `guidance` has no input; CFG is the pipeline's
        `guidance_scale` (on when > 1).
        """
        kwargs: dict[str, Any] = {**_prompt(embeds, ""), "guidance_scale": cfg}
        if negative is not None and cfg > 1.0:
            kwargs.update(_prompt(negative, "negative_"))
        return kwargs


def _prompt(embeds: TextEmbeds, prefix: str) -> dict[str, torch.Tensor]:
    """ChromaPipeline's `prompt_embeds` / `prompt_attention_mask` arguments (with `prefix`
    "negative_" for the negative prompt's)."""
    return {f"{prefix}prompt_embeds": embeds.tensors["prompt_embeds"],
            f"{prefix}prompt_attention_mask": embeds.tensors["prompt_attention_mask"]}
