"""Qwen-Image 2.1's light facts (no torch): its Qwen3-VL text encoder, objective, refusals,
defaults.

Read by config validation before anything heavy is imported, and by `QwenImage21Family`.
Qwen-Image 2.1 is a new architecture, not a later training of Qwen-Image: a single-stream
block-causal transformer over one joint text/image sequence, a 64-channel RGBA autoencoder that
downscales 16x (one token per 16 x 16 pixels, no patching), and Qwen3-VL read before its final
norm. The base checkpoint (QwenImage21Pipeline / QwenImage21ModularPipeline) and the few-step
Turbo (QwenImage21TurboModularPipeline) share the architecture; Turbo's folder ships its
sampling grid as `sample_sigmas` in model_index.json, which is how diffusers' modular loader
tells them apart, and so does `QwenImage21Family.distilled`.

The "edit" variant trains the same checkpoint's image-conditioned mode (QwenImage21Pipeline's
`image`; no separate edit checkpoint is released): one reference image a pair, resized to the
dataset's resolution in area (sides multiples of 32, the pipeline's `calculate_dimensions`),
read by Qwen3-VL with the caption (its vision tokens before the caption in the user turn) and
encoded by the autoencoder; the reference's latent tokens replace the hidden states at the
encoder's `<|image_pad|>` slots in the transformer's sequence (`edit.py`).
"""

from __future__ import annotations

from dataclasses import replace

from difftune.families.specs import (VAE_KEEP_HIGH, FamilySpec, ModelFiles, ModelSize,
                                     TextEncoderSpec)

# QwenImage21Pipeline.prompt_template_t2i: the system turn, then the caption as the user turn.
SYSTEM = "Comprehend and analyze the provided prompt."
TEMPLATE = (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{{}}<|im_end|>\n"
            "<|im_start|>assistant\n")
# The pipeline's `_drop_idx`: the tokens of the system message alone in the processor's chat
# template ("<|im_start|>system\nComprehend and analyze the provided prompt.<|im_end|>\n"), 14
# with Qwen's tokenizer (Com|preh|end ...); the user turn's header is kept.
DROP = 14
# The pipeline does not truncate; this bounds a caption far beyond any real one (the
# transformer's RoPE tables hold 8192 positions).
MAX_TOKENS = 4096

BASE = FamilySpec(
    distilled_note=(
        "this is Qwen-Image 2.1 Turbo (model_index.json sample_sigmas), step-distilled to "
        "sample in a few steps without guidance: training a LoRA on it directly erodes the "
        "distillation (few-step samples degrade), so train on Qwen-Image 2.1, the base it was "
        "distilled from, and apply the LoRA to Turbo"),
    name="qwen_image_21",
    text_encoders=(
        # QwenImage21Pipeline._get_qwen_prompt_embeds: an empty caption read as " ", the
        # caption in the fixed template, padded on the left to the batch's longest, the last
        # decoder layer's output before the final RMSNorm (the loaders set Qwen3-VL's
        # `tie_last_hidden_states` off, so hidden_states[-1] is that output, as the
        # pipeline's norm hook gives it), each row's masked tokens, the first 14 dropped, the
        # rows right-padded with zeros and a mask: variable-length outputs.
        TextEncoderSpec("qwen3vl", "decoder", max_length=MAX_TOKENS, hidden="last",
                        pooled=False, mask=True, trim=True, template=TEMPLATE, drop=DROP,
                        layers=(-1,), pad="longest", side="left", empty=" "),
    ),
    objective="flow",
    kohya_text_encoders_refused="difftune trains Qwen-Image 2.1's transformer only",
    # diffusers' loader reads the diffusers layout completely (the default); "original" is the
    # checkpoint's names under `diffusion_model.` (keys.to_original); no kohya layout.
    formats=("diffusers", "original"),
    # VAE downscale 16, and the transformer's image slots stand for 2 x 2 latent tokens, so the
    # latent sides must be even: bucket sides are multiples of 32 (the pipeline's rule).
    bucket_step=32,
    denoiser_prefix="transformer",
    default_cfg=1.0,  # QwenImage21Pipeline's true_cfg_scale default: sampled without guidance
    # diffusers' QwenImageLoraLoaderMixin (which QwenImage21Pipeline uses) reads
    # `transformer.<module>.lora_A/B` under QwenImage21Transformer2DModel's module names. The
    # ComfyUI snapshot read (silveroxides/ComfyUI 4f874c5e) has no Qwen-Image 2.1 model: its
    # model_detection keys Qwen-Image on `txt_norm.weight`, which 2.1 lacks, so no key map of
    # its applies. For Qwen-Image, comfy/lora.py reads the model's own (diffusers) module names
    # bare, under `transformer.` and as `lycoris_<module_with_underscores>` (the diffusers
    # layout is that form for 2.1's modules), and for every model its generic map reads
    # `diffusion_model.<checkpoint name>`: save.format = "original" writes that form over 2.1's
    # original checkpoint names (the fused `img_mlp.gate_up`).
    default_format="diffusers",
    text_encoder_prefixes={"qwen3vl": "text_encoder"},
    # Kept out of fp8 storage and quantization: the timestep embedder, the text projection
    # (its zero-centred norm), the shared modulation, the input/output projections and the
    # final norm (diffusers skips pos_embed and norms in layerwise casting).
    keep_high={
        "denoiser": (r"^time_text_embed\.", r"^txt_in\.", r"^img_in$", r"^modulation\.",
                     r"^norm_out\.", r"^proj_out$"),
        "text_encoders": (r"embed_tokens", r"norm$", r"^model\.visual\.", r"lm_head"),
        "vae": VAE_KEEP_HIGH,
    },
    swap_blocks=("transformer_blocks",),
    compile_blocks=("transformer_blocks",),
    denoiser_part="transformer",
    encoder_parts=(("qwen3vl", "text_encoder", "tokenizer"),),
    pipeline_class="QwenImage21Pipeline",
    # The released transformer's config (QwenImage21Transformer2DModel's defaults: 32 blocks,
    # 32 heads of 128) and Qwen3-VL-8B; counted on the meta device by the family's tests.
    sizes=(ModelSize("Qwen/Qwen-Image-2.1", 7.12, 8.77, 32, 4096),),
    files=ModelFiles(
        folder="Qwen/Qwen-Image-2.1",
        singles=(("transformer", "the original-layout Qwen-Image 2.1 transformer"),),
        folder_holds="processor/ (Qwen3-VL's tokenizer), vae/ and text_encoder/ (no single "
                     "file of theirs is defined)",
        markers=(("txt_in.text_norm", "modulation.1", "transformer_blocks.0.img_mlp"),)),
    text_encoder_lora_refused=(("qwen3vl", "QwenImage21Pipeline.load_lora_weights reads "
                                           "transformer LoRAs only; train the transformer "
                                           "only"),),
    embeddings_refused=("Qwen-Image 2.1's Qwen3-VL encoder reads captions through a fixed "
                        "prompt template whose first 14 tokens are dropped; textual inversion "
                        "is not supported for it"),
)

# QwenImage21Pipeline.prompt_template_ti2i: a condition image's vision tokens open the user turn,
# before the caption (the processor expands `<|image_pad|>` to the image's 32 x 32 patches).
IMAGE_PROMPT = "<image{}><|vision_start|><|image_pad|><|vision_end|>"
# The edit mode of the same checkpoint: Qwen3-VL reads each pair's reference with its caption
# (the processor, which holds the tokenizer, as the encoder's tokenizer); one reference a pair
# (the pipeline joins several with a space between their prompts, which is not trained yet).
EDIT = replace(BASE, variant="edit", control_images=1,
               text_encoders=(replace(BASE.text_encoders[0], image_prompt=IMAGE_PROMPT,
                                      token_types=True),),
               encoder_parts=(("qwen3vl", "text_encoder", "processor"),))
SPEC = replace(BASE, variants=(("base", BASE), ("edit", EDIT)))
