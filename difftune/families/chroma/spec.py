"""Chroma's light facts (no torch): its one T5 encoder, objective, refusals, defaults.

Read by config validation before anything heavy is imported, and by `ChromaFamily`.
"""

from __future__ import annotations

from difftune.families.specs import (T5_KEEP_HIGH, VAE_KEEP_HIGH, FamilySpec, LoraSource,
                                     ModelFiles, ModelSize, TextEncoderSpec)

# FLUX.1 LoRAs (dev, schnell, Kontext: one family) apply to Chroma, as users apply them. Chroma
# is FLUX.1 schnell's transformer with the per-block modulation layers pruned (a small
# "distilled guidance" network makes the modulation instead): the double and single blocks'
# attention and MLP projections, the input and output projections, carry the same diffusers
# names and shapes (tests/unit/test_lora_sources.py checks them on the tiny flavors and on
# FLUX.1-dev's and Chroma1-HD's released configs, on the meta device). ComfyUI does the same:
# its model_base.Chroma subclasses model_base.Flux, so comfy/lora.py maps FLUX.1 LoRA keys
# onto Chroma through its Flux branch (ComfyUI 4f874c5e).
FLUX_LORAS = LoraSource(
    family="flux",
    why="Chroma is FLUX.1 schnell's transformer less its per-block modulation layers (ComfyUI's "
        "model_base.Chroma subclasses model_base.Flux and applies FLUX.1 LoRAs alike)",
    lacks=(
        (r"transformer\.time_text_embed\..*",
         "FLUX.1's timestep, guidance and pooled-text embedders: Chroma feeds those inputs to "
         "its distilled guidance network and has no such layers"),
        (r"transformer\.(?:transformer_blocks\.\d+\.norm1(?:_context)?|"
         r"single_transformer_blocks\.\d+\.norm|norm_out)\.linear",
         "FLUX.1's modulation layers: Chroma's are pruned (its distilled guidance network "
         "makes the modulation)"),
        (r"text_encoder\..*", "FLUX.1's CLIP-L: Chroma has no CLIP encoder"),
        (r"text_encoder_2\..*", "FLUX.1's T5: ChromaPipeline.load_lora_weights reads no T5 LoRA"),
    ),
)

SPEC = FamilySpec(
    name="chroma",
    # T5-XXL only, with its attention mask applied inside T5 (unlike FLUX.1), as
    # ChromaPipeline._get_t5_prompt_embeds does; the denoiser's own mask (text plus one padding
    # token) is built from it in `ChromaFamily.combine_text`.
    text_encoders=(
        TextEncoderSpec("t5", "t5", max_length=512, hidden="last", pooled=False, mask=True),
    ),
    objective="flow",
    kohya_text_encoders_refused="difftune's Chroma kohya key table covers the transformer only",
    # VAE downscale 8 x 2x2 packing: bucket sides must be multiples of 16.
    bucket_step=16,
    denoiser_prefix="transformer",
    # Not guidance-distilled: real CFG, ChromaPipeline's default guidance_scale.
    default_cfg=5.0,
    # diffusers keys: ComfyUI's `model_base.Chroma` subclasses `model_base.Flux`, so
    # comfy/lora.py's Flux branch (`comfy.utils.flux_to_diffusers`) maps the diffusers names
    # with a `transformer.` prefix onto Chroma's blocks; diffusers' ChromaPipeline
    # (FluxLoraLoaderMixin) reads them as they are.
    default_format="diffusers",
    # ComfyUI's Flux table (comfy/utils.py flux_to_diffusers, ComfyUI 4f874c5e) has no
    # diffusers name for the distilled guidance network, so a diffusers-layout file's modules
    # there are not loaded; its generic map reads them under their original names (which the
    # kohya table lacks: `difftune lora verify` names what each reader drops).
    lora_unread=(
        ("diffusers", "ComfyUI", r"distilled_guidance_layer\..*",
         "ComfyUI's Flux table (comfy/utils.py flux_to_diffusers) has no diffusers name for "
         "the distilled guidance network"),
    ),
    text_encoder_prefixes={"t5": "text_encoder"},
    # Kept out of fp8 storage and quantization (regexes on module names, per part): the
    # modulation approximator, the input and output projections.
    keep_high={
        "denoiser": (r"^distilled_guidance_layer\.", r"^time_text_embed\.", r"^x_embedder$",
                     r"^context_embedder$", r"^norm_out\.", r"^proj_out$"),
        "text_encoders": T5_KEEP_HIGH,
        "vae": VAE_KEEP_HIGH,
    },
    swap_blocks=("transformer_blocks", "single_transformer_blocks"),
    compile_blocks=("transformer_blocks", "single_transformer_blocks"),
    denoiser_part="transformer",
    encoder_parts=(("t5", "text_encoder", "tokenizer"),),
    pipeline_class="ChromaPipeline",
    sizes=(ModelSize("lodestones/Chroma1-HD", 8.90, 4.76, 57, 3072),),  # 19 + 38 blocks
    files=ModelFiles(
        folder="lodestones/Chroma1-HD",
        singles=(("transformer", "Chroma1-HD.safetensors, Chroma's or the diffusers layout"),
                 ("vae", "ae.safetensors, FLUX.1's"), ("t5", "t5xxl_fp16.safetensors")),
        folder_holds="tokenizer/ (T5's; no single file holds it)",
        markers=(("single_transformer_blocks.0.proj_mlp", "distilled_guidance_layer.in_proj"),
                 ("double_blocks.0.img_attn.qkv", "distilled_guidance_layer.in_proj"))),
    # diffusers' text-encoder LoRA reader (lora_base._load_lora_into_text_encoder) converts only
    # CLIP module names (q_proj, k_proj, ...): ChromaPipeline.load_lora_weights fails on any T5
    # LoRA ("Could not automatically infer state dict type").
    text_encoder_lora_refused=(("t5", "ChromaPipeline.load_lora_weights cannot read a T5 "
                                      "LoRA; train the transformer only"),),
    lora_sources=(FLUX_LORAS,),
)

# What other trainers call this family (trainer -> their name -> variant, None: difftune
# picks it), read by `difftune import` (importers/families.py).
OTHER_TRAINERS: dict[str, dict[str, str | None]] = {
    "kohya": {"chroma": None},
    "ai-toolkit": {"chroma": None},
    "onetrainer": {"CHROMA_1": None},
}
