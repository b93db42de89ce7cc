"""FLUX.1 (dev, schnell and Kontext): a flow-matching MMDiT with CLIP-L (pooled) and T5-XXL
(sequence).

Latents are 16-channel VAE latents packed into 2x2 patches (64 features a token); positions go
to the transformer as (0, row, col) ids; guidance-distilled checkpoints (dev) take the guidance
value as an input. The Kontext variant appends its input image's packed latents after the
target's tokens (`kontext.py`) and is trained on edit pairs.
"""

from __future__ import annotations

from typing import Any

import torch

from difftune.families.base import Components, Conditioning, ModelSpec, TextEmbeds
from difftune.families.common.bfl import ATTENTION_PATTERNS, MLP_PATTERNS
from difftune.families.common.family import BlockTableFamily, Loaders, prompt_kwargs
from difftune.families.common.latents import image_ids, pack, unpack
from difftune.families.flux import kontext
from difftune.families.flux.spec import SPEC

# LoRA presets: the BFL layout's attention and MLP patterns, plus FLUX.1's modulation layers.
_MODULATION = [
    r"transformer_blocks\.\d+\.(?:norm1|norm1_context)\.linear",
    r"single_transformer_blocks\.\d+\.norm\.linear",
]
PRESETS: dict[str, list[str]] = {
    "attention": ATTENTION_PATTERNS,
    "attention_mlp": ATTENTION_PATTERNS + MLP_PATTERNS,
    "all_linear": ATTENTION_PATTERNS + MLP_PATTERNS + _MODULATION,
}


class FluxFamily(BlockTableFamily):
    """The FLUX.1 family."""

    spec = SPEC
    presets = PRESETS
    loaders = Loaders("build_tiny_flux", "load_flux_files", "load_flux_text_encoders")
    control_rule = kontext.RULE

    def control_size(self, image_size: tuple[int, int], target_bucket: tuple[int, int],
                     resolution: int) -> tuple[int, int]:
        """Kontext's input-image size (`kontext.control_size`): the preferred resolution
        closest in aspect ratio scaled to the dataset's resolution, whatever the target's
        bucket (FluxKontextPipeline sizes its input image on its own, not to the output)."""
        return kontext.control_size(image_size, resolution)

    def combine_text(self, c: Components, outputs: dict[str, dict[str, torch.Tensor]]) -> TextEmbeds:
        """CLIP-L pooled output and T5 last hidden states, as FluxPipeline.encode_prompt."""
        return TextEmbeds({"pooled_prompt_embeds": outputs["clip_l"]["pooled"],
                           "prompt_embeds": outputs["t5"]["hidden"]})

    def predict(self, c: Components, noisy: torch.Tensor, embeds: TextEmbeds, t: torch.Tensor,
                cond: Conditioning) -> torch.Tensor:
        """Velocity prediction for noisy latents at t in [0, 1] (1 = pure noise)."""
        model = c.denoiser
        b, _, h, w = noisy.shape
        dtype = noisy.dtype
        prompt = embeds.tensors["prompt_embeds"]
        kwargs: dict[str, Any] = {}
        if model.config.guidance_embeds:
            kwargs["guidance"] = torch.full((b,), cond.guidance, device=noisy.device, dtype=dtype)
        tokens = pack(noisy)
        # Kontext: control tokens follow the target's; the loss reads the target's only.
        hidden, ids = kontext.with_controls(tokens, image_ids(h, w, noisy.device, dtype),
                                            cond.controls)
        out = model(
            hidden_states=hidden,
            encoder_hidden_states=prompt,
            pooled_projections=embeds.tensors["pooled_prompt_embeds"],
            timestep=t.to(dtype),
            img_ids=ids,
            txt_ids=torch.zeros(prompt.shape[1], 3, device=noisy.device, dtype=dtype),
            return_dict=False,
            **kwargs,
        )[0]
        return unpack(out[:, : tokens.shape[1]].contiguous(), h, w)

    def pipeline_inputs(self, embeds: TextEmbeds, negative: TextEmbeds | None,
                        guidance: float, cfg: float) -> dict[str, Any]:
        """FluxPipeline arguments: precomputed embeddings, distilled guidance and true CFG."""
        kwargs: dict[str, Any] = {**prompt_kwargs(embeds), "guidance_scale": guidance}
        if negative is not None and cfg > 1.0:
            kwargs.update(prompt_kwargs(negative, "negative_"))
            kwargs["true_cfg_scale"] = cfg
        return kwargs

    def pipeline_images(self, images: list[Any], width: int, height: int) -> dict[str, Any]:
        """FluxKontextPipeline's `image` (resized by Kontext's rule) and `max_area`; nothing for
        the base variant, whose FluxPipeline takes no input image."""
        if not self.spec.control_images:
            return {}
        return kontext.pipeline_images(images, width, height)

    def distilled(self, c: Components) -> bool:
        """schnell: the transformer without a guidance embedding (dev has one)."""
        return not c.denoiser.config.guidance_embeds

    def model_spec(self, c: Components) -> ModelSpec:
        """FLUX.1 dev (guidance-distilled) or schnell, as kohya and model sites name them."""
        from difftune.families.flux import keys

        return ModelSpec(keys.ARCHITECTURE[bool(c.denoiser.config.guidance_embeds)],
                         keys.IMPLEMENTATION, keys.BASE_VERSION, keys.NETWORK_MODULE)
