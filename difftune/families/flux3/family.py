"""FLUX.3: a flow-matching transformer with per-mode blocks (text, image, reference image) and
joint blocks, over FLUX.2's 2x2-patchified, batch-norm-normalized latents, conditioned on eight
inner hidden states of Qwen3-VL stacked per token.

Latents are FLUX.2's (`common.bn_vae`), flattened to tokens row-major with (t, h, w, l)
position ids whose h and w are scaled by 0.5 (Flux3PrepareLatentsStep's image RoPE scale); text
tokens get (0, 0, 0, index) ids. The transformer reads the flow time sigma in [0, 1] and
predicts the velocity (noise - x0); the step-distilled (flow-map) checkpoint also reads the
time it jumps to, which training sets to the time itself (a flow map's jump of length zero is
the velocity). Text: see `spec.py`; each prompt's window is its own (a batch of captions with
different windows is zero-padded to the longest, as the transformer takes no mask; a batch of
one, and sampling, match the reference exactly). Sampling runs diffusers' modular pipeline
(`sampling.py`). Edit pairs: one reference image a pair, kept whole on its canvas as the
pipeline keeps a single reference (`reference.py`).

What of diffusers 0.42.1's FLUX.3 pieces difftune does not use as they are, and why:
- the AutoBlocks' text encoder step takes one `prompt` string and always runs, so embeddings
  cannot be passed to the whole AutoBlocks: difftune removes it from the pipeline it passes
  its own embeddings to, encoded as the step encodes (tested equal);
- the AutoBlocks' first step, the prompt upsampler (a Qwen3.5-9B fine-tune that rewrites a
  prompt into the detailed caption FLUX.3 was trained on), is removed as diffusers documents
  for encoding a prompt as given: captions and sample prompts are used as written (so write
  detailed ones), and no 9B model is loaded;
- ModularPipeline.set_progress_bar_config reaches only the top-level blocks, not the denoise
  loop nested in the denoise step (`common.modular.quiet` walks them all);
- Flux3LoraLoaderMixin's converter for `diffusion_model.` files
  (_convert_non_diffusers_flux3_lora_to_diffusers) renames BFL's block modules only: BFL's
  modulation heads (`early_stream_modulations.image.lin`), embedders (`emb_in`, `txt_in`,
  `time_in`), `final_layer` stay unmapped and are dropped with an "unexpected keys" warning,
  so difftune writes the diffusers layout and reads those names itself (`keys.py`);
- convert_flux3_transformer_checkpoint_to_diffusers (from_single_file) keeps ComfyUI's
  `model.diffusion_model.` prefix (as FLUX.2's does), so such a file fails there: difftune
  strips it before converting (`single.py`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from difftune.families.base import Components, Conditioning, TextEmbeds
from difftune.families.common.bn_vae import normalized_latents, patchify, unpatchify
from difftune.families.common.diffusers_layout import DiffusersLayoutFamily
from difftune.families.common.family import Loaders
from difftune.families.flux3 import reference
from difftune.families.flux3.spec import SPEC
from difftune.train.objectives.flow import BASE_SEQ, MAX_SEQ, DynamicShift, FlowMatching

if TYPE_CHECKING:
    from diffusers import DiffusionPipeline

    from difftune.config import TrainConfig

IMAGE_ROPE_SCALE = 0.5  # Flux3PrepareLatentsStep(image_rope_scale=0.5)
_MODE = r"(?:txt_mode_blocks|mode_blocks\.(?:image|image_cond))\.\d+\."
_SINGLE = r"single_transformer_blocks\.\d+\."
_ATTENTION = [f"(?:{_MODE}|{_SINGLE})attn\\.(?:to_q|to_k|to_v|to_out\\.0)"]
_MLP = [f"(?:{_MODE}|{_SINGLE})ff\\.(?:linear_in|linear_out)"]
_MODULATION = [r"(?:early|single)_stream_modulations\.(?:image|image_cond|txt)\.linear"]
PRESETS: dict[str, list[str]] = {
    "attention": _ATTENTION,
    "attention_mlp": _ATTENTION + _MLP,
    "all_linear": _ATTENTION + _MLP + _MODULATION,
}


def image_ids(h: int, w: int, device: torch.device, layer: int = 0) -> torch.Tensor:
    """(h*w, 4) position ids (0, row/2, col/2, layer) of latent tokens, row-major (the
    pipeline's `_prepare_image_ids`: layer 0 the generated image, -1 the reference)."""
    ids = torch.cartesian_prod(torch.arange(1), torch.arange(h), torch.arange(w),
                               torch.tensor([layer])).float()
    ids[:, 1:3] *= IMAGE_ROPE_SCALE
    return ids.to(device)


def text_ids(length: int, device: torch.device) -> torch.Tensor:
    """(L, 4) position ids (0, 0, 0, index) of text tokens."""
    ids = torch.cartesian_prod(torch.arange(1), torch.arange(1), torch.arange(1),
                               torch.arange(length))
    return ids.float().to(device)


class Flux3Family(DiffusersLayoutFamily):
    """The FLUX.3 family (base and step-distilled, told apart on the loaded transformer)."""

    spec = SPEC
    presets = PRESETS
    loaders = Loaders("build_tiny_flux3", "load_flux3_files", "load_flux3_text_encoders")
    control_rule = reference.RULE

    def control_size(self, image_size: tuple[int, int], target_bucket: tuple[int, int],
                     resolution: int) -> tuple[int, int]:
        """A reference's canvas (`reference.control_size`): its own size under the area cap
        4 x resolution squared, rounded up to the token grid, whatever the target's bucket."""
        return reference.control_size(image_size, resolution)

    def control_pixels(self, path: Path, size: tuple[int, int], resolution: int
                       ) -> torch.Tensor:
        """The reference scaled and reflect-padded to its canvas as the pipeline's image
        processor does (`reference.load_pixels`)."""
        return reference.load_pixels(path, size, resolution)

    def control_key(self, resolution: int) -> str:
        """The rule and the resolution: the scaling depends on the area cap."""
        return f"{self.control_rule}/{resolution}"

    def pipeline_images(self, images: list[Any], width: int, height: int) -> dict[str, Any]:
        """The pipeline's `image`: the reference on its canvas (`reference.pipeline_images`)."""
        return reference.pipeline_images(images, width, height)

    def objective(self, c: Components, cfg: "TrainConfig") -> FlowMatching:
        """Rectified flow; `flux_shift` shifts t by the scheduler's constant shift (6.93) at
        every size, as the pipeline's scheduler does."""
        mu = math.log(float(c.scheduler.config.get("shift", 1.0)))
        return FlowMatching(cfg, DynamicShift(BASE_SEQ, MAX_SEQ, mu, mu))

    def combine_text(self, c: Components, outputs: dict[str, dict[str, torch.Tensor]]
                     ) -> TextEmbeds:
        """The stacked hidden states, every position of the window kept (the transformer
        gets no text mask)."""
        return TextEmbeds({"prompt_embeds": outputs["qwen3vl"]["hidden"]})

    def encode_images(self, c: Components, pixels: torch.Tensor) -> torch.Tensor:
        """Pixels in [-1, 1] -> FLUX.2's normalized latents (Flux3VaeEncoderStep's encoding),
        in the autoencoder's (C, H/8, W/8) layout (`bn_vae.normalized_latents`)."""
        return normalized_latents(c.vae, pixels)

    def predict(self, c: Components, noisy: torch.Tensor, embeds: TextEmbeds, t: torch.Tensor,
                cond: Conditioning) -> torch.Tensor:
        """Velocity (noise - x0) for noisy latents at t in [0, 1] (1 = pure noise), as
        Flux3LoopDenoiser calls the transformer (timestep / 1000 = sigma, in the latents'
        dtype); a flow map gets target_timestep = t."""
        model = c.denoiser
        dtype = noisy.dtype
        patches = patchify(noisy)
        b, ch, h, w = patches.shape
        prompt = embeds.tensors["prompt_embeds"].to(dtype)
        t = t.to(dtype).expand(b)
        extra = {"target_timestep": t} if model.config.flow_map else {}
        if cond.controls:  # the reference's tokens and ids (Flux3PrepareImageCondLatentsStep)
            refs = [patchify(r.to(noisy.device, dtype)) for r in cond.controls]
            extra["image_cond_hidden_states"] = torch.cat(
                [r.flatten(2).transpose(1, 2) for r in refs], dim=1)
            extra["image_cond_ids"] = torch.cat(
                [image_ids(*r.shape[2:], noisy.device, -(1 + i)) for i, r in enumerate(refs)])
        out = model(hidden_states=patches.flatten(2).transpose(1, 2),
                    encoder_hidden_states=prompt, timestep=t,
                    img_ids=image_ids(h, w, noisy.device),
                    txt_ids=text_ids(prompt.shape[1], noisy.device), return_dict=False,
                    **extra)[0]
        return unpatchify(out.transpose(1, 2).reshape(b, ch, h, w))

    def distilled(self, c: Components) -> bool:
        """The step-distilled checkpoint: a flow-map transformer (flow_map=True)."""
        return bool(c.denoiser.config.flow_map)

    def pipeline(self, c: Components) -> "DiffusionPipeline":
        """Flux3ModularPipeline (Flux3DistilledModularPipeline for the distilled model) over
        the components, called as a pipeline (`sampling.ModularSampler`)."""
        from difftune.families.flux3.sampling import ModularSampler

        parts = {"transformer": c.denoiser, "vae": c.vae, "scheduler": c.scheduler,
                 "text_encoder": c.text_encoders["qwen3vl"],
                 "tokenizer": c.tokenizers["qwen3vl"]}
        return ModularSampler(parts, self.distilled(c))  # type: ignore[return-value]

    def pipeline_inputs(self, embeds: TextEmbeds, negative: TextEmbeds | None,
                        guidance: float, cfg: float) -> dict[str, Any]:
        """The embeddings, and real CFG at `cfg` with the negative embeddings (the guider's
        guidance_scale; ignored by the distilled model)."""
        kwargs: dict[str, Any] = {"prompt_embeds": embeds.tensors["prompt_embeds"],
                                  "guidance_scale": cfg}
        if negative is not None and cfg > 1.0:
            kwargs["negative_prompt_embeds"] = negative.tensors["prompt_embeds"]
        return kwargs

    def lora_from_format(self, c: Components, tensors: dict[str, torch.Tensor]
                         ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """A LoRA file in diffusers names, and per-module alphas where the file has them (the
        spellings `keys.diffusers_names` reads, BFL's original names included)."""
        from difftune.families.flux3.keys import diffusers_names

        modules = (n for n, _ in c.denoiser.named_modules() if n)
        return diffusers_names(tensors, modules, self.denoiser_prefix)
