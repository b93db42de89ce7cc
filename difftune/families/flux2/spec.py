"""FLUX.2's light facts (no torch): its two kinds, each with its own text encoder and pipeline.

FLUX.2 klein (4B with Qwen3-4B, 9B with Qwen3-8B; Flux2KleinPipeline) and FLUX.2 dev (32B with
Mistral Small 3.1; Flux2Pipeline) share the transformer architecture (Flux2Transformer2DModel)
and the autoencoder (AutoencoderKLFlux2) but not the text encoder, so the family declares two
variants; `model.variant` picks one (or a folder's model_index.json declares it). Read by config
validation before anything heavy is imported, and by `Flux2Family`.
"""

from __future__ import annotations

import re
from dataclasses import replace

from difftune.families.specs import (VAE_KEEP_HIGH, FamilySpec, ModelFiles, ModelSize,
                                     TextEncoderSpec)

# diffusers' pipelines/flux2/system_messages.py SYSTEM_MESSAGE (from BFL's flux2 repository):
# the system turn Flux2Pipeline puts before every prompt for Mistral.
DEV_SYSTEM = ("You are an AI that reasons about image descriptions. You give structured "
              "responses focusing on object relationships, object\nattribution and actions "
              "without speculation.")

# Modules outside the blocks that ComfyUI's FLUX table has no diffusers name for, with the
# BFL names its FLUX.2 model keeps (comfy/ldm/flux/model.py), kohya-style (dots as underscores).
_BFL_ONLY = (("double_stream_modulation_img.linear", "double_stream_modulation_img_lin"),
             ("double_stream_modulation_txt.linear", "double_stream_modulation_txt_lin"),
             ("single_stream_modulation.linear", "single_stream_modulation_lin"),
             ("time_guidance_embed.timestep_embedder.linear_1", "time_in_in_layer"),
             ("time_guidance_embed.timestep_embedder.linear_2", "time_in_out_layer"),
             ("time_guidance_embed.guidance_embedder.linear_1", "guidance_in_in_layer"),
             ("time_guidance_embed.guidance_embedder.linear_2", "guidance_in_out_layer"))
_MODULATION = r"double_stream_modulation_(?:img|txt)\.linear|single_stream_modulation\.linear"

# The FLUX.2 transformer's tensors (diffusers layout, BFL's); dev adds the guidance embedder.
MARKERS = (("single_transformer_blocks.0.attn.to_qkv_mlp_proj", "double_stream_modulation_img"),
           ("single_blocks.0.linear1", "double_stream_modulation_img.lin"))

KLEIN = FamilySpec(
    name="flux2",
    variant="klein",
    text_encoders=(
        # Flux2KleinPipeline._get_qwen3_prompt_embeds: each caption as one user message in
        # Qwen3's chat template (generation prompt, enable_thinking=False), padded to 512
        # tokens, run under the attention mask, hidden_states 9, 18 and 27 concatenated per
        # token. Every position (padding too) reaches the transformer, which gets no mask.
        TextEncoderSpec("qwen3", "decoder", max_length=512, hidden="last", pooled=False,
                        mask=True, chat=(("enable_thinking", False),), layers=(9, 18, 27)),
    ),
    objective="flow",
    kohya_text_encoders_refused="difftune trains FLUX.2's transformer only",
    # AutoencoderKLFlux2 downscales 8x and its latents are patchified 2x2: sides multiple of 16.
    bucket_step=16,
    denoiser_prefix="transformer",
    # klein base runs real CFG at 4 (its pipeline's default; the step-distilled klein ignores it)
    default_cfg=4.0,
    # The original layout is the default (`diffusion_model.<BFL module>.lora_A/B.weight`, scale
    # folded, no alpha; keys.to_original): ComfyUI reads every module of it through its generic
    # `diffusion_model.<state-dict name>` map (comfy/lora.py model_lora_keys_unet; its FLUX.2
    # model keeps BFL's names, comfy/ldm/flux), diffusers through
    # _convert_non_diffusers_flux2_lora_to_diffusers, the shared modulation layers included.
    # The other layouts each lose those three layers of the "all_linear" preset in one reader:
    # "diffusers" in ComfyUI (its FLUX table, comfy/utils.py flux_to_diffusers, has no entry
    # for them) and "kohya" (`lora_unet_<BFL name>`) in diffusers' kohya converter.
    default_format="original",
    formats=("original", "diffusers", "kohya"),
    # LyCORIS files: ComfyUI maps `lycoris_<diffusers module>` through its FLUX table (q/k/v
    # applied to the fused weights by offset), which lacks these; its generic map reads them
    # under BFL's names.
    lycoris_renames=tuple((m, f"lora_unet_{o}") for m, o in _BFL_ONLY),
    lora_unread=(
        ("original", "diffusers", r"norm_out\.linear", "diffusers' FLUX.2 converter maps BFL's "
         "(shift, scale) final modulation onto norm_out.linear without swapping the halves"),
        ("diffusers", "ComfyUI", "|".join(re.escape(m) for m, _ in _BFL_ONLY),
         "ComfyUI's FLUX table (comfy/utils.py flux_to_diffusers) has no diffusers name for them"),
        ("lycoris", "LyCORIS's create_lycoris_from_weights on the diffusers model",
         "|".join(re.escape(m) for m, _ in _BFL_ONLY), "the file names them for ComfyUI, "
         "`lora_unet_<BFL name>`; difftune's --init-lora and sample --lora read them"),
        ("kohya", "diffusers", _MODULATION + r"|time_guidance_embed\.guidance_embedder\..*|"
         r"norm_out\.linear", "diffusers' kohya FLUX.2 converter skips them"),
    ),
    text_encoder_prefixes={"qwen3": "text_encoder"},
    # Kept out of fp8 storage and quantization: the time/guidance embedder, the shared
    # modulation layers, the input and output projections.
    keep_high={
        "denoiser": (r"^time_guidance_embed\.", r"^double_stream_modulation_", 
                     r"^single_stream_modulation\.", r"^x_embedder$", r"^context_embedder$",
                     r"^norm_out\.", r"^proj_out$"),
        "text_encoders": (r"embed_tokens", r"norm$", r"lm_head"),
        "vae": VAE_KEEP_HIGH + (r"^bn$",),
    },
    swap_blocks=("transformer_blocks", "single_transformer_blocks"),
    compile_blocks=("transformer_blocks", "single_transformer_blocks"),
    denoiser_part="transformer",
    encoder_parts=(("qwen3", "text_encoder", "tokenizer"),),
    pipeline_class="Flux2KleinPipeline",
    sizes=(ModelSize("black-forest-labs/FLUX.2-klein-base-4B", 3.88, 4.02, 25, 3072),  # 5 + 20
           ModelSize("black-forest-labs/FLUX.2-klein-base-9B", 9.08, 8.19, 32, 4096)),  # 8 + 24
    files=ModelFiles(
        folder="black-forest-labs/FLUX.2-klein-4B (or the 9B)",
        singles=(("transformer", "BFL's klein file, BFL or diffusers layout"),
                 ("vae", "flux2-vae.safetensors"),
                 ("text_encoder", "qwen_3_4b.safetensors, or qwen_3_8b for the 9B")),
        folder_holds="tokenizer/ (Qwen3's; no single file holds it) and model_index.json",
        markers=MARKERS, unmarked=("time_guidance_embed.guidance_embedder", "guidance_in")),
    # Reference images (flux2/reference.py): both pipelines take `image=` a list of any length,
    # each reference's tokens following the target's. Each adds all of its tokens to every
    # attention call (4096 at 1024 x 1024: four add 16384 to the target's 4096), so memory and
    # step time grow fast with each; four per pair (and per sample prompt) is difftune's bound.
    control_images=4,
    # Flux2LoraLoaderMixin loads transformer LoRAs only (no text-encoder part).
    text_encoder_lora_refused=(("qwen3", "Flux2KleinPipeline.load_lora_weights reads "
                                         "transformer LoRAs only; train the transformer only"),),
    embeddings_refused=("FLUX.2's text encoders read captions through a chat template and "
                        "stack inner hidden states; textual inversion is not supported for them"),
)

DEV = replace(
    KLEIN,
    variant="dev",
    text_encoders=(
        # Flux2Pipeline._get_mistral_3_small_prompt_embeds: BFL's system message, then the
        # caption as the user message (both as typed text parts), through Mistral's chat
        # template without a generation prompt, tokenized by apply_chat_template (the template
        # writes BOS), padded to 512, hidden_states 10, 20 and 30 concatenated per token.
        # "[IMG]" is removed from captions first (format_input: Pixtral's image token).
        TextEncoderSpec("mistral3", "decoder", max_length=512, hidden="last", pooled=False,
                        mask=True, chat=(("add_generation_prompt", False),), system=DEV_SYSTEM,
                        parts=True, specials=False, layers=(10, 20, 30), strip=("[IMG]",)),
    ),
    # dev is guidance-distilled: its guidance embedding takes the scale, no CFG pass.
    default_cfg=1.0,
    text_encoder_prefixes={"mistral3": "text_encoder"},
    encoder_parts=(("mistral3", "text_encoder", "tokenizer"),),
    pipeline_class="Flux2Pipeline",
    sizes=(ModelSize("black-forest-labs/FLUX.2-dev", 32.2, 24.0, 56, 6144),),  # 8 + 48 blocks
    files=ModelFiles(
        folder="black-forest-labs/FLUX.2-dev",
        singles=(("transformer", "flux2-dev.safetensors, BFL or diffusers layout"),
                 ("vae", "flux2-vae.safetensors"),
                 ("text_encoder", "the Mistral Small 3.1 encoder file")),
        folder_holds="tokenizer/ (Mistral's; no single file holds it) and model_index.json",
        markers=tuple(m + (g,) for m, g in zip(MARKERS, ("time_guidance_embed.guidance_embedder",
                                                          "guidance_in.in_layer")))),
    text_encoder_lora_refused=(("mistral3", "Flux2Pipeline.load_lora_weights reads "
                                            "transformer LoRAs only; train the transformer "
                                            "only"),),
)

# The family's spec: klein's facts (the default variant), with both variants declared.
SPEC = replace(KLEIN, variant=None, variants=(("klein", KLEIN), ("dev", DEV)))

# What other trainers call this family (trainer -> their name -> variant, None: difftune
# picks it), read by `difftune import` (importers/families.py).
OTHER_TRAINERS: dict[str, dict[str, str | None]] = {
    "ai-toolkit": {"flux2": "dev", "flux2_klein_4b": "klein", "flux2_klein_9b": "klein"},
    "onetrainer": {"FLUX_2": None},
}
