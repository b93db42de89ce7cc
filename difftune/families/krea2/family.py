"""Krea 2: a single-stream flow DiT conditioned on a stack of Qwen3-VL hidden states.

The transformer reads packed 2x2 latent patches, the caption as a fixed 512-token block of 12
tapped encoder layers (batch, seq, layers, dim) with a bool mask, rotary ids with the text at
the origin, and the flow time sigma in [0, 1]; it predicts the velocity (noise - x0) that
Krea2Pipeline's Euler scheduler steps with. The pipeline's `is_distilled` and layer taps come
from the loaded model (model_index.json) and are handed back to the pipeline for sampling.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from difftune.families.base import Components, Conditioning, TextEmbeds
from difftune.families.common import frame_vae
from difftune.families.common.family import FamilyBase, Loaders
from difftune.families.common.latents import pack, unpack
from difftune.families.krea2.spec import SPEC
from difftune.train.objectives.flow import DynamicShift, FlowMatching

if TYPE_CHECKING:
    from diffusers import DiffusionPipeline

    from difftune.config import ModelConfig, TrainConfig
    from difftune.precision.policy import PrecisionPolicy

# Krea2Pipeline's fixed timestep shift for the distilled (turbo) checkpoint.
DISTILLED_MU = 1.15
_BLOCK = r"transformer_blocks\.\d+\."
_ATTENTION = [_BLOCK + r"attn\.(?:to_q|to_k|to_v|to_out\.0)"]
_MLP = [_BLOCK + r"ff\.(?:gate|up|down)"]
_REST = [_BLOCK + r"attn\.to_gate",
         r"text_fusion\.(?:layerwise|refiner)_blocks\.\d+\.(?:attn\.(?:to_q|to_k|to_v|to_gate|"
         r"to_out\.0)|ff\.(?:gate|up|down))"]
PRESETS: dict[str, list[str]] = {
    "attention": _ATTENTION,
    "attention_mlp": _ATTENTION + _MLP,
    "all_linear": _ATTENTION + _MLP + _REST,
}


def position_ids(text_len: int, h: int, w: int, device: torch.device) -> torch.Tensor:
    """Krea2Pipeline's rotary ids for `text_len` text tokens and an (h, w) latent (h/2 x w/2
    patches): its own `prepare_position_ids`, so they are the pipeline's exactly."""
    from diffusers import Krea2Pipeline

    return Krea2Pipeline.prepare_position_ids(text_len, h // 2, w // 2, device)


class Krea2Family(FamilyBase):
    """The Krea 2 family."""

    spec = SPEC
    presets = PRESETS
    loaders = Loaders("build_tiny_krea2", "load_krea2_files", "load_krea2_text_encoders")

    def components(self, parts: dict[str, Any], cfg: "ModelConfig",
                   policy: "PrecisionPolicy") -> Components:
        """The shared placement, with the pipeline options of the loaded model kept in
        extras (the tiny flavor has the pipeline's defaults)."""
        comps = super().components(parts, cfg, policy)
        from difftune.families.krea2.files import PIPELINE_DEFAULTS

        comps.extras["pipeline_options"] = dict(parts.get("pipeline_options", PIPELINE_DEFAULTS))
        return comps

    def objective(self, c: Components, cfg: "TrainConfig") -> FlowMatching:
        """Rectified flow; `flux_shift` shifts as Krea2Pipeline does: from the scheduler's
        resolution-dependent mu for the base model, by the fixed mu of the distilled one."""
        if c.extras.get("pipeline_options", {}).get("is_distilled"):
            return FlowMatching(cfg, DynamicShift(base_shift=DISTILLED_MU, max_shift=DISTILLED_MU))
        return super().objective(c, cfg)

    def combine_text(self, c: Components, outputs: dict[str, dict[str, torch.Tensor]]
                     ) -> TextEmbeds:
        """The stacked hidden states and their bool mask (Krea2Pipeline.encode_prompt)."""
        qwen = outputs["qwen3vl"]
        return TextEmbeds({"prompt_embeds": qwen["hidden"],
                           "prompt_embeds_mask": qwen["mask"].bool()})

    @torch.no_grad()
    def encode_images(self, c: Components, pixels: torch.Tensor) -> torch.Tensor:
        """Pixels in [-1, 1] -> one-frame Qwen-Image latents normalized by their channel
        statistics (the inverse of the pipeline's decode)."""
        return frame_vae.encode(c.vae, pixels)

    def predict(self, c: Components, noisy: torch.Tensor, embeds: TextEmbeds, t: torch.Tensor,
                cond: Conditioning) -> torch.Tensor:
        """Velocity (noise - x0) for noisy latents at t in [0, 1] (1 = pure noise): the
        pipeline passes sigma (timestep / 1000) in the latents' dtype."""
        dtype = noisy.dtype
        b, _, h, w = noisy.shape
        hidden = embeds.tensors["prompt_embeds"].to(dtype)
        mask = embeds.tensors["prompt_embeds_mask"].bool()
        out = c.denoiser(hidden_states=pack(noisy), encoder_hidden_states=hidden,
                         timestep=t.to(dtype).expand(b),
                         position_ids=position_ids(hidden.shape[1], h, w, noisy.device),
                         encoder_attention_mask=mask, return_dict=False)[0]
        return unpack(out, h, w)

    def distilled(self, c: Components) -> bool:
        """Turbo: the folder's model_index.json declares is_distilled (Raw does not)."""
        return bool(c.extras.get("pipeline_options", {}).get("is_distilled"))

    def pipeline(self, c: Components) -> "DiffusionPipeline":
        """Krea2Pipeline over the components, with the loaded model's `is_distilled` (its
        timestep shift) and layer taps."""
        import diffusers

        options = {k: v for k, v in c.extras.get("pipeline_options", {}).items()
                   if v is not None}
        pipe = diffusers.Krea2Pipeline(transformer=c.denoiser, vae=c.vae,
                                       scheduler=c.scheduler,
                                       text_encoder=c.text_encoders["qwen3vl"],
                                       tokenizer=c.tokenizers["qwen3vl"], **options)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def pipeline_inputs(self, embeds: TextEmbeds, negative: TextEmbeds | None,
                        guidance: float, cfg: float) -> dict[str, Any]:
        """Krea2Pipeline arguments: the embeddings and masks, and CFG.

        The pipeline's `guidance_scale` g computes pos + g * (pos - neg), standard CFG at
        scale g + 1, so a CFG scale `cfg` is passed as cfg - 1 (0: no CFG).
        """
        kwargs: dict[str, Any] = {"prompt_embeds": embeds.tensors["prompt_embeds"],
                                  "prompt_embeds_mask": embeds.tensors["prompt_embeds_mask"],
                                  "guidance_scale": 0.0}
        if negative is not None and cfg > 1.0:
            kwargs.update(negative_prompt_embeds=negative.tensors["prompt_embeds"],
                          negative_prompt_embeds_mask=negative.tensors["prompt_embeds_mask"],
                          guidance_scale=cfg - 1.0)
        return kwargs

    def lora_from_format(self, c: Components, tensors: dict[str, torch.Tensor]
                         ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """A LoRA file in diffusers names, and per-module alphas where the file has them
        (the layouts `keys.diffusers_names` reads)."""
        from difftune.families.krea2.keys import diffusers_names

        return diffusers_names(tensors, self.denoiser_prefix)

    def to_kohya(self, c: Components, state: dict[str, torch.Tensor], rank: int, alpha: float
                 ) -> dict[str, torch.Tensor]:
        """The original (Krea 2 / ComfyUI) layout: `keys.to_original`."""
        from difftune.families.krea2.keys import to_original

        return to_original(state, rank, alpha)
