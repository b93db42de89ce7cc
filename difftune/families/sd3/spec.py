"""SD3 / SD3.5's light facts (no torch): text encoders, objective, refusals, defaults.

Read by config validation before anything heavy is imported, and by `SD3Family`.
"""

from __future__ import annotations

from difftune.families.specs import (T5_KEEP_HIGH, VAE_KEEP_HIGH, FamilySpec, ModelFiles,
                                     ModelSize, TextEncoderSpec)

SPEC = FamilySpec(
    name="sd3",
    text_encoders=(
        TextEncoderSpec("clip_l", "clip_projection", max_length=77, hidden="penultimate",
                        pooled=True),
        TextEncoderSpec("clip_g", "clip_projection", max_length=77, hidden="penultimate",
                        pooled=True),
        TextEncoderSpec("t5", "t5", max_length=256, hidden="last", pooled=False),
    ),
    objective="flow",
    kohya_text_encoders_refused=("there is no kohya key layout for SD3 text encoders that "
                                 "diffusers reads back"),
    # VAE downscale 8 x patch size 2: bucket sides must be multiples of 16.
    bucket_step=16,
    denoiser_prefix="transformer",
    default_cfg=5.0,
    # diffusers keys: read by diffusers and ComfyUI alike (diffusers reads no SD3 kohya file).
    default_format="diffusers",
    text_encoder_prefixes={"clip_l": "text_encoder", "clip_g": "text_encoder_2",
                           "t5": "text_encoder_3"},
    # Kept out of fp8 storage and quantization (regexes on module names, per part).
    keep_high={
        "denoiser": (r"^time_text_embed\.", r"^pos_embed\.", r"^context_embedder$",
                     r"^norm_out\.", r"^proj_out$"),
        "text_encoders": T5_KEEP_HIGH,
        "vae": VAE_KEEP_HIGH,
    },
    swap_blocks=("transformer_blocks",),
    compile_blocks=("transformer_blocks",),
    denoiser_part="transformer",
    encoder_parts=(("clip_l", "text_encoder", "tokenizer"),
                   ("clip_g", "text_encoder_2", "tokenizer_2"),
                   ("t5", "text_encoder_3", "tokenizer_3")),
    pipeline_class="StableDiffusion3Pipeline",
    sizes=(ModelSize("stabilityai/stable-diffusion-3.5-medium", 2.47, 5.57, 24, 1536),),
    files=ModelFiles(
        markers=(("pos_embed.proj", "transformer_blocks.0.attn.add_k_proj",
                  "time_text_embed.text_embedder"), ("joint_blocks.0.x_block.attn.qkv",)),
        folder="stabilityai/stable-diffusion-3.5-medium",
        singles=(("transformer", "sd3.5_medium.safetensors, with or without its text encoders"),
                 ("vae", "an SD3 autoencoder, if the checkpoint has none"),
                 ("clip_l", "clip_l.safetensors"), ("t5", "t5xxl_fp16.safetensors")),
        folder_holds="tokenizer/, tokenizer_2/ and tokenizer_3/ (no single file holds them), "
                     "and text_encoder_2/ (CLIP-G) unless the checkpoint bundles it"),
)

# What other trainers call this family (trainer -> their name -> variant, None: difftune
# picks it), read by `difftune import` (importers/families.py).
OTHER_TRAINERS: dict[str, dict[str, str | None]] = {
    "kohya": {"networks.lora_sd3": None},
    "ai-toolkit": {"sd3": None, "is_v3": None},
    "onetrainer": {"STABLE_DIFFUSION_3": None, "STABLE_DIFFUSION_35": None},
}
