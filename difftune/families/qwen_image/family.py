"""Qwen-Image (and Qwen-Image-2512): a dual-stream MMDiT conditioned on Qwen2.5-VL hidden states.

Latents come from AutoencoderKLQwenImage (a video-style VAE: a frame axis, and per-channel
`latents_mean`/`latents_std` normalization instead of one shift and scale) and are packed into
2x2 patches as FLUX.1's are (`families.common.latents`); the transformer reads them with
`img_shapes` (frames, rows, columns of patches) for its RoPE, the time as sigma in [0, 1], the
text embeddings with their mask, and predicts the velocity (noise - x0) the scheduler steps
with. Text embeddings are variable-length (the template's 34 tokens dropped, only each
caption's own tokens kept) and travel padded with a mask (`families.base.pad_cat`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from difftune.families.base import Components, Conditioning, TextEmbeds
from difftune.families.common import frame_vae
from difftune.families.common.diffusers_layout import DiffusersLayoutFamily
from difftune.families.common.family import Loaders
from difftune.families.common.latents import pack, unpack
from difftune.families.qwen_image.spec import SPEC

if TYPE_CHECKING:
    pass

_BLOCK = r"transformer_blocks\.\d+\."
_ATTENTION = [_BLOCK + r"attn\.(?:to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj"
                       r"|to_add_out)"]
_MLP = [_BLOCK + r"(?:img_mlp|txt_mlp)\.net\.(?:0\.proj|2)"]
_MODULATION = [_BLOCK + r"(?:img_mod|txt_mod)\.1"]
PRESETS: dict[str, list[str]] = {
    "attention": _ATTENTION,
    "attention_mlp": _ATTENTION + _MLP,
    "all_linear": _ATTENTION + _MLP + _MODULATION,
}


def _prompt(embeds: TextEmbeds, prefix: str) -> dict[str, torch.Tensor]:
    """QwenImagePipeline's `prompt_embeds` / `prompt_embeds_mask` arguments (with `prefix`
    "negative_" for the negative prompt's)."""
    return {f"{prefix}prompt_embeds": embeds.tensors["prompt_embeds"],
            f"{prefix}prompt_embeds_mask": embeds.tensors["prompt_embeds_mask"]}


class QwenImageFamily(DiffusersLayoutFamily):
    """The Qwen-Image family."""

    spec = SPEC
    presets = PRESETS
    loaders = Loaders("build_tiny_qwen_image", "load_qwen_image_files",
                      "load_qwen_image_text_encoders")

    def combine_text(self, c: Components, outputs: dict[str, dict[str, torch.Tensor]]
                     ) -> TextEmbeds:
        """Qwen2.5-VL's last hidden states, template prefix dropped, and their mask
        (QwenImagePipeline._get_qwen_prompt_embeds)."""
        qwen = outputs["qwen2_5_vl"]
        return TextEmbeds({"prompt_embeds": qwen["hidden"], "prompt_embeds_mask": qwen["mask"]})

    @torch.no_grad()
    def encode_images(self, c: Components, pixels: torch.Tensor) -> torch.Tensor:
        """Pixels in [-1, 1] -> normalized (B, 16, h, w) latents (one frame, axis dropped)."""
        return frame_vae.encode(c.vae, pixels)

    def predict(self, c: Components, noisy: torch.Tensor, embeds: TextEmbeds, t: torch.Tensor,
                cond: Conditioning) -> torch.Tensor:
        """Velocity (noise - x0) for noisy latents at t in [0, 1] (1 = pure noise), as
        QwenImagePipeline calls the transformer (timestep = sigma; no guidance input unless
        the transformer is guidance-distilled)."""
        b, _, h, w = noisy.shape
        dtype = noisy.dtype
        mask = embeds.tensors["prompt_embeds_mask"]
        guidance = None
        if c.denoiser.config.guidance_embeds:
            guidance = torch.full((b,), float(cond.guidance), device=noisy.device)
        out = c.denoiser(
            hidden_states=pack(noisy),
            encoder_hidden_states=embeds.tensors["prompt_embeds"].to(dtype),
            encoder_hidden_states_mask=None if bool(mask.all()) else mask,
            timestep=t.to(dtype),
            img_shapes=[[(1, h // 2, w // 2)]] * b,
            guidance=guidance,
            return_dict=False,
        )[0]
        return unpack(out, h, w)

    def pipeline_inputs(self, embeds: TextEmbeds, negative: TextEmbeds | None,
                        guidance: float, cfg: float) -> dict[str, Any]:
        """QwenImagePipeline arguments: precomputed (negative) embeddings with their masks and
        true CFG (`true_cfg_scale`, on when > 1 with a negative prompt; the pipeline rescales
        the combined prediction to the conditional one's norm)."""
        kwargs: dict[str, Any] = {**_prompt(embeds, ""), "true_cfg_scale": cfg}
        if negative is not None and cfg > 1.0:
            kwargs.update(_prompt(negative, "negative_"))
        return kwargs
