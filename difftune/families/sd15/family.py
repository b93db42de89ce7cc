"""SD 1.5 (stable-diffusion-v1-5 and its fine-tunes): a discrete-time DDPM UNet with CLIP-L.

The UNet reads CLIP-L's last hidden state (after its final layer norm; `model.clip_skip` reads
an earlier one, normed alike) as its cross-attention context and nothing else: no pooled
output, no size conditioning. It is trained with epsilon or v-prediction (the scheduler
config's `prediction_type`) on the scaled-linear schedule (`difftune.train.objectives.ddpm`).
"""

from __future__ import annotations

from typing import Any

import torch

from difftune.families.base import Conditioning, Components, TextEmbeds
from difftune.families.common.components import UNET_PREFIX
from difftune.families.common.diffusers_layout import diffusers_names
from difftune.families.common.family import Loaders
from difftune.families.common.unet import DDPMUNetFamily
from difftune.families.sd15.spec import SPEC

_KOHYA = ("lora_unet_", "lora_te_")


class SD15Family(DDPMUNetFamily):
    """The SD 1.5 family."""

    spec = SPEC
    loaders = Loaders("build_tiny_sd15", "source_parts", "text_parts")
    # The released pipeline's NSFW filter is not loaded (training samples are the user's own
    # images' subject), so the pipeline is built without it and without its warning.
    pipeline_extras = {"safety_checker": None, "feature_extractor": None,
                       "requires_safety_checker": False}

    def combine_text(self, c: Components, outputs: dict[str, dict[str, torch.Tensor]]
                     ) -> TextEmbeds:
        """As StableDiffusionPipeline.encode_prompt: CLIP-L's hidden state as prompt_embeds."""
        return TextEmbeds({"prompt_embeds": outputs["clip_l"]["hidden"]})

    def predict(self, c: Components, noisy: torch.Tensor, embeds: TextEmbeds, t: torch.Tensor,
                cond: Conditioning) -> torch.Tensor:
        """UNet output (epsilon or v, as trained) for noisy latents at integer timesteps t."""
        return c.denoiser(noisy, t, encoder_hidden_states=embeds.tensors["prompt_embeds"],
                          return_dict=False)[0]

    def pipeline_inputs(self, embeds: TextEmbeds, negative: TextEmbeds | None,
                        guidance: float, cfg: float) -> dict[str, Any]:
        """StableDiffusionPipeline arguments: precomputed embeddings and the CFG scale.

        `guidance` (distilled guidance) does not apply. With CFG on, the negative embeddings
        are required: the core always encodes the negative prompt ("" by default), as the
        pipeline itself would.
        """
        kwargs: dict[str, Any] = {"prompt_embeds": embeds.tensors["prompt_embeds"],
                                  "guidance_scale": cfg}
        if cfg > 1.0:
            if negative is None:
                raise ValueError("SD 1.5 sampling with CFG > 1 needs negative embeddings")
            kwargs["negative_prompt_embeds"] = negative.tensors["prompt_embeds"]
        return kwargs

    def lora_from_format(self, c: Components, tensors: dict[str, torch.Tensor]
                         ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """A LoRA file's tensors in diffusers names, and per-module alphas: kohya files
        (`lora_unet_`/`lora_te_`, as kohya, OneTrainer and ai-toolkit write SD 1.5), else
        diffusers names under any of the prefixes and factor names other tools use."""
        modules = [n for n, _ in c.denoiser.named_modules() if n]
        if any(k.startswith(_KOHYA) for k in tensors):
            from difftune.families.common.text import model_clip_roots
            from difftune.families.sd15.keys import kohya_to_diffusers

            original = {k.removeprefix(UNET_PREFIX).removesuffix(".weight"):
                        piece.sources[0].removesuffix(".weight")
                        for k, piece in self.single_file_layout(c).items()
                        if k.endswith(".weight")}
            return kohya_to_diffusers(tensors, modules, model_clip_roots(self, c), original)
        return diffusers_names(tensors, modules, self.denoiser_prefix)

    def to_kohya(self, c: Components, state: dict[str, torch.Tensor], rank: int, alpha: float
                 ) -> dict[str, torch.Tensor]:
        """diffusers-named LoRA ("unet.<module>...") -> kohya keys (lora_unet_, lora_te_)."""
        from difftune.families.sd15.keys import diffusers_to_kohya

        return diffusers_to_kohya(state, alpha, rank)
