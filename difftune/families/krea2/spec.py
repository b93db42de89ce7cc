"""Krea 2's light facts (no torch): its Qwen3-VL text encoder, objective, refusals, defaults.

Read by config validation before anything heavy is imported, and by `Krea2Family`. The base
(Raw) and the few-step distilled (Turbo) checkpoints share the architecture; they differ in the
pipeline's `is_distilled` flag (its timestep shift), read from the loaded model.
"""

from __future__ import annotations

from difftune.families.specs import VAE_KEEP_HIGH, FamilySpec, TextEncoderSpec

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
    # The default layout is the original one (save.format "kohya" writes it, keys.to_original:
    # `diffusion_model.blocks.N.attn.wq.lora_A.weight`, scale folded, no alpha), the one both
    # readers take completely: diffusers' Krea2LoraLoaderMixin.lora_state_dict converts
    # `diffusion_model.` files with _convert_non_diffusers_krea2_lora_to_diffusers (every module
    # of the presets is in its map; it refuses any key besides the factors, hence no alpha), and
    # ComfyUI's comfy/lora.py model_lora_keys_unet maps every `diffusion_model.<name>` weight of
    # its model by name ("generic lora format") and `lora_unet_<name with _>`: ComfyUI's Krea 2
    # model keeps the original module names (its checkpoints are in the original layout), so the
    # original names are its names. The diffusers layout (`transformer.<module>`) is read by
    # diffusers as is, and is written on request (save.format = "diffusers").
    default_format="kohya",
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
    # Krea2LoraLoaderMixin loads transformer LoRAs only (no text-encoder part).
    text_encoder_lora_refused=(("qwen3vl", "Krea2Pipeline.load_lora_weights reads transformer "
                                           "LoRAs only; train the transformer only"),),
    embeddings_refused=("Krea 2's Qwen3-VL encoder reads captions through a fixed prompt "
                        "template; textual inversion is not supported for it"),
)
