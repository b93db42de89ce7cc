"""FLUX.1's light facts (no torch): text encoders, objective, refusals, defaults.

Read by config validation before anything heavy is imported, and by `FluxFamily`. Two variants:
"base" (FluxPipeline: dev and schnell, told apart by the loaded transformer's guidance
embedding) and "kontext" (FLUX.1 Kontext: the same transformer class and text encoders, trained
on edit pairs, sampled by FluxKontextPipeline with one input image).
"""

from __future__ import annotations

from dataclasses import replace

from difftune.families.specs import (T5_KEEP_HIGH, VAE_KEEP_HIGH, FamilySpec, ModelFiles,
                                     ModelSize, TextEncoderSpec)

# The base variant keeps `variant` None so its tiny flavor's fingerprint, and with it every
# cache key written before variants existed, stays as it was.
BASE = FamilySpec(
    name="flux",
    text_encoders=(
        TextEncoderSpec("clip_l", "clip", max_length=77, hidden="none", pooled=True),
        TextEncoderSpec("t5", "t5", max_length=512, hidden="last", pooled=False),
    ),
    objective="flow",
    kohya_text_encoders_refused="difftune's FLUX.1 kohya key table covers the transformer only",
    # VAE downscale 8 x 2x2 packing: bucket sides must be multiples of 16.
    bucket_step=16,
    denoiser_prefix="transformer",
    default_cfg=1.0,  # guidance-distilled: true CFG off unless a prompt asks for it
    # diffusers keys: read by diffusers and ComfyUI alike (alpha folded into the up factors).
    default_format="diffusers",
    text_encoder_prefixes={"clip_l": "text_encoder", "t5": "text_encoder_2"},
    # Kept out of fp8 storage and quantization (regexes on module names, per part): the
    # timestep/guidance/text embedders and the input and output projections.
    keep_high={
        "denoiser": (r"^time_text_embed\.", r"^x_embedder$", r"^context_embedder$",
                     r"^norm_out\.", r"^proj_out$"),
        "text_encoders": T5_KEEP_HIGH,
        "vae": VAE_KEEP_HIGH,
    },
    swap_blocks=("transformer_blocks", "single_transformer_blocks"),
    compile_blocks=("transformer_blocks", "single_transformer_blocks"),
    denoiser_part="transformer",
    encoder_parts=(("clip_l", "text_encoder", "tokenizer"),
                   ("t5", "text_encoder_2", "tokenizer_2")),
    pipeline_class="FluxPipeline",
    distilled_note=(
        "this is FLUX.1 schnell, timestep-distilled to sample in 1-4 steps without guidance: "
        "training a LoRA on it directly erodes the distillation (its few-step samples turn "
        "blurry and need more steps), so train on FLUX.1-dev or a de-distilled schnell and "
        "apply the LoRA to schnell, or keep runs short and check the samples at 4 steps"),
    sizes=(ModelSize("black-forest-labs/FLUX.1-dev", 11.90, 4.88, 57, 3072),),  # 19 + 38 blocks
    # The tokenizers come from model.path, else from the local Hugging Face cache.
    files=ModelFiles(
        folder="black-forest-labs/FLUX.1-dev (or FLUX.1-schnell)",
        singles=(("transformer", "flux1-dev.safetensors, BFL or diffusers layout"),
                 ("vae", "ae.safetensors"), ("clip_l", "clip_l.safetensors"),
                 ("t5", "t5xxl_fp16.safetensors")),
        markers=(("single_transformer_blocks.0.proj_mlp", "time_text_embed.text_embedder"),
                 ("double_blocks.0.img_attn.qkv", "vector_in.in_layer")),
        folder_holds=None,
        # the tokenizers of single-file text encoders, from the local Hugging Face cache
        tokenizer_repos=("openai/clip-vit-large-patch14", "google/t5-v1_1-xxl")),
)

# FLUX.1 Kontext: the conditioning image's packed latents follow the target's tokens
# (FluxKontextPipeline.prepare_latents), so each edit pair gives exactly one control image.
KONTEXT = replace(BASE, variant="kontext", pipeline_class="FluxKontextPipeline",
                  control_images=1, files=replace(
                      BASE.files, folder="black-forest-labs/FLUX.1-Kontext-dev",
                      singles=(("transformer", "flux1-kontext-dev.safetensors"),
                               *BASE.files.singles[1:])),
                  sizes=tuple(replace(z, name="black-forest-labs/FLUX.1-Kontext-dev")
                              for z in BASE.sizes))

SPEC = replace(BASE, variants=(("base", BASE), ("kontext", KONTEXT)))

# What other trainers call this family (trainer -> their name -> variant, None: difftune
# picks it), read by `difftune import` (importers/families.py).
OTHER_TRAINERS: dict[str, dict[str, str | None]] = {
    "kohya": {"networks.lora_flux": None, "networks.oft_flux": None, "flux": None},
    "ai-toolkit": {"flux": None, "flex1": None, "flux_kontext": "kontext", "is_flux": None},
    "onetrainer": {"FLUX_DEV_1": None},
}
