"""SD 1.5's light facts (no torch): text encoder, objective, refusals, defaults.

Read by config validation before anything heavy is imported, and by `SD15Family`.
"""

from __future__ import annotations

from difftune.families.specs import (VAE_KEEP_HIGH, FamilySpec, ModelFiles, ModelSize,
                                     TextEncoderSpec)

SPEC = FamilySpec(
    name="sd15",
    # The UNet reads CLIP-L's last (final-normed) hidden state, as StableDiffusionPipeline
    # does; model.clip_skip = 1 reads the penultimate one, normed (A1111's "Clip skip: 2").
    text_encoders=(
        TextEncoderSpec("clip_l", "clip", max_length=77, hidden="last", pooled=False),
    ),
    objective="ddpm",
    kohya_text_encoders_refused=None,
    # VAE downscale 8 x three UNet downsamplings need multiples of 64 px (latents divisible
    # by 8); kohya's SD 1.5 buckets use the same 64 px step around 512 px.
    bucket_step=64,
    denoiser_prefix="unet",
    default_cfg=7.5,  # StableDiffusionPipeline's default guidance_scale
    # kohya keys (`lora_unet_<diffusers module>`, `lora_te_`): what every SD 1.5 tool reads
    # (ComfyUI, A1111/Forge, diffusers' kohya converter).
    default_format="kohya",
    text_encoder_prefixes={"clip_l": "text_encoder"},
    # LyCORIS kinds: kohya's prefix over diffusers module names, what LyCORIS's kohya network
    # writes for SD 1.5 and ComfyUI maps; conv layers as LyCORIS's kohya preset picks them.
    lycoris_prefix="lora_unet",
    conv_targets=(r".*\.resnets\.\d+\.(?:conv1|conv2|conv_shortcut)",
                  r".*\.(?:downsamplers|upsamplers)\.0\.conv"),
    # Kept out of fp8 storage and quantization (regexes on module names, per part).
    keep_high={
        "denoiser": (r"^time_embedding\.", r"^conv_in$", r"^conv_out$"),
        "text_encoders": (r"embeddings",),
        "vae": VAE_KEEP_HIGH,
    },
    # The UNet checkpoints inside its blocks (per resnet and attention), so a block's
    # recompute in backward would not pass its hooks: no block swap.
    swap_blocks=(),
    compile_blocks=("down_blocks", "mid_block", "up_blocks"),
    denoiser_part="unet",
    encoder_parts=(("clip_l", "text_encoder", "tokenizer"),),
    pipeline_class="StableDiffusionPipeline",
    # The UNet's 16 transformer layers (320 to 1280 wide on the 1/8 to 1/64 grids) taken
    # alike at 640 wide on the 1/16 grid, about their mean activation size.
    sizes=(ModelSize("stable-diffusion-v1-5/stable-diffusion-v1-5", 0.86, 0.123, 16, 640, 16),),
    files=ModelFiles(
        folder="stable-diffusion-v1-5/stable-diffusion-v1-5",
        singles=(("transformer", "v1-5-pruned-emaonly.safetensors, the whole checkpoint"),
                 ("vae", "vae-ft-mse-840000-ema-pruned.safetensors, replacing the "
                  "checkpoint's")),
        folder_holds="tokenizer/ (no checkpoint holds it)",
        # SD 1.5's first UNet level has attention (SDXL's has none), and it has no added
        # (pooled/time-id) embedding.
        markers=(("down_blocks.0.attentions.0", "down_blocks.0.resnets.0.conv1"),
                 ("input_blocks.1.1", "input_blocks.0.0")),
        unmarked=("add_embedding", "label_emb")),
)

# What other trainers call this family (trainer -> their name -> variant, None: difftune
# picks it), read by `difftune import` (importers/families.py).
OTHER_TRAINERS: dict[str, dict[str, str | None]] = {
    # kohya's SD 1.x script (networks.lora's other one: importers/families.py); ai-toolkit's
    # model.arch for SD 1.x; OneTrainer's model_type (the inpainting UNet, 9 input channels,
    # stays refused: its pipeline is another).
    "kohya": {"train_network.py": None},
    "ai-toolkit": {"sd1": None},
    "onetrainer": {"STABLE_DIFFUSION_15": None},
}
