"""SD3 / SD3.5: a flow-matching MMDiT with CLIP-L, CLIP-G (penultimate + pooled) and T5 context.

Unlike FLUX.1 the transformer takes latents in their (B, C, h, w) layout (it patchifies
itself), a 0..1000 timestep, and a context that joins the two CLIPs' hidden states (zero-padded
to T5's width) to the T5 sequence; its pooled input is both CLIPs' projections side by side.
Training is the same rectified flow as FLUX.1 (`FlowMatching`).
"""

from __future__ import annotations

from typing import Any

import torch

from difftune.families.base import Conditioning, Components, ModelSpec, TextEmbeds
from difftune.families.common.family import FamilyBase, Loaders, prompt_kwargs
from difftune.families.sd3.spec import SPEC

# Module-name patterns (full match against the transformer's module names) for LoRA presets.
# attn2 exists only in SD3.5's dual-attention blocks; the pattern simply matches nothing in SD3.
_BLOCK = r"transformer_blocks\.\d+\."
_ATTENTION = [
    _BLOCK + r"attn\.(?:to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)",
    _BLOCK + r"attn2\.(?:to_q|to_k|to_v|to_out\.0)",
]
_MLP = [_BLOCK + r"(?:ff|ff_context)\.net\.(?:0\.proj|2)"]
_MODULATION = [_BLOCK + r"(?:norm1|norm1_context)\.linear"]
PRESETS: dict[str, list[str]] = {
    "attention": _ATTENTION,
    "attention_mlp": _ATTENTION + _MLP,
    "all_linear": _ATTENTION + _MLP + _MODULATION,
}

class SD3Family(FamilyBase):
    """The SD3 / SD3.5 family."""

    spec = SPEC
    presets = PRESETS
    loaders = Loaders("build_tiny_sd3", "source_parts", "text_parts")

    def combine_text(self, c: Components, enc: dict[str, dict[str, torch.Tensor]]) -> TextEmbeds:
        """Joint context and pooled vector, as StableDiffusion3Pipeline.encode_prompt builds them."""
        t5 = enc["t5"]["hidden"]
        clip = torch.cat([enc["clip_l"]["hidden"], enc["clip_g"]["hidden"]], dim=-1)
        # The CLIP states are zero-padded on the feature axis up to T5's width, then the two
        # sequences are joined token-wise (77 CLIP tokens followed by the T5 tokens).
        clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
        prompt = torch.cat([clip.to(t5.dtype), t5], dim=-2)
        pooled = torch.cat([enc["clip_l"]["pooled"], enc["clip_g"]["pooled"]], dim=-1)
        return TextEmbeds({"prompt_embeds": prompt, "pooled_prompt_embeds": pooled})

    def predict(self, c: Components, noisy: torch.Tensor, embeds: TextEmbeds, t: torch.Tensor,
                cond: Conditioning) -> torch.Tensor:
        """Velocity (noise - x0) for noisy latents at t in [0, 1] (1 = pure noise).

        SD3Transformer2DModel embeds the timestep on the scheduler's 0..1000 scale (the pipeline
        passes `sigma * 1000`), so t is scaled here.
        """
        dtype = noisy.dtype
        return c.denoiser(
            hidden_states=noisy,
            encoder_hidden_states=embeds.tensors["prompt_embeds"],
            pooled_projections=embeds.tensors["pooled_prompt_embeds"],
            timestep=(t * 1000.0).to(dtype),
            return_dict=False,
        )[0]

    def pipeline_inputs(self, embeds: TextEmbeds, negative: TextEmbeds | None,
                        guidance: float, cfg: float) -> dict[str, Any]:
        """StableDiffusion3Pipeline arguments: precomputed (negative) embeddings and CFG scale.

        SD3 is not guidance-distilled, so `guidance` has no input; CFG is the pipeline's
        `guidance_scale` (on when > 1).
        """
        kwargs: dict[str, Any] = {**prompt_kwargs(embeds), "guidance_scale": cfg}
        if negative is not None and cfg > 1.0:
            kwargs.update(prompt_kwargs(negative, "negative_"))
        return kwargs

    def model_spec(self, c: Components) -> ModelSpec:
        """SD3 medium, SD3.5 medium or large (told apart by the transformer's config)."""
        from difftune.families.sd3 import keys

        config = c.denoiser.config
        kind = keys.variant(config.qk_norm, tuple(config.dual_attention_layers or ()))
        return ModelSpec(keys.VARIANTS[kind], keys.IMPLEMENTATION, kind, keys.NETWORK_MODULE)

    def lora_from_format(self, c: Components, tensors: dict[str, torch.Tensor]
                         ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """A LoRA file's tensors in diffusers names, and per-module alphas (kohya files)."""
        if not any(k.startswith("lora_unet_") for k in tensors):
            return dict(tensors), {}
        from difftune.families.sd3.keys import kohya_to_diffusers

        return kohya_to_diffusers(tensors, c.denoiser.config.num_layers, self.denoiser_prefix)

    def to_kohya(self, c: Components, state: dict[str, torch.Tensor], rank: int, alpha: float
                 ) -> dict[str, torch.Tensor]:
        """diffusers-named LoRA -> kohya / ComfyUI keys in the MMDiT layout."""
        from difftune.families.sd3.keys import diffusers_to_kohya

        return diffusers_to_kohya(state, alpha=alpha, rank=rank,
                                  num_layers=c.denoiser.config.num_layers)
