"""Anima's sampling pipeline: diffusers' AnimaModularPipeline, from prompts or from embeddings.

AnimaModularPipeline's default blocks (AnimaAutoBlocks) start from the prompt: its Qwen3 and
T5 tokenization (AnimaTextEncoderStep) and the LLM adapter (AnimaTextConditioningStep).
difftune encodes and conditions text itself (cached, `AnimaFamily.combine_text`), so a call
with `prompt_embeds` runs the blocks after those, as AnimaCoreDenoiseStep and AnimaDecodeStep
order them (the embeddings expanded to the batch, latents prepared, the timesteps set, the
guided denoising loop, the VAE decode), over the same component objects; a call with `prompt`
runs the whole released pipeline. The CFG scale is the guider's (a component, not a call
input), so it is set per call here.
"""

from __future__ import annotations

from typing import Any

from diffusers.guiders import ClassifierFreeGuidance
from diffusers.modular_pipelines import AnimaAutoBlocks, SequentialPipelineBlocks
from diffusers.modular_pipelines import AnimaModularPipeline as ReleasedPipeline
from diffusers.modular_pipelines.anima.before_denoise import (AnimaPrepareLatentsStep,
                                                              AnimaSetTimestepsStep,
                                                              AnimaTextInputStep)
from diffusers.modular_pipelines.anima.denoise import AnimaDenoiseStep
from diffusers.modular_pipelines.anima.modular_blocks_anima import AnimaDecodeStep

from difftune.families.common.modular import quiet

# The components the post-text blocks read.
_DENOISING = ("transformer", "vae", "scheduler")


def _post_text_blocks() -> SequentialPipelineBlocks:
    """AnimaAutoBlocks' text-to-image blocks after its two text steps."""
    return SequentialPipelineBlocks.from_blocks_dict({
        "input": AnimaTextInputStep(), "prepare_latents": AnimaPrepareLatentsStep(),
        "set_timesteps": AnimaSetTimestepsStep(), "denoise": AnimaDenoiseStep(),
        "decode": AnimaDecodeStep()})


class AnimaModularPipeline(ReleasedPipeline):
    """diffusers' AnimaModularPipeline over AnimaAutoBlocks that also samples from
    precomputed `prompt_embeds` (see the module docstring); LoRA loading is its own
    (AnimaLoraLoaderMixin: into the transformer and the text conditioner). It keeps the
    released class's name, which `save_pretrained` records in modular_model_index.json, so a
    saved folder loads with diffusers' own class."""

    def __call__(self, *args: Any, guidance_scale: float = 4.0, **kwargs: Any) -> Any:
        """Run with classifier-free guidance at `guidance_scale` (1: none, no negative
        embeddings read): the post-text blocks when `prompt_embeds` are given, else all."""
        guider = ClassifierFreeGuidance(guidance_scale=guidance_scale)
        if "prompt_embeds" not in kwargs:
            self.update_components(guider=guider)
            return super().__call__(*args, **kwargs)
        blocks = _post_text_blocks()
        quiet(blocks)
        post = ReleasedPipeline(blocks=blocks)
        post.update_components(guider=guider, **{n: getattr(self, n) for n in _DENOISING})
        return post(*args, **kwargs)


def sampling_pipeline(parts: dict[str, Any]) -> AnimaModularPipeline:
    """The pipeline over the loaded components (by AnimaModularPipeline's names)."""
    blocks = AnimaAutoBlocks()
    quiet(blocks)  # (the pipeline's `blocks` is a copy: its own are quieted here)
    pipe = AnimaModularPipeline(blocks=blocks)
    pipe.update_components(**parts)
    return pipe
