"""Wan (2.1 T2V 1.3B/14B, 2.2 A14B: its low-noise expert, or both experts, T2V or I2V): a
flow-matching video DiT trained on clips and on still images as one-frame clips.

Latents come from AutoencoderKLWan (a frame axis, and per-channel `latents_mean`/`latents_std`
normalization, as WanPipeline decodes them; `families.common.frame_vae`); an image is a clip of
one frame, so the transformer reads (B, 16, 1, h, w) and the frame axis is dropped again from
its output. It reads the time as the scheduler's timestep (sigma x 1000), the UMT5 embeddings
of each caption zero-padded to 512 positions with no mask (what WanPipeline's encode_prompt
gives it), and predicts the velocity (noise - x0) its UniPC scheduler steps with
(flow_prediction). Text embeddings travel as each caption's own tokens with a mask
(`families.base.pad_cat`) and are padded back to 512 here. Wan 2.2 I2V A14B's experts also
read a start-frame condition (`encode_start`: WanImageToVideoPipeline's prepare_latents on the
sample's first frame, an image on itself) after the noisy channels, and sample from a prompt's
start image.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from difftune.families.base import Components, Conditioning, ModelSpec, TextEmbeds
from difftune.families.common import frame_vae
from difftune.families.common.family import FamilyBase, Loaders
from difftune.families.wan.spec import I2V_MODULES, SPEC

if TYPE_CHECKING:
    from diffusers import DiffusionPipeline

_BLOCK = r"blocks\.\d+\."
# (Wan 2.1 I2V's image cross-attention, `k_img`/`v_img`, is in attn2 too: none in the others)
_ATTENTION = [_BLOCK + r"(?:attn1|attn2)\.(?:to_q|to_k|to_v|to_out\.0)",
              _BLOCK + r"attn2\.(?:add_k_proj|add_v_proj)"]
_MLP = [_BLOCK + r"ffn\.net\.(?:0\.proj|2)"]
# The shared time projection: every block's modulation comes from it (as FLUX.2's shared
# modulation layers, it belongs with "all_linear").
_MODULATION = [r"condition_embedder\.time_proj"]
PRESETS: dict[str, list[str]] = {
    "attention": _ATTENTION,
    "attention_mlp": _ATTENTION + _MLP,
    "all_linear": _ATTENTION + _MLP + _MODULATION,
}


def padded_prompt(embeds: TextEmbeds, length: int) -> torch.Tensor:
    """The (B, `length`, D) prompt embeddings WanPipeline gives its transformer: each
    caption's own tokens, zeros after them (masked positions zeroed, then padded)."""
    hidden, mask = embeds.tensors["prompt_embeds"], embeds.tensors["prompt_embeds_mask"]
    hidden = hidden * mask.unsqueeze(-1).to(hidden.dtype)
    pad = hidden.new_zeros(hidden.shape[0], length - hidden.shape[1], hidden.shape[2])
    return torch.cat([hidden, pad], dim=1)


class WanFamily(FamilyBase):
    """The Wan family (its variant's spec on the object, see `FamilyBase.__init__`)."""

    spec = SPEC
    presets = PRESETS
    loaders = Loaders("build_tiny_wan", "load_wan_files", "load_wan_text_encoders")

    @property
    def _length(self) -> int:
        """The positions every caption is padded to (WanPipeline's max_sequence_length)."""
        return self.spec.text_encoders[0].max_length

    def combine_text(self, c: Components, outputs: dict[str, dict[str, torch.Tensor]]
                     ) -> TextEmbeds:
        """UMT5's last hidden states of each caption's own tokens, and their mask."""
        umt5 = outputs["umt5"]
        return TextEmbeds({"prompt_embeds": umt5["hidden"], "prompt_embeds_mask": umt5["mask"]})

    @torch.no_grad()
    def encode_images(self, c: Components, pixels: torch.Tensor) -> torch.Tensor:
        """Pixels in [-1, 1] -> normalized (B, 16, h, w) latents: a one-frame clip through the
        VAE, its frame axis dropped."""
        return frame_vae.encode(c.vae, pixels)

    @torch.no_grad()
    def encode_clips(self, c: Components, pixels: torch.Tensor) -> torch.Tensor:
        """Clips (B, 3, F, H, W) in [-1, 1] -> normalized (B, 16, (F - 1) / 4 + 1, h, w)."""
        return frame_vae.encode_clip(c.vae, pixels)

    def predict(self, c: Components, noisy: torch.Tensor, embeds: TextEmbeds, t: torch.Tensor,
                cond: Conditioning) -> torch.Tensor:
        """Velocity (noise - x0) for noisy latents at t in [0, 1] (1 = pure noise), as
        WanPipeline calls the transformer: an image as one frame, timestep = sigma x 1000 (in
        float32, as the time embedding computes it), the prompt padded to 512 positions; an
        image-to-video model reads its start-frame condition (`cond.start`) concatenated on
        the channel axis, as WanImageToVideoPipeline does, and predicts the noisy channels."""
        dtype, image = noisy.dtype, noisy.dim() == 4  # a clip is (B, C, f, h, w) already
        hidden = noisy.unsqueeze(2) if image else noisy
        extra = {}
        if cond.start is not None:  # image-to-video: the condition after the noisy channels
            hidden = torch.cat([hidden, cond.start.to(hidden.dtype)], dim=1)
        if cond.start_image is not None:  # Wan 2.1 I2V: the start image's CLIP features
            extra["encoder_hidden_states_image"] = cond.start_image.to(dtype)
        out = c.denoiser(hidden_states=hidden, timestep=(t.float() * 1000), **extra,
                         encoder_hidden_states=padded_prompt(embeds, self._length).to(dtype),
                         return_dict=False)[0]
        return out.squeeze(2) if image else out

    def encode_start(self, c: Components, pixels: torch.Tensor) -> dict[str, torch.Tensor]:
        """What an image-to-video model reads of a sample's first frame, made by
        WanImageToVideoPipeline's own code (`wan.start`)."""
        from difftune.families.wan import start

        return start.encode(c, pixels)

    def components(self, parts: dict[str, Any], cfg: Any, policy: Any) -> Components:
        """The loaded parts placed and frozen; Wan 2.1 I2V's CLIP vision encoder (and its
        processor) beside them in `extras`, placed as the text encoders are."""
        from difftune.families.common.family import freeze, place
        from difftune.families.wan.start import IMAGE_PARTS

        comps = super().components(parts, cfg, policy)
        if parts.get("image_encoder") is not None:
            encoder = place(parts["image_encoder"], policy.device, policy.text_encoders)
            freeze(encoder)
            comps.extras.update(zip(IMAGE_PARTS, (encoder, parts["image_processor"])))
        return comps

    def pipeline(self, c: Components) -> "DiffusionPipeline":
        """WanPipeline over the components; the 2.2 low-noise expert as its `transformer_2`,
        `transformer` None, with boundary_ratio 1.0 so that every step is the expert's."""
        pipe = super().pipeline(c)
        if self.spec.denoiser_part == "transformer_2":
            pipe.register_to_config(boundary_ratio=1.0)
        if c.extras.get("image_encoder") is not None:  # Wan 2.1 I2V: it encodes the start image
            from difftune.families.wan.start import IMAGE_PARTS

            pipe.register_modules(**{p: c.extras[p] for p in IMAGE_PARTS})
        return pipe

    def load_pipeline_lora(self, pipe: Any, source: Any, name: str,
                           part: str | None = None) -> None:
        """diffusers' loader: into `transformer_2` for the 2.2 low-noise expert, what
        `load_lora_weights(..., load_into_transformer_2=True)` does, less its first step (it
        widens a T2V LoRA for an I2V `transformer`, and reads that transformer's config, which
        is None there); of both A14B experts, into the `part` the file is for, as users load
        the pair (`load_into_transformer_2` for the low-noise file)."""
        if self.spec.experts:
            pipe.load_lora_weights(source, adapter_name=name,
                                   load_into_transformer_2=part == "transformer_2")
            return
        if self.spec.denoiser_part != "transformer_2":
            super().load_pipeline_lora(pipe, source, name)
            return
        state, metadata = pipe.lora_state_dict(source, return_lora_metadata=True)
        pipe.load_lora_into_transformer(state, transformer=pipe.transformer_2, adapter_name=name,
                                        metadata=metadata, _pipeline=pipe)

    def pipeline_inputs(self, embeds: TextEmbeds, negative: TextEmbeds | None,
                        guidance: float, cfg: float) -> dict[str, Any]:
        """WanPipeline arguments: one frame, the padded embeddings, and CFG at `cfg` with the
        negative ones (the pipeline runs CFG when guidance_scale > 1)."""
        kwargs: dict[str, Any] = {"prompt_embeds": padded_prompt(embeds, self._length),
                                  "num_frames": 1, "guidance_scale": 1.0}
        if negative is not None and cfg > 1.0:
            kwargs.update(negative_prompt_embeds=padded_prompt(negative, self._length),
                          guidance_scale=cfg)
        return kwargs

    def pipeline_images(self, images: list[Any], width: int, height: int) -> dict[str, Any]:
        """An image-to-video sample's start image (the prompt's one input image), which
        WanImageToVideoPipeline resizes to the sample's size itself; none for T2V."""
        return {"image": images[0]} if self.spec.start_image and images else {}

    def pipeline_image(self, result: Any) -> np.ndarray:
        """The first frame of the first video (WanPipeline returns `frames`)."""
        return np.asarray(result.frames[0][0])

    def clip_inputs(self, frames: int) -> dict[str, Any]:
        """WanPipeline's frame count (a 4N+1 count: the runner rounds to `frame_rule`)."""
        return {"num_frames": frames}

    def pipeline_clip(self, result: Any) -> np.ndarray:
        """Every frame of the first video, (F, H, W, 3) in [0, 1]."""
        return np.asarray(result.frames[0])

    def model_spec(self, c: Components) -> ModelSpec:
        """Wan 2.1 (1.3B or 14B) or Wan 2.2's low-noise expert, as model sites name them."""
        from difftune.families.wan import keys

        variant = str(self.spec.variant)
        return ModelSpec(keys.ARCHITECTURE[variant], keys.IMPLEMENTATION[variant],
                         keys.BASE_VERSION[variant], keys.NETWORK_MODULE)

    def lora_refusal(self, c: Components, tensors: dict[str, torch.Tensor],
                     metadata: dict[str, str] | None = None) -> str | None:
        """A LoRA for the other task than the loaded model's: a Wan 2.1 image-to-video one
        (its cross-attention image projections, `k_img` / `v_img`, `add_k_proj` /
        `add_v_proj` in diffusers' names) on a model without them, whose readers would drop
        them ("lora key not loaded") and apply the rest to a model it was not trained with;
        or a file whose header names a Wan model of the other task (`modelspec.architecture`,
        as difftune and kohya-style trainers write it): a text-to-video LoRA on an
        image-to-video model or the reverse, whose module names alone do not tell."""
        model = "image-to-video" if self.spec.start_image else "text-to-video"
        found = sorted({m[0] for k in tensors if (m := I2V_MODULES.search(k))})
        if found and c.denoiser.config.image_dim is None:
            return (f"this is a Wan 2.1 image-to-video LoRA (it adapts {', '.join(found)}, the "
                    "image cross-attention projections of Wan 2.1 I2V), and this model "
                    f"({self.spec.variant}, {model}) has no such layers: the rest of the file "
                    "was trained with them. Use a LoRA trained on this model's kind")
        architecture = (metadata or {}).get("modelspec.architecture", "")
        task = next((t for t in ("t2v", "i2v") if f"-{t}-" in architecture), None)
        if task is None or (task == "i2v") == (model == "image-to-video"):
            return None
        theirs = "image-to-video" if task == "i2v" else "text-to-video"
        return (f"this LoRA was trained on {architecture.split('/')[0]} (its "
                f"modelspec.architecture), a {theirs} model, and this model "
                f"({self.spec.variant}) is {model}: the same module names, but the "
                f"{'start frame' if task == 'i2v' else 'noise alone'} it learned to "
                f"continue from is not what this model reads. Use a LoRA trained on a {model} "
                "Wan model")

    def lora_from_format(self, c: Components, tensors: dict[str, torch.Tensor]
                         ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """A LoRA file in diffusers names and per-module alphas where the file has them: see
        `wan.keys.diffusers_names` for the layouts read."""
        from difftune.families.wan.keys import diffusers_names

        modules = (n for n, _ in c.denoiser.named_modules() if n)
        return diffusers_names(tensors, modules, self.denoiser_prefix)

    def to_original(self, c: Components, state: dict[str, torch.Tensor], rank: int,
                    alpha: float) -> dict[str, torch.Tensor]:
        """diffusers-named LoRA -> `diffusion_model.<Wan module>` keys: the default layout."""
        from difftune.families.wan.keys import to_original

        return to_original(state, rank=rank, alpha=alpha, prefix=self.denoiser_prefix)

