"""ERNIE-Image (and ERNIE-Image-Turbo): an 8B single-stream DiT over FLUX.2's 2x2-patchified,
batch-norm-normalized latents, conditioned on Ministral 3's penultimate hidden states.

The transformer takes the patchified latents (B, 4C, H/16, W/16), a timestep sigma * 1000, the
captions' embeddings padded to the longest and their lengths (`text_lens`: it masks the rest and
places image tokens after each caption's length in its RoPE), and predicts the velocity
(noise - x0) ErnieImagePipeline steps with. Latents stay in the autoencoder's layout between
steps (as FLUX.2's do, `common/bn_vae.py`) and are patchified here.
"""

from __future__ import annotations

from typing import Any

import torch

from difftune.families.base import Components, Conditioning, TextEmbeds
from difftune.families.common.bn_vae import normalized_latents, patchify, unpatchify
from difftune.families.common.diffusers_layout import DiffusersLayoutFamily
from difftune.families.common.family import Loaders
from difftune.families.ernie_image.files import BN_EPS
from difftune.families.ernie_image.spec import SPEC

_LAYER = r"layers\.\d+\."
_ATTENTION = [_LAYER + r"self_attention\.(?:to_q|to_k|to_v|to_out\.0)"]
_MLP = [_LAYER + r"mlp\.(?:gate_proj|up_proj|linear_fc2)"]
# One modulation shared by every block (its LoRA is one module), and the final norm's.
_MODULATION = [r"adaLN_modulation\.1", r"final_norm\.linear"]
PRESETS: dict[str, list[str]] = {
    "attention": _ATTENTION,
    "attention_mlp": _ATTENTION + _MLP,
    "all_linear": _ATTENTION + _MLP + _MODULATION,
}


def caption_lengths(embeds: TextEmbeds) -> torch.Tensor:
    """Each caption's token count (its mask's ones: captions are padded at the end)."""
    return embeds.tensors["prompt_embeds_mask"].sum(dim=1).long()


def caption_list(embeds: TextEmbeds) -> list[torch.Tensor]:
    """Each caption's own (T, D) hidden states, as encode_prompt returns them."""
    hidden = embeds.tensors["prompt_embeds"]
    return [h[: int(n)] for h, n in zip(hidden, caption_lengths(embeds))]


class ErnieImageFamily(DiffusersLayoutFamily):
    """The ERNIE-Image family."""

    spec = SPEC
    presets = PRESETS
    loaders = Loaders("build_tiny_ernie_image", "load_ernie_image_files",
                      "load_ernie_image_text_encoders")

    def combine_text(self, c: Components, outputs: dict[str, dict[str, torch.Tensor]]
                     ) -> TextEmbeds:
        """Ministral 3's penultimate hidden states of the captions' own tokens, and their mask
        (ErnieImagePipeline.encode_prompt)."""
        out = outputs["mistral3"]
        return TextEmbeds({"prompt_embeds": out["hidden"], "prompt_embeds_mask": out["mask"]})

    def encode_images(self, c: Components, pixels: torch.Tensor) -> torch.Tensor:
        """Pixels in [-1, 1] -> FLUX.2 autoencoder latents normalized by its batch-norm
        statistics with the epsilon ErnieImagePipeline un-normalizes with (`BN_EPS`)."""
        return normalized_latents(c.vae, pixels, BN_EPS)

    def predict(self, c: Components, noisy: torch.Tensor, embeds: TextEmbeds, t: torch.Tensor,
                cond: Conditioning) -> torch.Tensor:
        """Velocity (noise - x0) for noisy latents at t in [0, 1] (1 = pure noise), as the
        pipeline calls the transformer (timestep = sigma * 1000)."""
        dtype = noisy.dtype
        out = c.denoiser(hidden_states=patchify(noisy), timestep=(t * 1000.0).to(dtype),
                         text_bth=embeds.tensors["prompt_embeds"].to(dtype),
                         text_lens=caption_lengths(embeds).to(noisy.device),
                         return_dict=False)[0]
        return unpatchify(out)

    def pipeline_inputs(self, embeds: TextEmbeds, negative: TextEmbeds | None,
                        guidance: float, cfg: float) -> dict[str, Any]:
        """ErnieImagePipeline arguments: per-caption embeddings, real CFG at `cfg` with the
        negative embeddings (the pipeline runs CFG when guidance_scale > 1), no prompt
        enhancer (samples show what the LoRA does with the prompt as written)."""
        kwargs: dict[str, Any] = {"prompt_embeds": caption_list(embeds), "guidance_scale": 1.0,
                                  "use_pe": False}
        if negative is not None and cfg > 1.0:
            kwargs.update(negative_prompt_embeds=caption_list(negative), guidance_scale=cfg)
        return kwargs
