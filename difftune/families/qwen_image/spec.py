"""Qwen-Image's light facts (no torch): its Qwen2.5-VL text encoder, objective, refusals,
defaults.

Read by config validation before anything heavy is imported, and by `QwenImageFamily`.
Qwen-Image and Qwen-Image-2512 share the architecture (the same transformer, VAE, text encoder,
prompt template and scheduler config; 2512 is a later training of the same weights), so one
spec serves both. Two edit variants read the instruction together with the input image(s)
through Qwen2.5-VL's vision tower (their processor held as the encoder's tokenizer) and append
the input images' packed latents after the target's tokens: "edit" (Qwen-Image-Edit,
QwenImageEditPipeline, one image) and "edit-plus" (Qwen-Image-Edit-2509 and -2511,
QwenImageEditPlusPipeline, up to three images, each named "Picture N:" in the prompt).
"""

from __future__ import annotations

from dataclasses import replace

from difftune.families.specs import (VAE_KEEP_HIGH, FamilySpec, ModelFiles, ModelSize,
                                     TextEncoderSpec)

# QwenImagePipeline.prompt_template_encode and prompt_template_encode_start_idx (the system
# turn and "<|im_start|>user\n" are 34 tokens of Qwen2's tokenizer).
TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, "
            "texture, quantity, text, spatial relationships of the objects and background:"
            "<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n")
DROP = 34
MAX_TOKENS = 1024  # the pipeline's tokenizer_max_length: caption tokens kept after the drop

# The edit pipelines' prompt_template_encode and prompt_template_encode_start_idx (the system
# turn and "<|im_start|>user\n" are 64 tokens of Qwen2's tokenizer); each input image enters
# the user turn before the instruction as its vision tokens ("Picture N: " before each in the
# Plus pipeline), which the processor expands to the image's patch count.
EDIT_TEMPLATE = ("<|im_start|>system\nDescribe the key features of the input image (color, shape, "
                 "size, texture, objects, background), then explain how the user's text "
                 "instruction should alter or modify the image. Generate a new image that meets "
                 "the user's requirements while maintaining consistency with the original input "
                 "where appropriate.<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
                 "<|im_start|>assistant\n")
EDIT_DROP = 64
VISION = "<|vision_start|><|image_pad|><|vision_end|>"
PLUS_IMAGES = 3  # input images a Qwen-Image-Edit-2509/2511 edit pair may give

# The default variant keeps `variant` None so its tiny flavor's fingerprint, and with it every
# cache key written before variants existed, stays as it was.
BASE = FamilySpec(
    name="qwen_image",
    text_encoders=(
        # QwenImagePipeline._get_qwen_prompt_embeds: the caption in the fixed template,
        # tokenized padded to the batch's longest (truncated at 1024 + 34 tokens), the last
        # entry of hidden_states under the attention mask, only the masked tokens kept, then
        # the template's first 34 tokens dropped: variable-length outputs.
        TextEncoderSpec("qwen2_5_vl", "decoder", max_length=MAX_TOKENS + DROP, hidden="last",
                        pooled=False, mask=True, trim=True, template=TEMPLATE, drop=DROP,
                        layers=(-1,), pad="longest"),
    ),
    objective="flow",
    kohya_text_encoders_refused="difftune trains Qwen-Image's transformer only",
    # diffusers' loader and ComfyUI both read the diffusers layout; no kohya one is written,
    # so the config, `check` and the web app's form offer only it.
    formats=("diffusers",),
    # VAE downscale 8 x 2x2 patches: bucket sides must be multiples of 16.
    bucket_step=16,
    denoiser_prefix="transformer",
    default_cfg=4.0,  # QwenImagePipeline's true_cfg_scale default (with a negative prompt)
    # ComfyUI reads the diffusers names: comfy/lora.py model_lora_keys_unet, for its
    # model_base.QwenImage, maps each `diffusion_model.<module>.weight` of the model (whose
    # modules carry the diffusers names: transformer_blocks.N.attn.to_q, img_mlp.net.0.proj,
    # ...) to the LoRA names `<module>`, `transformer.<module>` and `lycoris_<module with dots
    # as underscores>`, besides the `lora_unet_<...>` names it gives every model's keys; its
    # load_lora reads lora_A/lora_B (PEFT) and lora_down/lora_up factors under those names.
    # diffusers' QwenImageLoraLoaderMixin reads `transformer.<module>.lora_A/B`. So the diffusers
    # layout is the one both read, and no second layout is written.
    default_format="diffusers",
    text_encoder_prefixes={"qwen2_5_vl": "text_encoder"},
    # Kept out of fp8 storage and quantization: the timestep embedder, the text norm and the
    # input/output projections (diffusers keeps pos_embed and norms out of layerwise casting).
    keep_high={
        "denoiser": (r"^time_text_embed\.", r"^txt_norm$", r"^img_in$", r"^txt_in$",
                     r"^norm_out\.", r"^proj_out$"),
        "text_encoders": (r"embed_tokens", r"norm$", r"^model\.visual\.", r"lm_head"),
        "vae": VAE_KEEP_HIGH,
    },
    swap_blocks=("transformer_blocks",),
    compile_blocks=("transformer_blocks",),
    denoiser_part="transformer",
    encoder_parts=(("qwen2_5_vl", "text_encoder", "tokenizer"),),
    pipeline_class="QwenImagePipeline",
    sizes=(ModelSize("Qwen/Qwen-Image", 20.43, 8.29, 60, 3072),),  # 60 blocks, 24 heads of 128
    files=ModelFiles(
        folder="Qwen/Qwen-Image",
        singles=(("transformer", "qwen_image_bf16.safetensors"),
                 ("vae", "qwen_image_vae.safetensors"),
                 ("text_encoder", "qwen_2.5_vl_7b.safetensors")),
        folder_holds="tokenizer/ (Qwen2.5-VL's; no single file holds it)",
        markers=(("txt_norm", "img_in", "transformer_blocks.0.img_mlp"),)),
    # QwenImageLoraLoaderMixin loads transformer LoRAs only (no text-encoder part).
    text_encoder_lora_refused=(("qwen2_5_vl", "QwenImagePipeline.load_lora_weights reads "
                                              "transformer LoRAs only; train the transformer "
                                              "only"),),
    embeddings_refused=("Qwen-Image's Qwen2.5-VL encoder reads captions through a fixed prompt "
                        "template whose first 34 tokens are dropped; textual inversion is not "
                        "supported for it"),
)


def _edit(variant: str, pipeline: str, image_prompt: str, images: int,
          release: str) -> FamilySpec:
    """An edit variant: the VL encoder reads the instruction in the edit template after one
    `image_prompt` per input image (not truncated: the pipelines pass the processor's whole
    output), its processor serves as the tokenizer, `images` input images at most; `release`
    is the Qwen repository whose layout its folder has."""
    encoder = TextEncoderSpec("qwen2_5_vl", "decoder", max_length=MAX_TOKENS + EDIT_DROP,
                              hidden="last", pooled=False, mask=True, trim=True,
                              template=EDIT_TEMPLATE, drop=EDIT_DROP, layers=(-1,),
                              pad="longest", image_prompt=image_prompt)
    files = replace(BASE.files, folder=f"Qwen/{release}",
                    singles=(("transformer", f"{release.lower().replace('-', '_')}"
                                             "_bf16.safetensors"), *BASE.files.singles[1:]),
                    folder_holds="processor/ (Qwen2.5-VL's tokenizer and image processor; no "
                                 "single file holds it)")
    return replace(BASE, variant=variant, pipeline_class=pipeline, control_images=images,
                   text_encoders=(encoder,),
                   encoder_parts=(("qwen2_5_vl", "text_encoder", "processor"),), files=files,
                   sizes=tuple(replace(z, name=f"Qwen/{release}") for z in BASE.sizes))


EDIT = _edit("edit", "QwenImageEditPipeline", VISION, 1, "Qwen-Image-Edit")
EDIT_PLUS = _edit("edit-plus", "QwenImageEditPlusPipeline", "Picture {}: " + VISION, PLUS_IMAGES,
                  "Qwen-Image-Edit-2509")
SPEC = replace(BASE, variants=(("base", BASE), ("edit", EDIT), ("edit-plus", EDIT_PLUS)))

# What other trainers call this family (trainer -> their name -> variant, None: difftune
# picks it), read by `difftune import` (importers/families.py).
OTHER_TRAINERS: dict[str, dict[str, str | None]] = {
    "ai-toolkit": {"qwen_image": "base", "qwen_image_edit": "edit",
                   "qwen_image_edit_plus": "edit-plus"},
    "onetrainer": {"QWEN": None},
}
