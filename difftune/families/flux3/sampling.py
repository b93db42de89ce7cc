"""Sampling FLUX.3 through diffusers' modular pipeline, called as a diffusers pipeline is.

Flux3ModularPipeline (Flux3DistilledModularPipeline for the step-distilled model) is built
twice over the same components from its own AutoBlocks, both without the prompt upsampler (a
Qwen3.5-9B fine-tune that rewrites prompts; removed, as diffusers documents, to encode prompts
as given): one encodes `prompt` strings itself, the other also lacks the text encoder step and
takes the embeddings difftune encodes as that step does (the step takes one `prompt` string
and always runs, so embeddings cannot be passed to the whole AutoBlocks). Both take a
reference `image` (edit sampling). What runs is diffusers' code unchanged. Classifier-free
guidance is the pipeline's guider component (ClassifierFreeGuidance), set per call.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from difftune.families.common.modular import quiet

# AutoBlocks steps left out of both pipelines, and of the one that takes embeddings.
NEVER = ("prompt_upsampler",)
WITH_EMBEDDINGS = ("text_encoder",)


def processor(tokenizer: Any) -> Any:
    """A Qwen3-VL processor over `tokenizer` (the text encoder step's `tokenizer` component is
    the processor: it renders the chat template, then tokenizes with `.tokenizer`)."""
    from transformers import Qwen2VLImageProcessorPil, Qwen3VLProcessor

    from difftune.families.common.vl_processor import without_video

    # the PIL image processor: text never reads images, and the default one wants torchvision
    return without_video(Qwen3VLProcessor, Qwen2VLImageProcessorPil(), tokenizer,
                         tokenizer.chat_template)


def modular_pipeline(parts: dict[str, Any], distilled: bool, without: tuple[str, ...]) -> Any:
    """The FLUX.3 modular pipeline (the distilled one for a flow-map transformer) over
    `parts`, less the AutoBlocks steps `without`."""
    import diffusers

    blocks = (diffusers.Flux3DistilledAutoBlocks() if distilled
              else diffusers.Flux3AutoBlocks())
    for name in without:
        blocks.sub_blocks.pop(name)
    pipe = blocks.init_pipeline()
    pipe.update_components(**{k: v for k, v in parts.items()
                              if k in pipe.pretrained_component_names or k == "scheduler"})
    quiet(blocks)
    return pipe


class ModularSampler:
    """FLUX.3's modular pipelines called like a diffusers pipeline: keyword arguments in (a
    `prompt` string or `prompt_embeds`), a result with `.images` out; anything else (LoRA
    loading, adapters, components, save_pretrained) is the whole modular pipeline's own."""

    def __init__(self, parts: dict[str, Any], distilled: bool) -> None:
        """Both pipelines over `parts` (transformer, vae, scheduler, text_encoder, tokenizer);
        `distilled`: the flow-map model's pipelines, which have no guider."""
        parts = {**parts, "tokenizer": processor(parts["tokenizer"])}
        self.__dict__.update(
            pipe=modular_pipeline(parts, distilled, NEVER),
            embedded=modular_pipeline(parts, distilled, NEVER + WITH_EMBEDDINGS),
            distilled=distilled)

    def __getattr__(self, name: str) -> Any:
        """The whole modular pipeline's attribute (its components, LoRA methods)."""
        return getattr(self.__dict__["pipe"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        """Set a component (such as the scheduler) on both pipelines."""
        setattr(self.__dict__["pipe"], name, value)
        setattr(self.__dict__["embedded"], name, value)

    def set_progress_bar_config(self, **kwargs: Any) -> None:
        """Progress bars stay off (`quiet`)."""

    @torch.no_grad()
    def __call__(self, *, prompt_embeds: torch.Tensor | None = None,
                 negative_prompt_embeds: torch.Tensor | None = None,
                 guidance_scale: float | None = None, **kwargs: Any) -> SimpleNamespace:
        """Sample from `prompt_embeds` (real CFG at `guidance_scale` with the negative
        embeddings when given) or from `kwargs`' `prompt` (the text encoder step encodes it,
        and the negative prompt, "" by default, under CFG); `guidance_scale` None keeps the
        pipeline's default guider (CFG 3.5). The distilled model has no guider. `kwargs` are
        the modular pipeline's inputs (height, width, num_inference_steps, generator,
        output_type, ...)."""
        from diffusers import ClassifierFreeGuidance

        pipe = self.pipe if prompt_embeds is None else self.embedded
        inputs = dict(kwargs)
        if prompt_embeds is not None:
            inputs["prompt_embeds"] = prompt_embeds
        if not self.distilled and guidance_scale is not None:
            cfg = guidance_scale > 1.0 and (prompt_embeds is None
                                            or negative_prompt_embeds is not None)
            pipe.update_components(guider=ClassifierFreeGuidance(guidance_scale=guidance_scale,
                                                                 enabled=cfg))
            if cfg and negative_prompt_embeds is not None:
                inputs["negative_prompt_embeds"] = negative_prompt_embeds
        return SimpleNamespace(images=pipe(**inputs, output="images"))
