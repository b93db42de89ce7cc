"""Anima: Cosmos-Predict2's flow DiT conditioned through an LLM adapter on Qwen3 and T5 tokens.

Text: Qwen3's last hidden states of the caption and the caption's T5 token rows (both cached,
each caption's own tokens) are joined by the LLM adapter (diffusers' AnimaTextConditioner, in
`Components.extras["text_conditioner"]`, frozen, on the device in the denoiser's dtype) into
(B, 512, 1024) embeddings, as AnimaTextConditioningStep makes them (`combine_text`). Latents
come from the Qwen-Image VAE (per-channel normalization, an image as one frame). The
transformer reads (B, 16, 1, h, w), the time as sigma (the modular pipeline's timestep / 1000),
a padding mask of zeros, and predicts the velocity (noise - x0) FlowMatchEulerDiscreteScheduler
steps with.

diffusers 0.42.1 ships Anima as a modular pipeline only, and its pieces run as released except
CosmosTransformer3DModel's padding-mask resize, which needs torchvision without declaring it
(`cosmos_compat`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from difftune.families.anima.conditioner import conditioned
from difftune.families.anima.spec import SPEC
from difftune.families.base import Components, Conditioning, TextEmbeds
from difftune.families.common import frame_vae
from difftune.families.common.family import FamilyBase, Loaders, freeze, place

if TYPE_CHECKING:
    from diffusers import DiffusionPipeline

    from difftune.config import ModelConfig
    from difftune.precision.policy import PrecisionPolicy

_BLOCK = r"transformer_blocks\.\d+\."
_ATTENTION = [_BLOCK + r"(?:attn1|attn2)\.(?:to_q|to_k|to_v|to_out\.0)"]
_MLP = [_BLOCK + r"ff\.net\.(?:0\.proj|2)"]
# Each block's adaptive-norm (AdaLN-LoRA) projections, which modulate it from the time.
_MODULATION = [_BLOCK + r"norm[123]\.linear_[12]"]
PRESETS: dict[str, list[str]] = {
    "attention": _ATTENTION,
    "attention_mlp": _ATTENTION + _MLP,
    "all_linear": _ATTENTION + _MLP + _MODULATION,
}


class AnimaFamily(FamilyBase):
    """The Anima family."""

    spec = SPEC
    presets = PRESETS
    loaders = Loaders("build_tiny_anima", "load_anima_files", "load_anima_text_encoders")

    def components(self, parts: dict[str, Any], cfg: "ModelConfig",
                   policy: "PrecisionPolicy") -> Components:
        """The generic components plus the LLM adapter in `extras`, placed and frozen like the
        denoiser it belongs to (it is part of Anima's diffusion-model file)."""
        comps = super().components(parts, cfg, policy)
        conditioner = place(parts["text_conditioner"], policy.device, policy.denoiser)
        freeze(conditioner)
        comps.extras["text_conditioner"] = conditioner
        return comps

    def combine_text(self, c: Components, outputs: dict[str, dict[str, torch.Tensor]]
                     ) -> TextEmbeds:
        """The LLM adapter's (B, 512, D) output for Qwen3's states and the T5 token rows."""
        out = conditioned(c.extras["text_conditioner"], outputs["qwen3"], outputs["t5_tokens"])
        return TextEmbeds({"prompt_embeds": out})

    @torch.no_grad()
    def encode_images(self, c: Components, pixels: torch.Tensor) -> torch.Tensor:
        """Pixels in [-1, 1] -> normalized (B, 16, h, w) latents (one frame through the VAE)."""
        return frame_vae.encode(c.vae, pixels)

    def predict(self, c: Components, noisy: torch.Tensor, embeds: TextEmbeds, t: torch.Tensor,
                cond: Conditioning) -> torch.Tensor:
        """Velocity (noise - x0) for noisy latents at t in [0, 1] (1 = pure noise), as the
        modular pipeline's denoise loop calls the transformer: one frame, the time as sigma in
        the denoiser's dtype, a padding mask of zeros."""
        dtype = noisy.dtype
        mask = noisy.new_zeros(1, 1, *noisy.shape[-2:])
        out = c.denoiser(hidden_states=noisy.unsqueeze(2), timestep=t.to(dtype),
                         encoder_hidden_states=embeds.tensors["prompt_embeds"].to(dtype),
                         padding_mask=mask, return_dict=False)[0]
        return out.squeeze(2)

    def pipeline(self, c: Components) -> "DiffusionPipeline":
        """AnimaModularPipeline over the components (`sampling.AnimaModularPipeline`: from
        prompts as released, or from difftune's embeddings)."""
        from difftune.families.anima.sampling import sampling_pipeline

        parts = {"transformer": c.denoiser, "vae": c.vae, "scheduler": c.scheduler,
                 "text_conditioner": c.extras["text_conditioner"],
                 "text_encoder": c.text_encoders["qwen3"], "tokenizer": c.tokenizers["qwen3"],
                 "t5_tokenizer": c.tokenizers["t5_tokens"]}
        pipe = sampling_pipeline(parts)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def pipeline_inputs(self, embeds: TextEmbeds, negative: TextEmbeds | None,
                        guidance: float, cfg: float) -> dict[str, Any]:
        """The conditioned embeddings, and CFG at `cfg` with the negative ones."""
        kwargs: dict[str, Any] = {"prompt_embeds": embeds.tensors["prompt_embeds"],
                                  "guidance_scale": 1.0}
        if negative is not None and cfg > 1.0:
            kwargs.update(negative_prompt_embeds=negative.tensors["prompt_embeds"],
                          guidance_scale=cfg)
        return kwargs

    def pipeline_image(self, result: Any) -> Any:
        """The first image of the pipeline state's `images`."""
        return result.images[0]

    def single_file_extras(self, c: Components) -> dict[str, torch.Tensor]:
        """The LLM adapter under `llm_adapter.` (frozen, as loaded): Anima's files hold it, and
        ComfyUI tells Anima from Cosmos-Predict2 by it (comfy/model_detection.py)."""
        conditioner = c.extras["text_conditioner"].state_dict()
        return {f"llm_adapter.{k}": v for k, v in conditioner.items()}

    def lora_refusal(self, c: Components, tensors: dict[str, torch.Tensor],
                     metadata: dict[str, str] | None = None) -> str | None:
        """A LoRA that also adapts the LLM adapter (`llm_adapter.*` in the original names,
        which sd-scripts can train; `text_conditioner.*` in diffusers'): difftune trains and
        samples Anima's transformer only, so starting from it or sampling with it would drop
        that part unseen; the modules are named."""
        found = sorted({k.rsplit(".", 2)[0] for k in tensors
                        if "llm_adapter" in k or k.startswith("text_conditioner.")})
        if not found:
            return None
        return (f"this LoRA also adapts Anima's LLM adapter ({', '.join(found[:3])}"
                f"{', ...' if len(found) > 3 else ''}), which difftune neither trains nor "
                "applies (its text conditioning runs the adapter as released); ComfyUI applies "
                "the whole file. To start from its transformer part, save a copy without the "
                "llm_adapter keys")

    def lora_from_format(self, c: Components, tensors: dict[str, torch.Tensor]
                         ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """A LoRA file in diffusers names and per-module alphas where the file has them (the
        layouts `anima.keys.diffusers_names` reads)."""
        from difftune.families.anima.keys import diffusers_names

        modules = (n for n, _ in c.denoiser.named_modules() if n)
        return diffusers_names(tensors, modules, self.denoiser_prefix)

    def to_original(self, c: Components, state: dict[str, torch.Tensor], rank: int,
                    alpha: float) -> dict[str, torch.Tensor]:
        """diffusers-named LoRA -> `diffusion_model.<original module>` keys: the default."""
        from difftune.families.anima.keys import original_layout

        return original_layout(state, rank=rank, alpha=alpha, prefix=self.denoiser_prefix)
