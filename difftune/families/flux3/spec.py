"""FLUX.3's light facts (no torch): its Qwen3-VL text encoder, objective, refusals, defaults.

diffusers 0.42.1 ships FLUX.3 as a modular pipeline only (Flux3ModularPipeline, and
Flux3DistilledModularPipeline for the step-distilled flow-map checkpoint); its blocks are the
reference for text, sampling and LoRA loading. The base and the distilled checkpoint share the
architecture (Flux3Transformer2DModel; the distilled one adds `target_timestep_embedder`,
`flow_map=True`), so they are one spec, told apart on the loaded model. Read by config
validation before anything heavy is imported, and by `Flux3Family`.
"""

from __future__ import annotations

from difftune.families.specs import (VAE_KEEP_HIGH, FamilySpec, ModelFiles, ModelSize,
                                     TextEncoderSpec)

# Flux3TextEncoderStep's default `text_encoder_out_layers`: every fourth of Qwen3-VL-4B's
# hidden states (index 0 is the embeddings), 8 x 2560 = the transformer's 20480 text features.
LAYERS = (4, 8, 12, 16, 20, 24, 28, 32)
# Flux3TextEncoderStep(pad_multiple=80) and its default max_sequence_length.
WINDOW = 80
MAX_TOKENS = 8192
# The tensors that tell the FLUX.3 transformer apart (diffusers layout, BFL's original one);
# the distilled checkpoint adds the target-timestep embedder.
MARKERS = (("txt_mode_blocks.0.attn.to_q", "early_stream_modulations.image.linear"),
           ("txt_mode_blocks.0.q_proj", "early_stream_modulations.image.lin"))

SPEC = FamilySpec(
    distilled_note=(
        "this is the step-distilled FLUX.3 (a flow map: its transformer has "
        "target_timestep_embedder, flow_map=True, sampled in 16 steps without CFG by "
        "Flux3DistilledModularPipeline): difftune trains it at target timestep = timestep, "
        "and training a LoRA on it directly erodes the distillation (few-step samples "
        "degrade), so train on the FLUX.3 base it was distilled from and apply the LoRA to "
        "the distilled model"),
    name="flux3",
    text_encoders=(
        # Flux3TextEncoderStep._get_qwen3_vl_prompt_embeds: the caption as one user message in
        # Qwen3-VL's chat template (generation prompt), tokenized as it is rendered, padded on
        # the right to its length rounded up to a multiple of 80 tokens (at most 8192), run
        # under the attention mask with position ids 0, 1, ... and every padding token at 1,
        # hidden states 4, 8, ..., 32 concatenated per token. Every position of the window
        # (padding too) reaches the transformer, which takes no text mask.
        TextEncoderSpec("qwen3vl", "decoder", max_length=MAX_TOKENS, hidden="last",
                        pooled=False, mask=True, chat=(), layers=LAYERS, window=WINDOW,
                        pad_position=1),
    ),
    objective="flow",
    kohya_text_encoders_refused="difftune trains FLUX.3's transformer only",
    # FLUX.2's autoencoder downscales 8x and its latents are patchified 2x2: sides multiple
    # of 16 (Flux3PrepareLatentsStep refuses others).
    bucket_step=16,
    denoiser_prefix="transformer",
    # Flux3LoopDenoiser's ClassifierFreeGuidance default (guidance_scale 3.5, real CFG); the
    # distilled model samples without CFG.
    default_cfg=3.5,
    # ComfyUI at 4f874c5e has no FLUX.3 model (no comfy/ldm entry, no detection in
    # comfy/model_detection.py or class in comfy/supported_models.py), so it loads no FLUX.3
    # LoRA in any layout; its FLUX.2 names (double/single blocks with fused qkv) do not carry
    # over to FLUX.3's per-mode blocks. The diffusers layout is the one the reference reader,
    # Flux3LoraLoaderMixin (which Flux3ModularPipeline inherits), reads completely; its
    # converter for `diffusion_model.` files (_convert_non_diffusers_flux3_lora_to_diffusers)
    # renames the blocks' modules only.
    default_format="diffusers",
    formats=("diffusers",),
    text_encoder_prefixes={"qwen3vl": "text_encoder"},
    # Kept out of fp8 storage and quantization: the timestep embedders, the modulation heads,
    # the input and output projections (diffusers keeps norm_q/norm_k in fp32 and skips
    # `norm` and `pos_embed` in layerwise casting).
    keep_high={
        "denoiser": (r"^timestep_embedder\.", r"^target_timestep_embedder\.",
                     r"^early_stream_modulations\.", r"^single_stream_modulations\.",
                     r"^x_embedders\.", r"^context_embedder$", r"^norm_out\.", r"^proj_out$"),
        "text_encoders": (r"embed_tokens", r"norm$", r"^visual\."),
        "vae": VAE_KEEP_HIGH + (r"^bn$",),
    },
    swap_blocks=("single_transformer_blocks",),
    compile_blocks=("txt_mode_blocks", "single_transformer_blocks"),
    denoiser_part="transformer",
    encoder_parts=(("qwen3vl", "text_encoder", "tokenizer"),),
    pipeline_class="Flux3ModularPipeline",
    # 5 per-mode blocks for each of image, reference image and text, then 28 joint blocks
    # (Flux3Transformer2DModel's defaults: 24 heads of 128); Qwen3-VL-4B as Krea 2 counts it.
    sizes=(ModelSize("black-forest-labs/flux-3-image-klein-base", 5.54, 4.44, 28, 3072),),
    files=ModelFiles(
        folder="black-forest-labs/flux-3-image-klein-base (or flux-3-image-klein, distilled)",
        singles=(("transformer", "BFL's FLUX.3 file, BFL or diffusers layout"),
                 ("vae", "flux2-vae.safetensors"),
                 ("text_encoder", "qwen3vl_4b.safetensors")),
        folder_holds="tokenizer/ (Qwen3-VL's; no single file holds it)",
        markers=MARKERS),
    # Edit pairs: one reference a pair, kept whole on its canvas (reference.py), as the
    # pipeline keeps a single `image`; several (its "crop" rule) are not trained yet.
    control_images=1,
    text_encoder_lora_refused=(("qwen3vl", "Flux3LoraLoaderMixin.load_lora_weights reads "
                                           "transformer LoRAs only; train the transformer "
                                           "only"),),
    embeddings_refused=("FLUX.3's text encoder reads captions through a chat template and "
                        "stacks inner hidden states; textual inversion is not supported for it"),
)

# What other trainers call this family: none trains FLUX.3 yet.
OTHER_TRAINERS: dict[str, dict[str, str | None]] = {}
