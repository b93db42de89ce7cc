"""Krea 2's light facts (no torch): its Qwen3-VL text encoder, objective, refusals, defaults.

Read by config validation before anything heavy is imported, and by `Krea2Family`. The base
(Raw) and the few-step distilled (Turbo) checkpoints share the architecture; they differ in the
pipeline's `is_distilled` flag (its timestep shift), read from the loaded model.
"""

from __future__ import annotations

from difftune.families.specs import (VAE_KEEP_HIGH, FamilySpec, ModelFiles, ModelSize,
                                     TextEncoderSpec)

# Krea2Pipeline's prompt layout (the Qwen-Image system prompt): the prefix before the caption
# (34 tokens with Qwen's tokenizer, dropped from the outputs) and the assistant suffix (5 tokens)
# appended after the caption's padding.
PREFIX = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, "
          "quantity, text, spatial relationships of the objects and background:<|im_end|>\n"
          "<|im_start|>user\n")
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n"
PREFIX_TOKENS = 34
SUFFIX_TOKENS = 5
# Krea2Pipeline's default `text_encoder_select_layers`: every third of Qwen3-VL-4B's 36 layers'
# hidden states (index 0 is the embeddings), 12 in all (the transformer's num_text_layers).
LAYERS = (2, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35)

SPEC = FamilySpec(
    distilled_note=(
        "this is Krea 2 Turbo (model_index.json is_distilled), step-distilled for few-step "
        "sampling: training a LoRA on it directly erodes the distillation (few-step samples "
        "degrade), so train on Krea 2 Raw, the base it was distilled from, and apply the LoRA "
        "to Turbo"),
    name="krea2",
    text_encoders=(
        # Krea2Pipeline.get_text_hidden_states: PREFIX + caption padded to 512 + 34 - 5 tokens,
        # SUFFIX tokenized alone and appended (padding in the middle), position ids counting only
        # real tokens on the 3 mRoPE axes, the LAYERS hidden states stacked on their own axis,
        # the first 34 positions dropped: a fixed 512-token block with a bool mask (no trim: the
        # transformer reads the fixed-length block).
        TextEncoderSpec("qwen3vl", "decoder", max_length=512, hidden="last", pooled=False,
                        mask=True, template=PREFIX + "{}", suffix=SUFFIX, drop=PREFIX_TOKENS,
                        layers=LAYERS, stack="axis", valid_positions=3),
    ),
    objective="flow",
    kohya_text_encoders_refused="difftune trains Krea 2's transformer only",
    # VAE downscale 8 x 2x2 patches: bucket sides must be multiples of 16.
    bucket_step=16,
    denoiser_prefix="transformer",
    # Krea2Pipeline's default guidance_scale 4.5 is pos + 4.5 (pos - neg): CFG at scale 5.5.
    default_cfg=5.5,
    # Both layouts are read completely by both readers. ComfyUI (comfy/ldm/krea2/model.py) keeps
    # the original module names (`blocks.N.attn.wq`, `txtfusion.*`, `first`, `tmlp.0`, ...), so
    # comfy/lora.py model_lora_keys_unet reads `diffusion_model.<original name>` by name (its
    # generic map), and comfy/utils.py krea2_to_diffusers maps the diffusers names
    # (`transformer_blocks.N.attn.to_q`, `ff.*`, `text_fusion.*`, `img_in`, ...) onto them for
    # `transformer.`-prefixed files. diffusers' Krea2LoraLoaderMixin reads its own names as they
    # are and converts `diffusion_model.` files (_convert_non_diffusers_krea2_lora_to_diffusers,
    # which refuses any key besides the factors: no alpha). The diffusers layout is the default
    # (PEFT metadata, no conversion); save.format = "kohya" writes the original layout
    # (keys.to_original, scale folded) that the Krea 2 reference trainer and ai-toolkit use.
    default_format="diffusers",
    text_encoder_prefixes={"qwen3vl": "text_encoder"},
    # Kept out of fp8 storage and quantization: the patch, time and text embedders, the text
    # fusion's layer projector and the final layer (diffusers skips time_embed and the norms in
    # layerwise casting and keeps the norms in fp32).
    keep_high={
        "denoiser": (r"^img_in$", r"^time_embed\.", r"^time_mod_proj$", r"^txt_in\.",
                     r"^text_fusion\.projector$", r"^final_layer\."),
        "text_encoders": (r"embed_tokens", r"norm$", r"^visual\."),
        "vae": VAE_KEEP_HIGH,
    },
    swap_blocks=("transformer_blocks",),
    compile_blocks=("text_fusion", "transformer_blocks"),
    denoiser_part="transformer",
    encoder_parts=(("qwen3vl", "text_encoder", "tokenizer"),),
    pipeline_class="Krea2Pipeline",
    sizes=(ModelSize("Krea 2 Raw", 12.82, 4.44, 28, 6144),),  # released.py: 28 blocks, 48 x 128
    files=ModelFiles(
        folder="the one Krea2Pipeline.save_pretrained writes",
        singles=(("transformer", "the original-layout Krea 2 transformer"),
                 ("vae", "qwen_image_vae.safetensors"),
                 ("text_encoder", "qwen3vl_4b.safetensors")),
        folder_holds="tokenizer/ (Qwen3-VL's; no single file holds it) and model_index.json",
        markers=(("text_fusion.projector", "time_mod_proj"), ("txtfusion.projector", "tproj.1"))),
    # Krea2LoraLoaderMixin loads transformer LoRAs only (no text-encoder part).
    text_encoder_lora_refused=(("qwen3vl", "Krea2Pipeline.load_lora_weights reads transformer "
                                           "LoRAs only; train the transformer only"),),
    embeddings_refused=("Krea 2's Qwen3-VL encoder reads captions through a fixed prompt "
                        "template; textual inversion is not supported for it"),
)

# What other trainers call this family (trainer -> their name -> variant, None: difftune
# picks it), read by `difftune import` (importers/families.py).
OTHER_TRAINERS: dict[str, dict[str, str | None]] = {
    "ai-toolkit": {"krea2": None},
    "onetrainer": {"KREA_2": None},
}
