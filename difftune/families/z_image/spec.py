"""Z-Image's light facts (no torch): its Qwen3 text encoder, objective, refusals, defaults.

Read by config validation before anything heavy is imported, and by `ZImageFamily`. Turbo and
Base share the architecture, so one spec serves both; the loaded scheduler tells them apart.
"""

from __future__ import annotations

from difftune.families.specs import (VAE_KEEP_HIGH, FamilySpec, ModelFiles, ModelSize,
                                     TextEncoderSpec)

SPEC = FamilySpec(
    name="z_image",
    text_encoders=(
        # ZImagePipeline._encode_prompt: each caption as one user message in Qwen3's chat
        # template (generation prompt added, enable_thinking=True), padded to 512 tokens, the
        # penultimate hidden state under the attention mask, then only the masked tokens kept.
        TextEncoderSpec("qwen3", "decoder", max_length=512, hidden="penultimate", pooled=False,
                        mask=True, chat=(("enable_thinking", True),), trim=True),
    ),
    objective="flow",
    kohya_text_encoders_refused="difftune trains Z-Image's transformer only",
    # VAE downscale 8 x 2x2 patches: bucket sides must be multiples of 16.
    bucket_step=16,
    denoiser_prefix="transformer",
    default_cfg=1.0,  # Turbo is distilled to run without CFG; a prompt's --l turns it on
    distilled_note=(
        "this is Z-Image-Turbo (its scheduler's shift is 3; Base's is 6), step-distilled to "
        "sample in 8 steps without CFG: training a LoRA on it directly erodes the distillation "
        "(its 8-step samples turn blurry or noisy), so train on Z-Image (Base, "
        "Tongyi-MAI/Z-Image: the model Turbo was distilled from, same architecture) and apply "
        "the LoRA to Turbo at 8 steps, CFG 1"),
    # ComfyUI reads the diffusers names: its Lumina2/Z-Image LoRA key map (comfy/utils.py
    # z_image_to_diffusers, used by comfy/lora.py) maps `to_q`/`to_k`/`to_v` onto row slices of
    # its fused `attention.qkv` and `to_out.0` onto `attention.out`, the rest by name; diffusers'
    # ZImageLoraLoaderMixin reads the same file. So the diffusers layout is the one both read.
    default_format="diffusers",
    text_encoder_prefixes={"qwen3": "text_encoder"},
    # Kept out of fp8 storage and quantization: the timestep and caption embedders (the ones
    # diffusers keeps out of layerwise casting), the patch embedder and the final layer.
    keep_high={
        "denoiser": (r"^t_embedder\.", r"^cap_embedder\.", r"^all_x_embedder\.",
                     r"^all_final_layer\."),
        "text_encoders": (r"embed_tokens", r"norm$"),
        "vae": VAE_KEEP_HIGH,
    },
    swap_blocks=("layers",),
    compile_blocks=("noise_refiner", "context_refiner", "layers"),
    denoiser_part="transformer",
    encoder_parts=(("qwen3", "text_encoder", "tokenizer"),),
    pipeline_class="ZImagePipeline",
    # 30 layers of 3840; Turbo has the same sizes.
    sizes=(ModelSize("Tongyi-MAI/Z-Image", 6.15, 4.02, 30, 3840),),
    # diffusers' loader and ComfyUI both read the diffusers layout; no kohya one is written,
    # so the config, `check` and the web app's form offer only it.
    formats=("diffusers",),
    files=ModelFiles(
        markers=(("cap_embedder.0", "noise_refiner.0", "context_refiner.0"),),
        folder="Tongyi-MAI/Z-Image (or Z-Image-Turbo)",
        singles=(("transformer", "z_image_bf16.safetensors"), ("vae", "ae.safetensors"),
                 ("text_encoder", "qwen_3_4b.safetensors")),
        folder_holds="tokenizer/ (Qwen3's; no single file holds it) and scheduler/ (tells Base "
                     "from Turbo)"),
    # ZImageLoraLoaderMixin loads transformer LoRAs only (no text-encoder part).
    text_encoder_lora_refused=(("qwen3", "ZImagePipeline.load_lora_weights reads transformer "
                                         "LoRAs only; train the transformer only"),),
    embeddings_refused=("Z-Image's Qwen3 encoder reads captions through a chat template; "
                        "textual inversion is not supported for it"),
)

# What other trainers call this family (trainer -> their name -> variant, None: difftune
# picks it), read by `difftune import` (importers/families.py).
OTHER_TRAINERS: dict[str, dict[str, str | None]] = {
    "ai-toolkit": {"zimage": None},
    "onetrainer": {"Z_IMAGE": None},
}
