"""SD3 / SD3.5: a flow-matching MMDiT with CLIP-L, CLIP-G (penultimate + pooled) and T5 context.

Unlike FLUX.1 the transformer takes latents in their (B, C, h, w) layout (it patchifies
itself), a 0..1000 timestep, and a context that joins the two CLIPs' hidden states (zero-padded
to T5's width) to the T5 sequence; its pooled input is both CLIPs' projections side by side.
Training is the same rectified flow as FLUX.1 (`FlowMatching`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from difftune.errors import ModelFileError
from difftune.families import text
from difftune.families.base import (Components, Conditioning, ModelSpec, TextEmbeds,
                                    TextEncoderSpec)
from difftune.families.flux import frozen_encoders, place
from difftune.train.objectives import FlowMatching

if TYPE_CHECKING:
    from diffusers import DiffusionPipeline

    from difftune.config import ModelConfig, TrainConfig
    from difftune.precision import PrecisionPolicy
    from difftune.train.objectives import Objective

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

# (TextEncoderSpec name, diffusers text-encoder subfolder, tokenizer subfolder).
ENCODER_FOLDERS = (("clip_l", "text_encoder", "tokenizer"),
                   ("clip_g", "text_encoder_2", "tokenizer_2"),
                   ("t5", "text_encoder_3", "tokenizer_3"))
SINGLE_FILES = ("transformer", "vae", "clip_l", "t5")


def load_sd3_folder(folder: Path, dtypes: dict[str, torch.dtype]) -> dict[str, Any]:
    """All components of a diffusers SD3/3.5 folder, keyed as StableDiffusion3Pipeline names them.

    Local files and safetensors only (`folders.from_folder`); the fingerprint covers every
    component file so cache keys change when any of them does.
    """
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
    )
    from transformers import AutoTokenizer, CLIPTextModelWithProjection, T5EncoderModel

    from difftune.families.component_files import fingerprint
    from difftune.families.folders import check_folder, folder_files, from_folder

    what = "SD3"
    check_folder(folder, what)
    te_dtype = dtypes["text_encoders"]
    parts: dict[str, Any] = {
        "transformer": from_folder(SD3Transformer2DModel, folder, "transformer",
                                   dtypes["transformer"], what),
        "vae": from_folder(AutoencoderKL, folder, "vae", dtypes["vae"], what),
        "scheduler": from_folder(FlowMatchEulerDiscreteScheduler, folder, "scheduler", None, what),
    }
    for _, te_sub, tok_sub in ENCODER_FOLDERS:
        cls = T5EncoderModel if te_sub == "text_encoder_3" else CLIPTextModelWithProjection
        parts[te_sub] = from_folder(cls, folder, te_sub, te_dtype, what)
        parts[tok_sub] = from_folder(AutoTokenizer, folder, tok_sub, None, what)
    subs = ["transformer", "vae"] + [te for _, te, _ in ENCODER_FOLDERS]
    parts.update(name=str(folder.name), fingerprint=fingerprint(folder_files(folder, subs)))
    return parts


def _source_parts(cfg: "ModelConfig", dtypes: dict[str, torch.dtype]) -> dict[str, Any]:
    """The tiny flavor's parts, or a diffusers folder's; single files are refused clearly."""
    if cfg.flavor == "tiny":
        from difftune.families.tiny_sd import build_tiny_sd3

        parts = build_tiny_sd3()
        parts.update(name="difftune/tiny-sd3", fingerprint="tiny-sd3-v1")
        return parts
    if cfg.transformer is not None:  # one Stability-layout checkpoint (+ tokenizers in path)
        from difftune.families.sd_files import load_sd3_file

        return load_sd3_file(cfg, dtypes)
    given = [k for k in SINGLE_FILES if getattr(cfg, k) is not None]
    if given:
        raise ModelFileError(
            f"model.{', model.'.join(given)} given without model.transformer: SD3 single files "
            "start from the checkpoint (model.transformer); set it, or use only model.path")
    assert cfg.path is not None  # ModelConfig guarantees a source
    return load_sd3_folder(Path(cfg.path), dtypes)


class SD3Family:
    """The SD3 / SD3.5 family."""

    name = "sd3"
    text_encoders = (
        TextEncoderSpec("clip_l", "clip_projection", max_length=77, hidden="penultimate",
                        pooled=True),
        TextEncoderSpec("clip_g", "clip_projection", max_length=77, hidden="penultimate",
                        pooled=True),
        TextEncoderSpec("t5", "t5", max_length=256, hidden="last", pooled=False),
    )
    # VAE downscale 8 x patch size 2: bucket sides must be multiples of 16.
    bucket_step = 16
    denoiser_prefix = "transformer"
    text_encoder_prefixes = {"clip_l": "text_encoder", "clip_g": "text_encoder_2",
                             "t5": "text_encoder_3"}
    default_cfg = 5.0
    # diffusers keys: read by diffusers and ComfyUI alike (diffusers reads no SD3 kohya file).
    default_format = "diffusers"
    # Kept out of fp8 storage and quantization (regexes on module names, per part).
    swap_blocks = ("transformer_blocks",)
    compile_blocks = ("transformer_blocks",)
    keep_high = {
        "denoiser": (r"^time_text_embed\.", r"^pos_embed\.", r"^context_embedder$",
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
        """Build the tiny flavor or read a diffusers SD3 folder, frozen, in the policy's dtypes."""
        dtypes = {"transformer": policy.denoiser, "text_encoders": policy.text_encoders,
                  "vae": policy.vae}
        parts = _source_parts(cfg, dtypes)
        extras: dict[str, Any] = {}
        if "t5_max_length" in parts:
            extras["max_length"] = {"t5": int(parts["t5_max_length"])}
        comps = Components(
            denoiser=place(parts["transformer"], policy.denoiser_home, policy.denoiser),
            vae=place(parts["vae"], policy.device, policy.vae),
            text_encoders={spec: place(parts[te], policy.device, policy.text_encoders)
                           for spec, te, _ in ENCODER_FOLDERS},
            tokenizers={spec: parts[tok] for spec, _, tok in ENCODER_FOLDERS},
            scheduler=parts["scheduler"],
            name=cfg.name or parts["name"],
            fingerprint=parts["fingerprint"],
            extras=extras,
        )
        for module in (comps.denoiser, comps.vae, *comps.text_encoders.values()):
            module.requires_grad_(False)
            module.eval()
        return comps

    def load_text_encoders(self, cfg: "ModelConfig", policy: "PrecisionPolicy"
                           ) -> dict[str, torch.nn.Module]:
        """CLIP-L, CLIP-G and T5 alone, frozen, placed as `load` places them (a reload)."""
        if cfg.flavor == "tiny":
            from difftune.families.tiny_sd import build_tiny_sd3

            parts = build_tiny_sd3()
        elif cfg.transformer is not None:
            from difftune.families.sd_files import load_sd3_file

            parts = load_sd3_file(cfg, {"text_encoders": policy.text_encoders}, text_only=True)
        else:
            from transformers import CLIPTextModelWithProjection, T5EncoderModel

            from difftune.families.folders import from_folder

            assert cfg.path is not None  # ModelConfig guarantees a source
            parts = {te: from_folder(T5EncoderModel if name == "t5" else
                                     CLIPTextModelWithProjection, Path(cfg.path), te,
                                     policy.text_encoders, "SD3")
                     for name, te, _ in ENCODER_FOLDERS}
        return frozen_encoders({name: parts[te] for name, te, _ in ENCODER_FOLDERS}, policy)

    def encode_text(self, c: Components, texts: list[str],
                    options: "text.EncodeOptions | None" = None) -> TextEmbeds:
        """Encode with every text encoder (no grad) and combine, for sampling."""
        return self.combine_text(c, text.encode_all(self.text_encoders, c, texts, options))

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

    @torch.no_grad()
    def encode_images(self, c: Components, pixels: torch.Tensor) -> torch.Tensor:
        """Pixels in [-1, 1] -> latents normalized with the VAE's shift and scaling factors."""
        vae = c.vae
        device = text.module_device(vae)
        # The mode (mean) rather than a sample: deterministic, so latents can be cached.
        z = vae.encode(pixels.to(device, vae.dtype)).latent_dist.mode()
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

    def lora_targets(self, preset: str) -> list[str]:
        """Full-match regexes of module names for a preset."""
        return list(PRESETS[preset])

    def pipeline(self, c: Components) -> "DiffusionPipeline":
        """A StableDiffusion3Pipeline over the loaded components."""
        from diffusers import StableDiffusion3Pipeline

        pipe = StableDiffusion3Pipeline(
            scheduler=c.scheduler,
            vae=c.vae,
            text_encoder=c.text_encoders["clip_l"],
            tokenizer=c.tokenizers["clip_l"],
            text_encoder_2=c.text_encoders["clip_g"],
            tokenizer_2=c.tokenizers["clip_g"],
            text_encoder_3=c.text_encoders["t5"],
            tokenizer_3=c.tokenizers["t5"],
            transformer=c.denoiser,
        )
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def pipeline_inputs(self, embeds: TextEmbeds, negative: TextEmbeds | None,
                        guidance: float, cfg: float) -> dict[str, Any]:
        """StableDiffusion3Pipeline arguments: precomputed (negative) embeddings and CFG scale.

        SD3 is not guidance-distilled, so `guidance` has no input; CFG is the pipeline's
        `guidance_scale` (on when > 1).
        """
        kwargs: dict[str, Any] = {
            "prompt_embeds": embeds.tensors["prompt_embeds"],
            "pooled_prompt_embeds": embeds.tensors["pooled_prompt_embeds"],
            "guidance_scale": cfg,
        }
        if negative is not None and cfg > 1.0:
            kwargs["negative_prompt_embeds"] = negative.tensors["prompt_embeds"]
            kwargs["negative_pooled_prompt_embeds"] = negative.tensors["pooled_prompt_embeds"]
        return kwargs

    def model_spec(self, c: Components) -> ModelSpec:
        """SD3 medium, SD3.5 medium or large (told apart by the transformer's config)."""
        from difftune.families import sd3_keys as keys

        config = c.denoiser.config
        kind = keys.variant(config.qk_norm, tuple(config.dual_attention_layers or ()))
        return ModelSpec(keys.VARIANTS[kind], keys.IMPLEMENTATION, kind, keys.NETWORK_MODULE)

    def lora_from_format(self, c: Components, tensors: dict[str, torch.Tensor]
                         ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """A LoRA file's tensors in diffusers names, and per-module alphas (kohya files)."""
        if not any(k.startswith("lora_unet_") for k in tensors):
            return dict(tensors), {}
        from difftune.families.sd3_keys import kohya_to_diffusers

        return kohya_to_diffusers(tensors, c.denoiser.config.num_layers, self.denoiser_prefix)

    def lora_to_format(
        self, c: Components, state: dict[str, torch.Tensor], fmt: str, rank: int, alpha: float
    ) -> dict[str, torch.Tensor]:
        """diffusers-named LoRA -> the requested key layout ("diffusers" or "kohya")."""
        if fmt == "diffusers":
            return dict(state)
        from difftune.families.sd3_keys import diffusers_to_kohya

        return diffusers_to_kohya(state, alpha=alpha, rank=rank,
                                  num_layers=c.denoiser.config.num_layers)
