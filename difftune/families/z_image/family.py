"""Z-Image (Turbo and Base): a single-stream flow DiT conditioned on Qwen3 hidden states.

The transformer takes lists: one (C, 1, H, W) latent and one variable-length caption embedding
(only the caption's own tokens) per sample, a time running from 0 (noise) to 1 (image), and
predicts the negative velocity (ZImagePipeline negates it before the scheduler step). Text
embeddings travel padded with a mask (`families.base.pad_cat`) and are cut back to each
caption's tokens here, as ZImagePipeline._encode_prompt returns them.
"""

from __future__ import annotations

from typing import Any

import torch

from difftune.families.base import Conditioning, Components, TextEmbeds
from difftune.families.common.diffusers_layout import DiffusersLayoutFamily
from difftune.families.common.family import Loaders
from difftune.families.z_image.files import is_turbo
from difftune.families.z_image.spec import SPEC

_LAYER = r"(?:noise_refiner|context_refiner|layers)\.\d+\."
_ATTENTION = [_LAYER + r"attention\.(?:to_q|to_k|to_v|to_out\.0)"]
_MLP = [_LAYER + r"feed_forward\.(?:w1|w2|w3)"]
_MODULATION = [r"(?:noise_refiner|layers)\.\d+\.adaLN_modulation\.0"]
PRESETS: dict[str, list[str]] = {
    "attention": _ATTENTION,
    "attention_mlp": _ATTENTION + _MLP,
    "all_linear": _ATTENTION + _MLP + _MODULATION,
}


def caption_list(embeds: TextEmbeds) -> list[torch.Tensor]:
    """Each sample's caption embedding, only its own (masked) tokens, as the pipeline gives
    them to the transformer."""
    hidden, mask = embeds.tensors["prompt_embeds"], embeds.tensors["prompt_embeds_mask"]
    return [h[m.bool()] for h, m in zip(hidden, mask)]


class ZImageFamily(DiffusersLayoutFamily):
    """The Z-Image family."""

    spec = SPEC
    presets = PRESETS
    loaders = Loaders("build_tiny_z_image", "load_z_image_files", "load_z_image_text_encoders")

    def combine_text(self, c: Components, outputs: dict[str, dict[str, torch.Tensor]]) -> TextEmbeds:
        """Qwen3's penultimate hidden states and their mask (ZImagePipeline._encode_prompt)."""
        qwen = outputs["qwen3"]
        return TextEmbeds({"prompt_embeds": qwen["hidden"], "prompt_embeds_mask": qwen["mask"]})

    def predict(self, c: Components, noisy: torch.Tensor, embeds: TextEmbeds, t: torch.Tensor,
                cond: Conditioning) -> torch.Tensor:
        """Velocity (noise - x0) for noisy latents at t in [0, 1] (1 = pure noise).

        The transformer's time runs the other way (the pipeline passes (1000 - sigma*1000)/1000)
        and it predicts x0 - noise, so t is flipped and the output negated, as the pipeline does.
        """
        dtype = noisy.dtype
        out = c.denoiser(list(noisy.unsqueeze(2).unbind(0)), (1.0 - t).to(dtype),
                         [e.to(dtype) for e in caption_list(embeds)], return_dict=False)[0]
        return -torch.stack(out).squeeze(2)

    def distilled(self, c: Components) -> bool:
        """Z-Image-Turbo: its scheduler's shift is Turbo's (3), Base's is 6 (the weights share
        the architecture and cannot tell)."""
        return is_turbo(c.scheduler.config)

    def pipeline_inputs(self, embeds: TextEmbeds, negative: TextEmbeds | None,
                        guidance: float, cfg: float) -> dict[str, Any]:
        """ZImagePipeline arguments: per-sample caption embeddings, CFG.

        The pipeline's `guidance_scale` g computes pos + g * (pos - neg), standard CFG at
        scale g + 1, so a CFG scale `cfg` is passed as cfg - 1 (0: no CFG).
        """
        kwargs: dict[str, Any] = {"prompt_embeds": caption_list(embeds), "guidance_scale": 0.0}
        if negative is not None and cfg > 1.0:
            kwargs.update(negative_prompt_embeds=caption_list(negative), guidance_scale=cfg - 1.0)
        return kwargs
