"""FLUX.2 (klein and dev): a flow-matching MMDiT over 2x2-patchified, batch-norm-normalized
latents, conditioned on three inner hidden states of a decoder LLM stacked per token.

Latents are AutoencoderKLFlux2 latents patchified 2x2 and normalized by the autoencoder's
batch-norm running statistics (what the pipelines' `_encode_vae_image` does), then flattened to
tokens with (t, h, w, l) position ids; text tokens get (0, 0, 0, index) ids. klein runs real CFG
(two passes); dev takes the guidance scale through its guidance embedding.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from difftune.families.base import Components, Conditioning, ModelSpec, TextEmbeds
from difftune.families.common import bn_latents
from difftune.families.common.bn_latents import patchify, unpatchify
from difftune.families.common.family import FamilyBase, Loaders
from difftune.families.flux2 import reference
from difftune.families.flux2.spec import SPEC

_DOUBLE = r"transformer_blocks\.\d+\."
_SINGLE = r"single_transformer_blocks\.\d+\."
_ATTENTION = [_DOUBLE + r"attn\.(?:to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|"
                        r"to_add_out)",
              _SINGLE + r"attn\.(?:to_qkv_mlp_proj|to_out)"]
_MLP = [_DOUBLE + r"(?:ff|ff_context)\.(?:linear_in|linear_out)"]
_MODULATION = [r"double_stream_modulation_(?:img|txt)\.linear", r"single_stream_modulation\.linear"]
PRESETS: dict[str, list[str]] = {
    "attention": _ATTENTION,
    "attention_mlp": _ATTENTION + _MLP,
    "all_linear": _ATTENTION + _MLP + _MODULATION,
}


def latent_ids(b: int, h: int, w: int, device: torch.device) -> torch.Tensor:
    """(B, h*w, 4) position ids (0, row, col, 0) of latent tokens, row-major."""
    ids = torch.cartesian_prod(torch.arange(1), torch.arange(h), torch.arange(w), torch.arange(1))
    return ids.unsqueeze(0).expand(b, -1, -1).to(device)


def text_ids(b: int, length: int, device: torch.device) -> torch.Tensor:
    """(B, L, 4) position ids (0, 0, 0, index) of text tokens."""
    ids = torch.cartesian_prod(torch.arange(1), torch.arange(1), torch.arange(1),
                               torch.arange(length))
    return ids.unsqueeze(0).expand(b, -1, -1).to(device)


class Flux2Family(FamilyBase):
    """The FLUX.2 family (its variant's spec on the object, see `FamilyBase.__init__`)."""

    spec = SPEC
    presets = PRESETS
    loaders = Loaders("build_tiny_flux2", "load_flux2_files", "load_flux2_text_encoders")
    control_rule = reference.RULE

    def control_size(self, image_size: tuple[int, int], target_bucket: tuple[int, int],
                     resolution: int) -> tuple[int, int]:
        """A reference image's size (`reference.control_size`): its own, capped at the dataset's
        resolution squared in area and floored to multiples of 16, whatever the target's bucket
        (the pipelines size references on their own; exact at resolution 1024)."""
        return reference.control_size(image_size, resolution * resolution)

    def control_pixels(self, path: Path, size: tuple[int, int], resolution: int
                       ) -> torch.Tensor:
        """A reference scaled to the area cap and center-cropped to `size`, as the pipelines
        prepare theirs (`reference.load_pixels`)."""
        return reference.load_pixels(path, size, resolution)

    def control_key(self, resolution: int) -> str:
        """The rule and the resolution: the crop depends on the area cap, not only on the
        encoded size."""
        return f"{self.control_rule}/{resolution}"

    def combine_text(self, c: Components, outputs: dict[str, dict[str, torch.Tensor]]
                     ) -> TextEmbeds:
        """The stacked hidden states of the variant's encoder, every padded position kept (the
        pipelines' encode_prompt; the transformer gets no text mask)."""
        (out,) = outputs.values()
        return TextEmbeds({"prompt_embeds": out["hidden"]})

    def encode_images(self, c: Components, pixels: torch.Tensor) -> torch.Tensor:
        """Pixels in [-1, 1] -> latents normalized by the VAE's batch-norm running statistics
        (Flux2KleinPipeline._encode_vae_image, with the distribution's mode), kept in the
        autoencoder's (C, H/8, W/8) layout (`bn_latents.encode`)."""
        return bn_latents.encode(c.vae, pixels)

    def predict(self, c: Components, noisy: torch.Tensor, embeds: TextEmbeds, t: torch.Tensor,
                cond: Conditioning) -> torch.Tensor:
        """Velocity (noise - x0) for noisy latents at t in [0, 1] (1 = pure noise), as the
        pipelines call the transformer (timestep / 1000 = sigma; dev's guidance as float32)."""
        model = c.denoiser
        dtype = noisy.dtype
        patches = patchify(noisy)
        b, ch, h, w = patches.shape
        prompt = embeds.tensors["prompt_embeds"].to(dtype)
        guidance = None
        if model.config.guidance_embeds:
            guidance = torch.full((b,), cond.guidance, device=noisy.device, dtype=torch.float32)
        # references' tokens follow the target's (reference.py); the loss reads the target's
        hidden, ids = reference.with_references(
            patches.reshape(b, ch, h * w).permute(0, 2, 1), latent_ids(b, h, w, noisy.device),
            tuple(patchify(r) for r in cond.controls))
        out = model(hidden_states=hidden, encoder_hidden_states=prompt, timestep=t.to(dtype),
                    guidance=guidance, img_ids=ids,
                    txt_ids=text_ids(b, prompt.shape[1], noisy.device), return_dict=False)[0]
        return unpatchify(out[:, : h * w].permute(0, 2, 1).reshape(b, ch, h, w))

    def pipeline_inputs(self, embeds: TextEmbeds, negative: TextEmbeds | None,
                        guidance: float, cfg: float) -> dict[str, Any]:
        """Pipeline arguments: the precomputed embeddings; klein's real CFG at `cfg` with the
        negative embeddings (Flux2KleinPipeline runs CFG when guidance_scale > 1), dev's
        distilled guidance `guidance` (Flux2Pipeline's guidance_scale feeds its embedding)."""
        kwargs: dict[str, Any] = {"prompt_embeds": embeds.tensors["prompt_embeds"]}
        if self.spec.variant == "dev":
            return kwargs | {"guidance_scale": guidance}
        kwargs["guidance_scale"] = 1.0
        if negative is not None and cfg > 1.0:
            kwargs.update(negative_prompt_embeds=negative.tensors["prompt_embeds"],
                          guidance_scale=cfg)
        return kwargs

    def pipeline_images(self, images: list[Any], width: int, height: int) -> dict[str, Any]:
        """The pipelines' `image` list: a sample prompt's references sized by the training
        rule at the output's area (`reference.pipeline_images`)."""
        return reference.pipeline_images(images, width, height)

    def model_spec(self, c: Components) -> ModelSpec:
        """FLUX.2 klein or dev, as model sites name them."""
        from difftune.families.flux2 import keys

        return ModelSpec(keys.ARCHITECTURE[self.spec.variant or "klein"], keys.IMPLEMENTATION,
                         keys.BASE_VERSION[self.spec.variant or "klein"], keys.NETWORK_MODULE)

    def lora_from_format(self, c: Components, tensors: dict[str, torch.Tensor]
                         ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """A LoRA file in diffusers names and per-module alphas where the file has them: see
        `flux2.keys.diffusers_names` for the layouts read."""
        from difftune.families.flux2.keys import diffusers_names

        return diffusers_names(tensors, self.denoiser_prefix)

    def to_kohya(self, c: Components, state: dict[str, torch.Tensor], rank: int, alpha: float
                 ) -> dict[str, torch.Tensor]:
        """diffusers-named LoRA -> kohya / ComfyUI keys in BFL's original layout."""
        from difftune.families.flux2.keys import diffusers_to_kohya

        return diffusers_to_kohya(state, alpha=alpha, rank=rank, prefix=self.denoiser_prefix)

    def to_original(self, c: Components, state: dict[str, torch.Tensor], rank: int,
                    alpha: float) -> dict[str, torch.Tensor]:
        """diffusers-named LoRA -> `diffusion_model.<BFL module>` keys, scale folded: the
        default layout, which ComfyUI and diffusers both read completely."""
        from difftune.families.flux2.keys import to_original

        return to_original(state, rank=rank, alpha=alpha, prefix=self.denoiser_prefix)
