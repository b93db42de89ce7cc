"""Wan's light facts (no torch): its UMT5 text encoder, objective, refusals, defaults, and the
released kinds it trains from still images and clips.

Wan 2.1 T2V 1.3B and 14B, and Wan 2.2 A14B's low-noise expert, share the architecture
(WanTransformer3DModel, AutoencoderKLWan, UMT5-XXL) and WanPipeline; they differ in size, and
the 2.2 expert sits in the pipeline's `transformer_2` (run alone with `transformer=None,
boundary_ratio=1.0`, so every step is the low-noise expert's). Wan 2.2 A14B's two experts train
in one run (T2V; and I2V, WanImageToVideoPipeline's, each sample conditioned on its own first
frame). `model.variant` picks one (a folder's model_index.json names WanPipeline for the T2V
kinds, so the variant is the config's; WanImageToVideoPipeline the I2V one). Read by config
validation before anything heavy is imported, and by `WanFamily`.
"""

from __future__ import annotations

import re
from dataclasses import replace

from difftune.families.specs import (T5_KEEP_HIGH, VAE_KEEP_HIGH, ExpertSpec, FamilySpec,
                                     ModelFiles, ModelSize, TextEncoderSpec)

# (diffusers name, Wan's name) of each linear layer: block parts (after `blocks.N.`) and whole
# paths outside the blocks, one to one (diffusers' convert_wan_transformer_to_diffusers).
BLOCK_NAMES = (("attn1.to_q", "self_attn.q"), ("attn1.to_k", "self_attn.k"),
               ("attn1.to_v", "self_attn.v"), ("attn1.to_out.0", "self_attn.o"),
               ("attn2.to_q", "cross_attn.q"), ("attn2.to_k", "cross_attn.k"),
               ("attn2.to_v", "cross_attn.v"), ("attn2.to_out.0", "cross_attn.o"),
               ("attn2.add_k_proj", "cross_attn.k_img"), ("attn2.add_v_proj", "cross_attn.v_img"),
               ("ffn.net.0.proj", "ffn.0"), ("ffn.net.2", "ffn.2"))
TOP_NAMES = (("condition_embedder.time_proj", "time_projection.1"),
             ("condition_embedder.time_embedder.linear_1", "time_embedding.0"),
             ("condition_embedder.time_embedder.linear_2", "time_embedding.2"),
             ("condition_embedder.text_embedder.linear_1", "text_embedding.0"),
             ("condition_embedder.text_embedder.linear_2", "text_embedding.2"),
             ("proj_out", "head.head"),
             # Wan 2.1 I2V's image embedder (the CLIP features into the transformer's width)
             ("condition_embedder.image_embedder.ff.net.0.proj", "img_emb.proj.1"),
             ("condition_embedder.image_embedder.ff.net.2", "img_emb.proj.3"))
# LyCORIS-kind files name every module `lora_unet_<Wan's name, dots as underscores>`: the
# generic name ComfyUI maps for any model's weights (it has no diffusers-name table for Wan).
LYCORIS_RENAMES = tuple((f"blocks.{{n}}.{ours}", f"lora_unet_blocks_{{n}}_{wan.replace('.', '_')}")
                        for ours, wan in BLOCK_NAMES) + tuple(
    (ours, f"lora_unet_{wan.replace('.', '_')}") for ours, wan in TOP_NAMES)

# WanPipeline's max_sequence_length: every caption is padded back to 512 positions.
MAX_TOKENS = 512
UMT5_SIZE = 5.68  # billions: UMT5-XXL's encoder (24 layers of 4096), shared by all variants
# billions: Wan 2.1 I2V's CLIP vision encoder (open-clip ViT-H/14's vision tower as transformers'
# CLIPVisionModel, clip_vision.CONFIG: 630,766,080), counted with the encoders: it is
# on the accelerator while the cache is filled and while sampling, as they are.
CLIP_VISION_SIZE = 0.63

# The transformer's tensors in the diffusers layout and in Wan's original one (ComfyUI's files);
# an I2V model adds the image embedder, which a T2V file must not have.
MARKERS = (("condition_embedder.time_proj", "blocks.0.attn2.to_k"),
           ("time_projection.1", "blocks.0.cross_attn.k"))
UNMARKED = ("condition_embedder.image_embedder", "img_emb", "blocks.0.attn2.add_k_proj",
            "blocks.0.cross_attn.k_img")

T2V_13B = FamilySpec(
    name="wan",
    variant="2.1-t2v-1.3b",
    text_encoders=(
        # WanPipeline._get_t5_prompt_embeds: the caption (prompt_clean) padded to 512 tokens,
        # UMT5's last hidden state under the attention mask, each cut to its own tokens and
        # zero-padded back to 512 (the transformer takes no mask). Cache entries hold the
        # caption's own tokens (`trim`); the family pads them back with zeros.
        TextEncoderSpec("umt5", "t5", max_length=MAX_TOKENS, hidden="last", pooled=False,
                        mask=True, trim=True, clean=True),
    ),
    objective="flow",
    kohya_text_encoders_refused="difftune trains Wan's transformer only",
    # AutoencoderKLWan downscales 8x and the transformer patches 2x2: sides multiple of 16.
    bucket_step=16,
    denoiser_prefix="transformer",
    default_cfg=5.0,  # WanPipeline's guidance_scale default (CFG with a negative prompt)
    # The original layout is the default (`diffusion_model.blocks.N.self_attn.q.lora_A.weight`,
    # `.alpha` beside each module; keys.py): ComfyUI has no diffusers-name map for Wan (its
    # comfy/lora.py model_lora_keys_unet maps WAN21 models by their own state-dict names only),
    # and diffusers' WanLoraLoaderMixin reads it through _convert_non_diffusers_wan_lora_to_
    # diffusers. The diffusers layout is written on request (diffusers reads it; ComfyUI not).
    default_format="original",
    formats=("original", "diffusers"),
    lycoris_renames=LYCORIS_RENAMES,
    lora_unread=(
        ("diffusers", "ComfyUI", r".*", "ComfyUI maps Wan LoRAs by Wan's own module names only "
         "(comfy/lora.py has no diffusers-name table for WAN21)"),
        ("lycoris", "LyCORIS's create_lycoris_from_weights on the diffusers model", r".*",
         "the file names them for ComfyUI, `lora_unet_<Wan name>`; difftune's --init-lora and "
         "sample --lora read them"),
    ),
    text_encoder_prefixes={"umt5": "text_encoder"},
    # Kept out of fp8 storage and quantization: what diffusers keeps out of layerwise casting
    # (patch embedding, condition embedders, norms) and the output projection and table.
    keep_high={
        "denoiser": (r"^patch_embedding$", r"^condition_embedder\.", r"^proj_out$",
                     r"norm", r"scale_shift_table"),
        "text_encoders": T5_KEEP_HIGH,
        "vae": VAE_KEEP_HIGH,
    },
    swap_blocks=("blocks",),
    compile_blocks=("blocks",),
    denoiser_part="transformer",
    encoder_parts=(("umt5", "text_encoder", "tokenizer"),),
    pipeline_class="WanPipeline",
    # AutoencoderKLWan keeps the first frame and folds each next 4 into one latent frame;
    # Wan 2.1 and 2.2 A14B were trained at (and sample at) 16 frames a second.
    frame_rule=(4, 1),
    fps=16.0,
    # WanTransformer3DModel of 30 blocks of width 1536 (12 heads of 128, FFN 8960); the VAE
    # downscales 8x and the transformer patches 2x2.
    sizes=(ModelSize("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", 1.42, UMT5_SIZE, 30, 1536),),
    files=ModelFiles(
        folder="Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
        singles=(("transformer", "wan2.1_t2v_1.3B_bf16.safetensors"),
                 ("vae", "wan_2.1_vae.safetensors"),
                 ("text_encoder", "umt5_xxl_fp16.safetensors")),
        folder_holds="tokenizer/ (UMT5's; no single file holds it)",
        markers=MARKERS, unmarked=UNMARKED),
    text_encoder_lora_refused=(("umt5", "WanPipeline.load_lora_weights reads transformer LoRAs "
                                        "only; train the transformer only"),),
    embeddings_refused=("Wan's UMT5 captions are cut to their own tokens and zero-padded; "
                        "textual inversion is not supported for it"),
)

T2V_14B = replace(
    T2V_13B, variant="2.1-t2v-14b",
    # 40 blocks of width 5120 (40 heads of 128, FFN 13824)
    sizes=(ModelSize("Wan-AI/Wan2.1-T2V-14B-Diffusers", 14.29, UMT5_SIZE, 40, 5120),),
    files=replace(T2V_13B.files, folder="Wan-AI/Wan2.1-T2V-14B-Diffusers",
                  singles=(("transformer", "wan2.1_t2v_14B_bf16.safetensors"),
                           *T2V_13B.files.singles[1:])))

# Wan 2.1 I2V 14B: WanImageToVideoPipeline's one transformer, reading the 36 channels of the
# 2.2 I2V experts (noisy latents, then the first-frame mask and start-frame condition) and,
# through its image cross-attention (`add_k_proj`/`add_v_proj`, Wan's `k_img`/`v_img`), the
# penultimate hidden states of its CLIP vision encoder (open-clip ViT-H/14, `image_encoder/`)
# of the start image as its `image_processor/` prepares it.
I2V_14B = replace(
    T2V_14B, variant="2.1-i2v-14b", start_image=True, pipeline_class="WanImageToVideoPipeline",
    # 14.29 B of T2V 14B + 40 blocks x 2 image projections of 5120 x 5120 + the image embedder
    sizes=(ModelSize("Wan-AI/Wan2.1-I2V-14B-480P-Diffusers", 16.39,
                     UMT5_SIZE + CLIP_VISION_SIZE, 40, 5120),),
    files=replace(T2V_14B.files, folder="Wan-AI/Wan2.1-I2V-14B-480P-Diffusers",
                  singles=(("transformer", "wan2.1_i2v_480p_14B_bf16.safetensors"),
                           *T2V_13B.files.singles[1:],
                           ("image_encoder", "clip_vision_h.safetensors")),
                  folder_holds="tokenizer/ (UMT5's; no single file holds it) and "
                               "image_processor/ (the CLIP vision encoder's)",
                  # its transformer has the image embedder the others lack
                  markers=(("condition_embedder.time_proj", "condition_embedder.image_embedder"),
                           ("time_projection.1", "img_emb")), unmarked=()))

# The low-noise expert of Wan 2.2 T2V A14B (the 14B architecture): the pipeline's
# `transformer_2`, whose LoRA users load into ComfyUI's low-noise branch and into WanPipeline
# with `load_into_transformer_2=True`.
A14B_LOW = replace(
    T2V_14B, variant="2.2-t2v-a14b-low", denoiser_part="transformer_2",
    default_cfg=3.0,  # Wan 2.2 A14B's sample_guide_scale for its low-noise expert
    sizes=(ModelSize("Wan-AI/Wan2.2-T2V-A14B-Diffusers", 14.29, UMT5_SIZE, 40, 5120),),
    files=replace(T2V_14B.files, folder="Wan-AI/Wan2.2-T2V-A14B-Diffusers",
                  singles=(("transformer", "wan2.2_t2v_low_noise_14B_fp16.safetensors"),
                           *T2V_13B.files.singles[1:])))

# Wan 2.2's boundary_ratio (the released model_index.json's): WanPipeline runs `transformer`,
# the high-noise expert, at the timesteps t >= boundary_ratio x num_train_timesteps of its
# shifted schedule, and `transformer_2`, the low-noise one, below. I2V A14B's is 0.9.
BOUNDARY = {"t2v": 0.875, "i2v": 0.9}
EXPERTS = (ExpertSpec("high", "transformer", "_high_noise", noisy=True),
           ExpertSpec("low", "transformer_2", "_low_noise", noisy=False))
# The two-expert model is one module holding both experts under their pipeline names
# (families/common/experts.py): module-name patterns anchored at the start gain that prefix.
_EITHER = r"(?:transformer|transformer_2)\."


def _either(patterns: tuple[str, ...]) -> tuple[str, ...]:
    """`patterns` over the experts' module names (anchored ones after an expert's name)."""
    return tuple("^" + _EITHER + p[1:] if p.startswith("^") else p for p in patterns)


# Both experts of Wan 2.2 T2V A14B in one run: one LoRA each (`<name>_high_noise` and
# `<name>_low_noise`, the files ComfyUI's two model branches and WanPipeline's `transformer` /
# `transformer_2` load), each step training one expert on its side of the boundary.
A14B = replace(
    A14B_LOW, variant="2.2-t2v-a14b", denoiser_part="transformer", experts=EXPERTS,
    boundary=BOUNDARY["t2v"],
    default_cfg=4.0,  # Wan 2.2 A14B's sample_guide_scale for its high-noise expert
    keep_high={**A14B_LOW.keep_high, "denoiser": _either(A14B_LOW.keep_high["denoiser"])},
    swap_blocks=(), compile_blocks=("transformer.blocks", "transformer_2.blocks"),
    # two experts of 14.29 B, one on the accelerator at a time
    sizes=(ModelSize("Wan-AI/Wan2.2-T2V-A14B-Diffusers (one expert at a time)", 14.29,
                     UMT5_SIZE, 40, 5120),),
    files=replace(A14B_LOW.files,
                  singles=(("transformer", "wan2.2_t2v_high_noise_14B_fp16.safetensors"),
                           ("transformer_2", "wan2.2_t2v_low_noise_14B_fp16.safetensors"),
                           *T2V_13B.files.singles[1:])))

# Both experts of Wan 2.2 I2V A14B: WanImageToVideoPipeline's, each transformer reading 36
# channels, the 16 noisy latent ones then its prepare_latents' condition (4 of the first-frame
# mask, 16 of the start image and zero frames after it, VAE-encoded and normalized) and
# predicting the 16; no CLIP image encoder (image_dim None), switched at 0.9.
I2V_A14B = replace(
    A14B, variant="2.2-i2v-a14b", boundary=BOUNDARY["i2v"], start_image=True,
    pipeline_class="WanImageToVideoPipeline",
    default_cfg=3.5,  # Wan 2.2 I2V A14B's sample_guide_scale (both experts)
    sizes=(ModelSize("Wan-AI/Wan2.2-I2V-A14B-Diffusers (one expert at a time)", 14.29,
                     UMT5_SIZE, 40, 5120),),
    files=replace(A14B.files, folder="Wan-AI/Wan2.2-I2V-A14B-Diffusers",
                  singles=(("transformer", "wan2.2_i2v_high_noise_14B_fp16.safetensors"),
                           ("transformer_2", "wan2.2_i2v_low_noise_14B_fp16.safetensors"),
                           *T2V_13B.files.singles[1:])))

# The variants whose pipeline encodes the start image with its CLIP vision encoder too.
IMAGE_ENCODED = ("2.1-i2v-14b",)

SPEC = replace(T2V_13B, variant=None, variants=(("2.1-t2v-1.3b", T2V_13B),
                                                ("2.1-t2v-14b", T2V_14B),
                                                ("2.2-t2v-a14b-low", A14B_LOW),
                                                ("2.2-t2v-a14b", A14B),
                                                ("2.2-i2v-a14b", I2V_A14B),
                                                ("2.1-i2v-14b", I2V_14B)))

# An I2V LoRA's image cross-attention projections, which no T2V (2.1 or 2.2) model has.
I2V_MODULES = re.compile(r"(?:cross_attn[._](?:k_img|v_img)|attn2[._]add_[kv]_proj|img_emb)")

# What other trainers call this family (trainer -> their name -> variant, None: difftune picks
# it), read by `difftune import`. ai-toolkit's `wan21` covers 1.3B and 14B (the folder or
# model.variant tells); its `wan22_14b` trains both A14B T2V experts in one run, and
# `wan22_14b_i2v` both I2V ones; its `wan21_i2v` (`:14b480p`, `:14b`) is Wan 2.1 I2V 14B.
OTHER_TRAINERS: dict[str, dict[str, str | None]] = {
    "ai-toolkit": {"wan21": None, "wan22_14b": "2.2-t2v-a14b", "wan22_14b_i2v": "2.2-i2v-a14b",
                   "wan21_i2v": "2.1-i2v-14b"}}
