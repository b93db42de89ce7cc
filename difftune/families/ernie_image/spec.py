"""ERNIE-Image's light facts (no torch): its Mistral 3 text encoder, objective, refusals,
defaults.

Read by config validation before anything heavy is imported, and by `ErnieImageFamily`.
ERNIE-Image and ERNIE-Image-Turbo share the architecture (an 8B single-stream DiT over FLUX.2's
autoencoder, conditioned on Ministral 3 3B's penultimate hidden states), so one spec serves
both.
"""

from __future__ import annotations

from difftune.families.specs import (VAE_KEEP_HIGH, FamilySpec, ModelFiles, ModelSize,
                                     TextEncoderSpec)

SPEC = FamilySpec(
    name="ernie_image",
    text_encoders=(
        # ErnieImagePipeline.encode_prompt: each caption tokenized as it is (no chat template;
        # the tokenizer adds BOS), truncated at the tokenizer's model_max_length (2048 in the
        # released tokenizer_config.json), the penultimate hidden state of only the caption's
        # own tokens; each caption is encoded on its own, as the pipeline loops (padded in a
        # batch, a caption's states differ from its own in the last bits).
        TextEncoderSpec("mistral3", "decoder", max_length=2048, hidden="penultimate",
                        pooled=False, mask=True, trim=True, pad="each"),
    ),
    objective="flow",
    kohya_text_encoders_refused="difftune trains ERNIE-Image's transformer only",
    # FLUX.2's autoencoder downscales 8x and its latents are patchified 2x2: multiples of 16.
    bucket_step=16,
    denoiser_prefix="transformer",
    default_cfg=4.0,  # ErnieImagePipeline's default guidance_scale (real CFG, two passes)
    # ComfyUI's ERNIE-Image model keeps diffusers' module names (comfy/ldm/ernie/model.py) and
    # its LoRA key map reads `transformer.<module>` (comfy/lora.py, the ErnieImage branch);
    # diffusers' ErnieImageLoraLoaderMixin reads the same names. So the diffusers layout is
    # the one both read. It has no `.alpha` entries (the mixin refuses keys without "lora"):
    # as in every diffusers-layout file, the scale is folded into the up factors (alpha =
    # rank; train/checkpoint/lora.py), so both apply the trained strength.
    default_format="diffusers",
    formats=("diffusers",),
    # LyCORIS-kind files (and DoRA): ComfyUI's ERNIE-Image branch maps no `lycoris_` names, but
    # its generic map reads `lora_unet_<module>` (its model's names are diffusers').
    lycoris_prefix="lora_unet",
    lora_unread=(
        ("lycoris", "LyCORIS's create_lycoris_from_weights on the diffusers model", r".*",
         "the file names them for ComfyUI, `lora_unet_<module>`; difftune's --init-lora and "
         "sample --lora read them"),
    ),
    text_encoder_prefixes={"mistral3": "text_encoder"},
    # Kept out of fp8 storage and quantization: the patch and text input projections, the
    # timestep embedding, the shared modulation and the output layers.
    keep_high={
        "denoiser": (r"^x_embedder\.", r"^text_proj$", r"^time_embedding\.",
                     r"^adaLN_modulation\.", r"^final_norm\.", r"^final_linear$"),
        "text_encoders": (r"embed_tokens", r"norm$"),
        "vae": VAE_KEEP_HIGH + (r"^bn$",),
    },
    swap_blocks=("layers",),
    compile_blocks=("layers",),
    denoiser_part="transformer",
    encoder_parts=(("mistral3", "text_encoder", "tokenizer"),),
    pipeline_class="ErnieImagePipeline",
    # 36 layers of 4096 (8.03B); Ministral 3 3B's language model (3.43B; the folder's
    # Mistral3Model adds a vision tower captions never use).
    sizes=(ModelSize("baidu/ERNIE-Image", 8.03, 3.43, 36, 4096),),
    files=ModelFiles(
        markers=(("layers.0.self_attention.to_q", "layers.0.mlp.linear_fc2", "text_proj"),),
        folder="baidu/ERNIE-Image (or ERNIE-Image-Turbo)",
        singles=(("transformer", "ernie-image.safetensors"), ("vae", "flux2-vae.safetensors"),
                 ("text_encoder", "ministral-3-3b.safetensors")),
        folder_holds="tokenizer/ (Ministral 3's; no single file holds it)"),
    # ErnieImageLoraLoaderMixin loads transformer LoRAs only (no text-encoder part).
    text_encoder_lora_refused=(("mistral3", "ErnieImagePipeline.load_lora_weights reads "
                                            "transformer LoRAs only; train the transformer "
                                            "only"),),
    # ErnieImagePipeline has no textual-inversion loader, so nothing in diffusers would read
    # an embedding file trained for it.
    embeddings_refused=("ErnieImagePipeline has no textual-inversion loader (no reader for "
                        "the file); textual inversion is not supported for ERNIE-Image"),
)

# What other trainers call this family (trainer -> their name -> variant, None: difftune
# picks it), read by `difftune import` (importers/families.py).
OTHER_TRAINERS: dict[str, dict[str, str | None]] = {
    "ai-toolkit": {"ernie_image": None},  # its model.arch
    "onetrainer": {"ERNIE": None},  # its model_type (modules/util/enum/ModelType.py)
}
