"""Qwen-Image 2.1: a single-stream block-causal transformer over one joint text/image sequence,
conditioned on Qwen3-VL read before its final norm.

Latents come from AutoencoderKLQwenImage21 (RGBA in: an opaque alpha channel is added to the
training images, as the pipeline converts its inputs to RGBA; 64 channels, 16x down, per-channel
`latents_mean`/`latents_std`) and enter the transformer unpatched, one token per latent pixel in
row-major order. The transformer reads the text tokens, then one "image slot" per 2 x 2 target
tokens (`img_mask`, True at the slots), which it expands to the target's tokens; its output's
last h x w tokens are the velocity (noise - x0), with the time as sigma in [0, 1]. Text
embeddings are variable-length (the system turn's 14 tokens dropped, each caption's own tokens
kept) and travel padded with a mask, as QwenImage21Pipeline right-pads them; the transformer
runs each caption length of a batch on its own, unpadded (`predict`). The "edit" variant
(`edit.py`) puts a reference's latent tokens in the image slots Qwen3-VL's reading of it left
in the text, before the target's tokens. What diffusers 0.42.1 lacks for it:
QwenImage21Pipeline.__call__ has no `image_pad_mask` parameter, and its `encode_prompt`, given
`prompt_embeds` and `image` without that mask, raises ValueError ("Pass `image_pad_mask`
alongside `prompt_embeds`..."); so the edit variant samples through
`sampling.EmbeddedEditPipeline`, which supplies only that mask.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from difftune.families.base import Components, Conditioning, TextEmbeds
from difftune.families.common import frame_vae
from difftune.families.common.diffusers_layout import DiffusersLayoutFamily
from difftune.families.common.family import Loaders
from difftune.families.qwen_image.family import true_cfg_inputs
from difftune.families.qwen_image_21 import edit, keys
from difftune.families.qwen_image_21.spec import SPEC
from difftune.train.objectives import FlowMatching
from difftune.train.objectives.flow import DynamicShift, scheduler_shift

if TYPE_CHECKING:
    from diffusers import DiffusionPipeline

    from difftune.config import ModelConfig, TrainConfig
    from difftune.precision.policy import PrecisionPolicy

_BLOCK = r"transformer_blocks\.\d+\."
_ATTENTION = [_BLOCK + r"attn\.(?:to_q|to_k|to_v|to_out\.0)"]
_MLP = [_BLOCK + r"img_mlp\.(?:proj|gate_layer|out)"]
# The one modulation projection every block slices its scales and gates from.
_MODULATION = [r"modulation\.1"]
PRESETS: dict[str, list[str]] = {
    "attention": _ATTENTION,
    "attention_mlp": _ATTENTION + _MLP,
    "all_linear": _ATTENTION + _MLP + _MODULATION,
}
# Latent tokens one image slot of the transformer's sequence stands for (2 x 2).
SLOT = 4


def to_tokens(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) latents -> (B, h*w, C) tokens (QwenImage21Pipeline._pack_latents)."""
    b, ch, h, w = latents.shape
    return latents.reshape(b, ch, h * w).transpose(1, 2)


def from_tokens(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """(B, h*w, C) tokens -> (B, C, h, w) latents (the inverse of `to_tokens`)."""
    b, _, ch = tokens.shape
    return tokens.transpose(1, 2).reshape(b, ch, h, w)


class QwenImage21Family(DiffusersLayoutFamily):
    """The Qwen-Image 2.1 family (base and Turbo checkpoints)."""

    spec = SPEC
    presets = PRESETS
    loaders = Loaders("build_tiny_qwen_image_21", "load_qwen_image_21_files",
                      "load_qwen_image_21_text_encoders")
    control_rule = edit.RULE

    def components(self, parts: dict[str, Any], cfg: "ModelConfig",
                   policy: "PrecisionPolicy") -> Components:
        """The shared placement, with the processor the pipeline takes and the folder's
        pipeline options (Turbo's `sample_sigmas`; none for the tiny flavor) kept in extras."""
        comps = super().components(parts, cfg, policy)
        comps.extras["processor"] = parts["processor"]
        comps.extras["pipeline_options"] = dict(parts.get("pipeline_options",
                                                          {"sample_sigmas": None}))
        comps.extras["image_offset"] = edit.image_offset(parts["processor"].tokenizer)
        return comps

    def control_size(self, image_size: tuple[int, int], target_bucket: tuple[int, int],
                     resolution: int) -> tuple[int, int]:
        """A reference's size for the autoencoder and Qwen3-VL alike: the pipeline's
        `calculate_dimensions` at the dataset's resolution squared (`edit.control_size`)."""
        return edit.control_size(image_size, resolution)

    def pipeline_text_images(self, images: list[Any]) -> list[Any]:
        """A sample's reference as the pipeline's Qwen3-VL reads it (`edit.text_images`)."""
        return edit.text_images(images) if self.spec.control_images else []

    def pipeline_images(self, images: list[Any], width: int, height: int) -> dict[str, Any]:
        """The pipeline's `image` and `output_resolution` (`edit.pipeline_images`)."""
        return edit.pipeline_images(images) if self.spec.control_images else {}

    def distilled(self, c: Components) -> bool:
        """Turbo: its folder's model_index.json ships `sample_sigmas` (the base has none), the
        rule diffusers' modular loader picks QwenImage21TurboModularPipeline by."""
        return bool(c.extras.get("pipeline_options", {}).get("sample_sigmas"))

    def objective(self, c: Components, cfg: "TrainConfig") -> FlowMatching:
        """Rectified flow; `flux_shift` shifts as the pipeline does, from the scheduler's mu at
        h x w image tokens (the objective counts 2 x 2 patches, so its token bounds are
        quartered: the same line)."""
        shift = scheduler_shift(c.scheduler.config)
        return FlowMatching(cfg, DynamicShift(shift.base_seq // SLOT, shift.max_seq // SLOT,
                                              shift.base_shift, shift.max_shift))

    def combine_text(self, c: Components, outputs: dict[str, dict[str, torch.Tensor]]
                     ) -> TextEmbeds:
        """Qwen3-VL's pre-norm last hidden states, system turn dropped, and their mask
        (QwenImage21Pipeline._get_qwen_prompt_embeds)."""
        qwen = outputs["qwen3vl"]
        return TextEmbeds({"prompt_embeds": qwen["hidden"], "prompt_embeds_mask": qwen["mask"]})

    @torch.no_grad()
    def encode_images(self, c: Components, pixels: torch.Tensor) -> torch.Tensor:
        """Pixels (B, 3, H, W) in [-1, 1] -> normalized (B, 64, H/16, W/16) latents, an opaque
        alpha channel added for an RGBA autoencoder."""
        if c.vae.config.in_channels == 4 and pixels.shape[1] == 3:
            pixels = torch.cat([pixels, torch.ones_like(pixels[:, :1])], dim=1)
        return frame_vae.encode(c.vae, pixels)

    def predict(self, c: Components, noisy: torch.Tensor, embeds: TextEmbeds, t: torch.Tensor,
                cond: Conditioning) -> torch.Tensor:
        """Velocity (noise - x0) for noisy latents at t in [0, 1] (1 = pure noise), as
        QwenImage21Pipeline calls the transformer for one prompt (no condition images).

        The transformer gives text padding RoPE positions (its frame index counts every text
        slot), so a caption padded to a longer one's length would condition otherwise than it
        does alone: samples are run in groups of one caption length, each without padding."""
        text = embeds.tensors["prompt_embeds"]
        lengths = embeds.tensors["prompt_embeds_mask"].sum(dim=1)
        groups = [((lengths == n).nonzero().squeeze(1), int(n)) for n in lengths.unique().tolist()]
        refs = cond.controls[-1:]  # the edit variant's one reference, (B, C, h', w')
        parts = [self._velocity(c, noisy[rows.to(noisy.device)], text[rows, :n],
                                t[rows.to(t.device)],
                                tuple(r[rows.to(r.device)] for r in refs)) for rows, n in groups]
        if len(parts) == 1:
            return parts[0]
        out = parts[0].new_empty((noisy.shape[0], *parts[0].shape[1:]))
        for (rows, _), part in zip(groups, parts):
            out[rows.to(out.device)] = part
        return out

    @staticmethod
    def _velocity(c: Components, noisy: torch.Tensor, text: torch.Tensor, t: torch.Tensor,
                  refs: tuple[torch.Tensor, ...] = ()) -> torch.Tensor:
        """The transformer's velocity for latents whose captions all have `text`'s length (no
        padding): the text's slots (a reference's at its `<|image_pad|>` run, `edit.slots`),
        then one image slot per 2 x 2 target tokens; a reference's tokens precede the
        target's, as QwenImage21Pipeline orders them."""
        b, _, h, w = noisy.shape
        text_slots = torch.zeros(text.shape[1], dtype=torch.bool)
        shapes, tokens = [], [to_tokens(noisy)]
        for ref in refs:
            rh, rw = ref.shape[2:]
            edit.check_size(rw * edit.PIXELS_PER_TOKEN, rh * edit.PIXELS_PER_TOKEN,
                            c.extras["processor"].image_processor)
            text_slots = edit.slots(text.shape[1], c.extras["image_offset"], rh * rw // SLOT)
            shapes.append((1, rh, rw))
            tokens.insert(0, to_tokens(ref.to(noisy.device, noisy.dtype)))
        slots = torch.cat([text_slots, torch.ones(h * w // SLOT, dtype=torch.bool)])
        out = c.denoiser(hidden_states=torch.cat(tokens, dim=1),
                         encoder_hidden_states=text.to(noisy.device, noisy.dtype),
                         timestep=t.to(noisy.dtype), img_shapes=[[*shapes, (1, h, w)]] * b,
                         img_mask=slots.expand(b, -1).to(noisy.device), return_dict=False)[0]
        return from_tokens(out[:, -h * w:], h, w)

    def lora_from_format(self, c: Components, tensors: dict[str, torch.Tensor]
                         ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """A LoRA file in diffusers names with per-module alphas: other trainers' prefixes and
        factor names mapped back, and the original layout's fused `img_mlp.gate_up` split
        into the gate and up modules it holds."""
        return keys.split_fused(*super().lora_from_format(c, tensors))

    def to_original(self, c: Components, state: dict[str, torch.Tensor], rank: int,
                    alpha: float) -> dict[str, torch.Tensor]:
        """diffusers-named LoRA -> the original checkpoint's names under `diffusion_model.`
        (gate and up fused), scale folded (`keys.to_original`)."""
        return keys.to_original(state, rank, alpha, self.denoiser_prefix)

    def pipeline(self, c: Components) -> "DiffusionPipeline":
        """QwenImage21Pipeline over the components, its processor, and the folder's sampling
        grid (Turbo's `sample_sigmas`; None: the pipeline's linear grid); for the edit
        variant its subclass that samples a reference from embeddings (`sampling.py`)."""
        import diffusers

        from difftune.families.qwen_image_21.sampling import EmbeddedEditPipeline

        options = c.extras.get("pipeline_options", {})
        kind = EmbeddedEditPipeline if self.spec.control_images else diffusers.QwenImage21Pipeline
        pipe = kind(
            transformer=c.denoiser, vae=c.vae, scheduler=c.scheduler,
            text_encoder=c.text_encoders["qwen3vl"], processor=c.extras["processor"],
            sample_sigmas=options.get("sample_sigmas"))
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def pipeline_image(self, result: Any) -> Any:
        """The first image, RGB: the autoencoder decodes RGBA (its alpha is dropped)."""
        return result.images[0][..., :3]

    def pipeline_inputs(self, embeds: TextEmbeds, negative: TextEmbeds | None,
                        guidance: float, cfg: float) -> dict[str, Any]:
        """QwenImage21Pipeline arguments: precomputed (negative) embeddings with their masks
        and true CFG (`true_cfg_scale`, on when > 1 with a negative prompt)."""
        return true_cfg_inputs(embeds, negative, cfg)
