"""SDXL's light facts (no torch): text encoders, objective, refusals, defaults.

Read by config validation before anything heavy is imported, and by `SDXLFamily`.
"""

from __future__ import annotations

from difftune.families.specs import (VAE_KEEP_HIGH, FamilySpec, ModelFiles, ModelSize,
                                     TextEncoderSpec)

SPEC = FamilySpec(
    name="sdxl",
    text_encoders=(
        TextEncoderSpec("clip_l", "clip", max_length=77, hidden="penultimate", pooled=False),
        TextEncoderSpec("clip_g", "clip_projection", max_length=77, hidden="penultimate",
                        pooled=True),
    ),
    objective="ddpm",
    kohya_text_encoders_refused=None,
    # VAE downscale 8 x two UNet downsamplings need multiples of 32; SDXL was trained (and
    # kohya buckets) in multiples of 64, which also keeps every UNet level's size even.
    bucket_step=64,
    denoiser_prefix="unet",
    default_cfg=5.0,  # SDXL base is not guidance-distilled: samples need CFG
    # kohya keys: ComfyUI maps no UNet attention key of the diffusers (PEFT) layout, while
    # diffusers and ComfyUI both read every key of the kohya one.
    default_format="kohya",
    text_encoder_prefixes={"clip_l": "text_encoder", "clip_g": "text_encoder_2"},
    # LyCORIS kinds: kohya's prefix over diffusers module names, what LyCORIS's kohya network
    # writes and reads for a diffusers UNet and what ComfyUI maps for SDXL; its conv layers
    # are those LyCORIS's kohya preset adapts (resnets, down- and upsamplers).
    lycoris_prefix="lora_unet",
    conv_targets=(r".*\.resnets\.\d+\.(?:conv1|conv2|conv_shortcut)",
                  r".*\.(?:downsamplers|upsamplers)\.0\.conv"),
    # Kept out of fp8 storage and quantization (regexes on module names, per part).
    keep_high={
        "denoiser": (r"^time_embedding\.", r"^add_embedding\.", r"^conv_in$", r"^conv_out$"),
        "text_encoders": (r"embeddings", r"text_projection"),
        "vae": VAE_KEEP_HIGH,
    },
    # The UNet checkpoints inside its blocks (per resnet and attention), so a block's
    # recompute in backward would not pass its hooks: no block swap.
    swap_blocks=(),
    compile_blocks=("down_blocks", "mid_block", "up_blocks"),
    denoiser_part="unet",
    encoder_parts=(("clip_l", "text_encoder", "tokenizer"),
                   ("clip_g", "text_encoder_2", "tokenizer_2")),
    pipeline_class="StableDiffusionXLPipeline",
    # The UNet's 70 transformer layers, most at 1280 wide on a 1/32 grid (the 10 at 640 on the
    # 1/16 grid taken alike).
    sizes=(ModelSize("stabilityai/stable-diffusion-xl-base-1.0", 2.57, 0.82, 70, 1280, 32),),
    files=ModelFiles(
        folder="stabilityai/stable-diffusion-xl-base-1.0",
        singles=(("transformer", "sd_xl_base_1.0.safetensors, the whole checkpoint"),
                 ("vae", "sdxl_vae.safetensors, replacing the checkpoint's")),
        folder_holds="tokenizer/ and tokenizer_2/ (no checkpoint holds them)",
        markers=(("add_embedding.linear_1", "down_blocks.0.resnets.0.conv1"),
                 ("input_blocks.0.0", "label_emb.0.0"))),
)

# What other trainers call this family (trainer -> their name -> variant, None: difftune
# picks it), read by `difftune import` (importers/families.py).
OTHER_TRAINERS: dict[str, dict[str, str | None]] = {
    # train_network.py / sdxl_train_network.py share networks.lora (told apart by what the
    # config holds; where nothing does, read as SDXL: a guess the import report says, see
    # importers/families.py GUESSED).
    "kohya": {"networks.lora": None, "networks.dylora": None, "networks.lora_fa": None,
              "sdxl_train_network.py": None},
    "ai-toolkit": {"sdxl": None, "is_xl": None},
    "onetrainer": {"STABLE_DIFFUSION_XL_10_BASE": None},
}
