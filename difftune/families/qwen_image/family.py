"""Qwen-Image (and Qwen-Image-2512): a dual-stream MMDiT conditioned on Qwen2.5-VL hidden states.

Latents come from AutoencoderKLQwenImage (a video-style VAE: a frame axis, and per-channel
`latents_mean`/`latents_std` normalization instead of one shift and scale) and are packed into
2x2 patches as FLUX.1's are (`families.common.latents`); the transformer reads them with
`img_shapes` (frames, rows, columns of patches) for its RoPE, the time as sigma in [0, 1], the
text embeddings with their mask, and predicts the velocity (noise - x0) the scheduler steps
with. Text embeddings are variable-length (the template's 34 tokens dropped, only each
caption's own tokens kept) and travel padded with a mask (`families.base.pad_cat`). The edit
variants (`edit.py`) read the instruction with the input image(s) through Qwen2.5-VL's vision
tower and append the images' packed latents after the target's tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from difftune.families.base import Components, Conditioning, TextEmbeds
from difftune.families.common import frame_vae
from difftune.families.common.diffusers_layout import DiffusersLayoutFamily
from difftune.families.common.family import Loaders
from difftune.families.common.latents import pack, unpack
from difftune.families.qwen_image import edit
from difftune.families.qwen_image.spec import SPEC

if TYPE_CHECKING:
    from diffusers import DiffusionPipeline

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


def true_cfg_inputs(embeds: TextEmbeds, negative: TextEmbeds | None, cfg: float
                    ) -> dict[str, Any]:
    """Precomputed (negative) embeddings with their masks and true CFG (`true_cfg_scale`, on
    when > 1 with a negative prompt), the arguments the Qwen-Image pipelines (2.1's too)
    take."""
    kwargs: dict[str, Any] = {**_prompt(embeds, ""), "true_cfg_scale": cfg}
    if negative is not None and cfg > 1.0:
        kwargs.update(_prompt(negative, "negative_"))
    return kwargs


class QwenImageFamily(DiffusersLayoutFamily):
    """The Qwen-Image family."""

    spec = SPEC
    presets = PRESETS
    loaders = Loaders("build_tiny_qwen_image", "load_qwen_image_files",
                      "load_qwen_image_text_encoders")
    control_rule = edit.RULE

    @property
    def _plus(self) -> bool:
        """Whether this variant takes several input images (the Plus pipeline's sizes)."""
        return self.spec.control_images > 1

    @property
    def text_image_rule(self) -> str:  # type: ignore[override]
        """The edit pipelines' text-image size rule (edit or Plus)."""
        return edit.text_rule(self._plus)

    def control_size(self, image_size: tuple[int, int], target_bucket: tuple[int, int],
                     resolution: int) -> tuple[int, int]:
        """A reference image's VAE size: the edit pipelines' rule at the dataset's resolution
        (`edit.control_size`), whatever the target's bucket."""
        return edit.control_size(image_size, resolution)

    def text_image_size(self, image_size: tuple[int, int], control_size: tuple[int, int]
                        ) -> tuple[int, int]:
        """The size the pipeline gives its text encoder an input image at (edit: 1024 x 1024
        in area; Plus: 384 x 384), from the image's own size."""
        return edit.dimensions(edit.text_area(self._plus), image_size)

    def pipeline_text_images(self, images: list[Any]) -> list[Any]:
        """The sample's input images as the edit pipeline's text encoder reads them."""
        if not self.spec.control_images:
            return []
        return edit.text_images(images, self._plus)

    def pipeline_images(self, images: list[Any], width: int, height: int) -> dict[str, Any]:
        """The edit pipelines' `image` (one, or a list for Plus); they size it themselves."""
        if not self.spec.control_images:
            return {}
        if not images:
            raise ValueError(f"{self.spec.pipeline_class} edits an input image and makes no "
                             "image from text alone; name one with --ci <image>")
        return {"image": list(images) if self._plus else images[0]}

    def pipeline(self, c: Components) -> "DiffusionPipeline":
        """The variant's pipeline; the edit pipelines take the processor (held as the text
        encoder's tokenizer) and its tokenizer."""
        if not self.spec.control_images:
            return super().pipeline(c)
        import diffusers

        processor = c.tokenizers["qwen2_5_vl"]
        pipe = getattr(diffusers, self.spec.pipeline_class)(
            transformer=c.denoiser, vae=c.vae, scheduler=c.scheduler,
            text_encoder=c.text_encoders["qwen2_5_vl"], tokenizer=processor.tokenizer,
            processor=processor)
        pipe.set_progress_bar_config(disable=True)
        return pipe

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
        tokens = pack(noisy)
        # Edit variants: reference tokens follow the target's; the loss reads the target's only.
        hidden, shapes = edit.with_controls(tokens, h, w, cond.controls)
        out = c.denoiser(
            hidden_states=hidden,
            encoder_hidden_states=embeds.tensors["prompt_embeds"].to(dtype),
            encoder_hidden_states_mask=None if bool(mask.all()) else mask,
            timestep=t.to(dtype),
            img_shapes=[shapes] * b,
            guidance=guidance,
            return_dict=False,
        )[0]
        return unpack(out[:, : tokens.shape[1]].contiguous() if cond.controls else out, h, w)

    def pipeline_inputs(self, embeds: TextEmbeds, negative: TextEmbeds | None,
                        guidance: float, cfg: float) -> dict[str, Any]:
        """QwenImagePipeline arguments: precomputed (negative) embeddings with their masks and
        true CFG (`true_cfg_scale`, on when > 1 with a negative prompt; the pipeline rescales
        the combined prediction to the conditional one's norm)."""
        return true_cfg_inputs(embeds, negative, cfg)
