"""FLUX.1 (dev and schnell): a flow-matching MMDiT with CLIP-L (pooled) and T5-XXL (sequence).

Latents are 16-channel VAE latents packed into 2x2 patches (64 features a token); positions go
to the transformer as (0, row, col) ids; guidance-distilled checkpoints (dev) take the guidance
value as an input.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from difftune.families import text
from difftune.families.base import (Components, Conditioning, ModelSpec, TextEmbeds,
                                    TextEncoderSpec)
from difftune.train.objectives import FlowMatching

if TYPE_CHECKING:
    from diffusers import DiffusionPipeline

    from difftune.config import ModelConfig, TrainConfig
    from difftune.precision import PrecisionPolicy
    from difftune.train.objectives import Objective

# Module-name patterns (full match against the transformer's module names) for LoRA presets.
_BLOCK = r"(?:transformer_blocks|single_transformer_blocks)\.\d+\."
_ATTENTION = [
    _BLOCK + r"attn\.(?:to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)",
]
_MLP = [
    r"transformer_blocks\.\d+\.(?:ff|ff_context)\.net\.(?:0\.proj|2)",
    r"single_transformer_blocks\.\d+\.(?:proj_mlp|proj_out)",
]
_MODULATION = [
    r"transformer_blocks\.\d+\.(?:norm1|norm1_context)\.linear",
    r"single_transformer_blocks\.\d+\.norm\.linear",
]
PRESETS: dict[str, list[str]] = {
    "attention": _ATTENTION,
    "attention_mlp": _ATTENTION + _MLP,
    "all_linear": _ATTENTION + _MLP + _MODULATION,
}


def pack(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) -> (B, h/2 * w/2, C*4): 2x2 patches become tokens, as FluxPipeline packs."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Inverse of `pack` for latents of height h and width w."""
    b, _, d = tokens.shape
    c = d // 4
    x = tokens.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c, h, w)


def image_ids(h: int, w: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """(h/2 * w/2, 3) position ids (0, row, col) of the packed latent tokens."""
    rows = torch.arange(h // 2, device=device, dtype=dtype)[:, None].expand(h // 2, w // 2)
    cols = torch.arange(w // 2, device=device, dtype=dtype)[None, :].expand(h // 2, w // 2)
    ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1)
    return ids.reshape(-1, 3)


def place(module: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """Move a module to a device, casting only when its dtype differs."""
    if module.dtype != dtype:
        module = module.to(dtype=dtype)
    return module.to(device)


def frozen_encoders(modules: dict[str, torch.nn.Module], policy: "PrecisionPolicy"
                    ) -> dict[str, torch.nn.Module]:
    """Text encoders placed on the policy's device in its text-encoder dtype, frozen, eval."""
    out = {n: place(m, policy.device, policy.text_encoders) for n, m in modules.items()}
    for module in out.values():
        module.requires_grad_(False)
        module.eval()
    return out


class FluxFamily:
    """The FLUX.1 family."""

    name = "flux"
    text_encoders = (
        TextEncoderSpec("clip_l", "clip", max_length=77, hidden="none", pooled=True),
        TextEncoderSpec("t5", "t5", max_length=512, hidden="last", pooled=False),
    )
    # VAE downscale 8 x 2x2 packing: bucket sides must be multiples of 16.
    bucket_step = 16
    denoiser_prefix = "transformer"
    text_encoder_prefixes = {"clip_l": "text_encoder", "t5": "text_encoder_2"}
    default_cfg = 1.0  # guidance-distilled: true CFG off unless a prompt asks for it
    # diffusers keys: read by diffusers and ComfyUI alike (alpha folded into the up factors).
    default_format = "diffusers"
    # Kept out of fp8 storage and quantization (regexes on module names, per part): the
    # timestep/guidance/text embedders and the input and output projections.
    swap_blocks = ("transformer_blocks", "single_transformer_blocks")
    compile_blocks = ("transformer_blocks", "single_transformer_blocks")
    keep_high = {
        "denoiser": (r"^time_text_embed\.", r"^x_embedder$", r"^context_embedder$",
                     r"^norm_out\.", r"^proj_out$"),
        # T5's feed-forward output casts its input to `wo`'s stored dtype (fp8 would break it).
        "text_encoders": (r"embeddings", r"embed_tokens", r"^shared$", r"text_projection",
                          r"\.wo$"),
        "vae": (r"conv_in$", r"conv_out$", r"quant_conv$"),
    }

    def objective(self, c: Components, cfg: "TrainConfig") -> "Objective":
        """Rectified flow with the configured timestep sampling."""
        return FlowMatching(cfg)

    def load(self, cfg: "ModelConfig", policy: "PrecisionPolicy") -> Components:
        """Build the tiny flavor or read FLUX.1 from local files, frozen, in the policy's dtypes."""
        dtypes = {"transformer": policy.denoiser, "text_encoders": policy.text_encoders,
                  "vae": policy.vae}
        if cfg.flavor == "tiny":
            from difftune.families.tiny import build_tiny_flux

            parts = build_tiny_flux()
            parts.update(name="difftune/tiny-flux", fingerprint="tiny-flux-v1")
        else:
            from difftune.families.flux_files import load_flux_files

            parts = load_flux_files(cfg, dtypes)
        comps = Components(
            denoiser=place(parts["transformer"], policy.denoiser_home, policy.denoiser),
            vae=place(parts["vae"], policy.device, policy.vae),
            text_encoders={
                "clip_l": place(parts["text_encoder"], policy.device, policy.text_encoders),
                "t5": place(parts["text_encoder_2"], policy.device, policy.text_encoders),
            },
            tokenizers={"clip_l": parts["tokenizer"], "t5": parts["tokenizer_2"]},
            scheduler=parts["scheduler"],
            name=cfg.name or parts["name"],
            fingerprint=parts["fingerprint"],
            extras={"max_length": {"t5": int(parts["t5_max_length"])}},
        )
        for module in (comps.denoiser, comps.vae, *comps.text_encoders.values()):
            module.requires_grad_(False)
            module.eval()
        return comps

    def load_text_encoders(self, cfg: "ModelConfig", policy: "PrecisionPolicy"
                           ) -> dict[str, torch.nn.Module]:
        """CLIP-L and T5 alone, frozen, placed as `load` places them (reload after unloading)."""
        if cfg.flavor == "tiny":
            from difftune.families.tiny import build_tiny_flux

            parts = build_tiny_flux()
        else:
            from difftune.families.flux_files import load_flux_text_encoders

            parts = load_flux_text_encoders(cfg, policy.text_encoders)
        return frozen_encoders({"clip_l": parts["text_encoder"], "t5": parts["text_encoder_2"]},
                               policy)

    def encode_text(self, c: Components, texts: list[str],
                    options: "text.EncodeOptions | None" = None) -> TextEmbeds:
        """Encode with every text encoder (no grad) and combine, for sampling."""
        return self.combine_text(c, text.encode_all(self.text_encoders, c, texts, options))

    def combine_text(self, c: Components, outputs: dict[str, dict[str, torch.Tensor]]) -> TextEmbeds:
        """CLIP-L pooled output and T5 last hidden states, as FluxPipeline.encode_prompt."""
        return TextEmbeds({"pooled_prompt_embeds": outputs["clip_l"]["pooled"],
                           "prompt_embeds": outputs["t5"]["hidden"]})

    @torch.no_grad()
    def encode_images(self, c: Components, pixels: torch.Tensor) -> torch.Tensor:
        """Pixels in [-1, 1] -> latents normalized with the VAE's shift and scaling factors."""
        vae = c.vae
        device = text.module_device(vae)
        dist = vae.encode(pixels.to(device, vae.dtype)).latent_dist
        # The mode (mean) rather than a sample: deterministic, so latents can be cached.
        z = dist.mode()
        shift = vae.config.shift_factor or 0.0
        return (z - shift) * vae.config.scaling_factor

    def predict(
        self,
        c: Components,
        noisy: torch.Tensor,
        embeds: TextEmbeds,
        t: torch.Tensor,
        cond: Conditioning,
    ) -> torch.Tensor:
        """Velocity prediction for noisy latents at t in [0, 1] (1 = pure noise)."""
        model = c.denoiser
        b, _, h, w = noisy.shape
        dtype = noisy.dtype
        prompt = embeds.tensors["prompt_embeds"]
        kwargs: dict[str, Any] = {}
        if model.config.guidance_embeds:
            kwargs["guidance"] = torch.full((b,), cond.guidance, device=noisy.device, dtype=dtype)
        out = model(
            hidden_states=pack(noisy),
            encoder_hidden_states=prompt,
            pooled_projections=embeds.tensors["pooled_prompt_embeds"],
            timestep=t.to(dtype),
            img_ids=image_ids(h, w, noisy.device, dtype),
            txt_ids=torch.zeros(prompt.shape[1], 3, device=noisy.device, dtype=dtype),
            return_dict=False,
            **kwargs,
        )[0]
        return unpack(out, h, w)

    def lora_targets(self, preset: str) -> list[str]:
        """Full-match regexes of module names for a preset."""
        return list(PRESETS[preset])

    def pipeline(self, c: Components) -> "DiffusionPipeline":
        """A FluxPipeline over the loaded components (text encoders wherever they now live)."""
        from diffusers import FluxPipeline

        pipe = FluxPipeline(
            scheduler=c.scheduler,
            vae=c.vae,
            text_encoder=c.text_encoders["clip_l"],
            tokenizer=c.tokenizers["clip_l"],
            text_encoder_2=c.text_encoders["t5"],
            tokenizer_2=c.tokenizers["t5"],
            transformer=c.denoiser,
        )
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def pipeline_inputs(self, embeds: TextEmbeds, negative: TextEmbeds | None,
                        guidance: float, cfg: float) -> dict[str, Any]:
        """FluxPipeline arguments: precomputed embeddings, distilled guidance and true CFG."""
        kwargs: dict[str, Any] = {
            "prompt_embeds": embeds.tensors["prompt_embeds"],
            "pooled_prompt_embeds": embeds.tensors["pooled_prompt_embeds"],
            "guidance_scale": guidance,
        }
        if negative is not None and cfg > 1.0:
            kwargs["negative_prompt_embeds"] = negative.tensors["prompt_embeds"]
            kwargs["negative_pooled_prompt_embeds"] = negative.tensors["pooled_prompt_embeds"]
            kwargs["true_cfg_scale"] = cfg
        return kwargs

    def model_spec(self, c: Components) -> ModelSpec:
        """FLUX.1 dev (guidance-distilled) or schnell, as kohya and model sites name them."""
        from difftune.families import flux_keys as keys

        return ModelSpec(keys.ARCHITECTURE[bool(c.denoiser.config.guidance_embeds)],
                         keys.IMPLEMENTATION, keys.BASE_VERSION, keys.NETWORK_MODULE)

    def lora_from_format(self, c: Components, tensors: dict[str, torch.Tensor]
                         ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """A LoRA file's tensors in diffusers names, and per-module alphas (kohya files)."""
        if not any(k.startswith("lora_unet_") for k in tensors):
            return dict(tensors), {}
        from difftune.families.flux_keys import kohya_to_diffusers

        return kohya_to_diffusers(tensors, self.denoiser_prefix)

    def lora_to_format(
        self, c: Components, state: dict[str, torch.Tensor], fmt: str, rank: int, alpha: float
    ) -> dict[str, torch.Tensor]:
        """diffusers-named LoRA -> the requested key layout ("diffusers" or "kohya")."""
        if fmt == "diffusers":
            return dict(state)
        from difftune.families.flux_keys import diffusers_to_kohya

        return diffusers_to_kohya(state, alpha=alpha, rank=rank)
