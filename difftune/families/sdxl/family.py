"""SDXL (base 1.0 and its fine-tunes): a discrete-time DDPM UNet with two CLIP text encoders.

The UNet reads the concatenated penultimate hidden states of CLIP-L and CLIP-G as its
cross-attention context, and CLIP-G's projected pooled output plus six "time ids" (original
size, crop top-left, target size) as its added conditioning. It is trained with epsilon or
v-prediction on the scheduler's scaled-linear schedule (`difftune.train.objectives.ddpm`).
"""

from __future__ import annotations

from typing import Any

import torch

from difftune.families.base import Conditioning, Components, TextEmbeds
from difftune.families.common import text
from difftune.families.common.family import Loaders, prompt_kwargs
from difftune.families.common.unet import DDPMUNetFamily
from difftune.families.sdxl.spec import SPEC


def time_ids(cond: Conditioning, like: torch.Tensor) -> torch.Tensor:
    """(B, 6) SDXL micro-conditioning: original (h, w), crop (top, left), target (h, w)."""
    rows = [[*o, *c, *t] for o, c, t in zip(cond.original_sizes, cond.crops, cond.target_sizes)]
    return torch.tensor(rows, device=like.device, dtype=like.dtype)


class SDXLFamily(DDPMUNetFamily):
    """The SDXL family."""

    spec = SPEC
    loaders = Loaders("build_tiny_sdxl", "source_parts", "text_parts")

    def combine_text(self, c: Components, outputs: dict[str, dict[str, torch.Tensor]]) -> TextEmbeds:
        """As StableDiffusionXLPipeline.encode_prompt: both penultimate states side by side
        (CLIP-L then CLIP-G, along the feature axis) and CLIP-G's projected pooled output."""
        hidden = [outputs[spec.name]["hidden"] for spec in self.text_encoders]
        # One encoder's outputs may come from the cache (CPU) and the other's live (trained).
        prompt = torch.cat([h.to(hidden[0]) for h in hidden], dim=-1)
        return TextEmbeds({"prompt_embeds": prompt,
                           "pooled_prompt_embeds": outputs["clip_g"]["pooled"]})

    @torch.no_grad()
    def encode_images(self, c: Components, pixels: torch.Tensor) -> torch.Tensor:
        """Pixels in [-1, 1] -> latents normalized with the VAE's shift and scaling factors.

        SDXL's VAE overflows (inf/NaN) in fp16, so an fp16 VAE is cast to fp32 for the encode
        and back afterwards, as the SDXL pipeline does for decoding (`upcast_vae`); the
        round trip fp16 -> fp32 -> fp16 is exact, so the weights are unchanged. (`float()` and
        `half()` rather than `to(dtype)`, which makes diffusers log a warning on every call.)
        Latents are returned in the VAE's own dtype, as for the other families.
        """
        vae = c.vae
        half = vae.dtype == torch.float16
        if half:
            vae.float()
        try:
            dist = vae.encode(pixels.to(text.module_device(vae), vae.dtype)).latent_dist
            # The mode (mean) rather than a sample: deterministic, so latents can be cached.
            z = dist.mode()
            shift = vae.config.shift_factor or 0.0
            z = (z - shift) * vae.config.scaling_factor
        finally:
            if half:
                vae.half()
        return z.to(vae.dtype)

    def predict(self, c: Components, noisy: torch.Tensor, embeds: TextEmbeds, t: torch.Tensor,
                cond: Conditioning) -> torch.Tensor:
        """UNet output (epsilon or v, as trained) for noisy latents at integer timesteps t."""
        added = {"text_embeds": embeds.tensors["pooled_prompt_embeds"],
                 "time_ids": time_ids(cond, noisy)}
        return c.denoiser(noisy, t, encoder_hidden_states=embeds.tensors["prompt_embeds"],
                          added_cond_kwargs=added, return_dict=False)[0]

    def pipeline_inputs(self, embeds: TextEmbeds, negative: TextEmbeds | None,
                        guidance: float, cfg: float) -> dict[str, Any]:
        """StableDiffusionXLPipeline arguments: precomputed embeddings and the CFG scale.

        `guidance` (distilled guidance) does not apply to SDXL. With CFG on, the negative
        embeddings are required: the core always encodes the negative prompt ("" by default),
        so the pipeline never silently substitutes its own (zero) negative embeddings.
        """
        kwargs: dict[str, Any] = {**prompt_kwargs(embeds), "guidance_scale": cfg}
        if cfg > 1.0:
            if negative is None:
                raise ValueError("SDXL sampling with CFG > 1 needs negative embeddings")
            kwargs.update(prompt_kwargs(negative, "negative_"))
        return kwargs

    def lora_from_format(self, c: Components, tensors: dict[str, torch.Tensor]
                         ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """A LoRA file's tensors in diffusers names, and per-module alphas (kohya files)."""
        if not any(k.startswith(("lora_unet_", "lora_te")) for k in tensors):
            return dict(tensors), {}
        from difftune.families.common.text import model_clip_roots
        from difftune.families.sdxl.keys import UNetLayout, kohya_to_diffusers

        return kohya_to_diffusers(tensors, UNetLayout.from_config(c.denoiser.config),
                                  model_clip_roots(self, c))

    def to_kohya(self, c: Components, state: dict[str, torch.Tensor], rank: int, alpha: float
                 ) -> dict[str, torch.Tensor]:
        """diffusers-named LoRA ("unet.<module>...") -> kohya keys (SGM names, lora_te1/2)."""
        from difftune.families.sdxl.keys import UNetLayout, diffusers_to_kohya

        return diffusers_to_kohya(state, alpha, rank, UNetLayout.from_config(c.denoiser.config))
