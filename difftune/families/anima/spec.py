"""Anima's light facts (no torch): its Qwen3 encoder and T5 token ids, objective, refusals,
defaults.

Anima (circlestone-labs) is NVIDIA's Cosmos-Predict2 2B text-to-image DiT retrained for anime
with a Qwen3-0.6B text encoder: an "LLM adapter" (diffusers' AnimaTextConditioner) reads the
caption's T5 token ids as learned queries, cross-attends to Qwen3's last hidden states, and its
output (zero-padded to 512 positions) is what the transformer's cross-attention reads. Latents
are the Qwen-Image VAE's (the Wan 2.1 design). Read by config validation before anything heavy
is imported, and by `AnimaFamily`.
"""

from __future__ import annotations

from difftune.families.specs import (VAE_KEEP_HIGH, FamilySpec, ModelFiles, ModelSize,
                                     TextEncoderSpec)

# (diffusers name, original name) of each linear layer: block parts (after the block index)
# and whole paths outside the blocks.
BLOCK_NAMES = (
    ("attn1.to_q", "self_attn.q_proj"), ("attn1.to_k", "self_attn.k_proj"),
    ("attn1.to_v", "self_attn.v_proj"), ("attn1.to_out.0", "self_attn.output_proj"),
    ("attn2.to_q", "cross_attn.q_proj"), ("attn2.to_k", "cross_attn.k_proj"),
    ("attn2.to_v", "cross_attn.v_proj"), ("attn2.to_out.0", "cross_attn.output_proj"),
    ("ff.net.0.proj", "mlp.layer1"), ("ff.net.2", "mlp.layer2"),
    ("norm1.linear_1", "adaln_modulation_self_attn.1"),
    ("norm1.linear_2", "adaln_modulation_self_attn.2"),
    ("norm2.linear_1", "adaln_modulation_cross_attn.1"),
    ("norm2.linear_2", "adaln_modulation_cross_attn.2"),
    ("norm3.linear_1", "adaln_modulation_mlp.1"), ("norm3.linear_2", "adaln_modulation_mlp.2"))
TOP_NAMES = (("patch_embed.proj", "x_embedder.proj.1"),
             ("time_embed.t_embedder.linear_1", "t_embedder.1.linear_1"),
             ("time_embed.t_embedder.linear_2", "t_embedder.1.linear_2"),
             ("norm_out.linear_1", "final_layer.adaln_modulation.1"),
             ("norm_out.linear_2", "final_layer.adaln_modulation.2"),
             ("proj_out", "final_layer.linear"))
# LyCORIS-kind files name every module `lora_unet_<original name, dots as underscores>`: the
# generic name ComfyUI maps for any model's weights (it has no diffusers-name table for Anima).
LYCORIS_RENAMES = tuple(
    (f"transformer_blocks.{{n}}.{ours}", f"lora_unet_blocks_{{n}}_{orig.replace('.', '_')}")
    for ours, orig in BLOCK_NAMES) + tuple(
    (ours, f"lora_unet_{orig.replace('.', '_')}") for ours, orig in TOP_NAMES)

# AnimaTextEncoderStep's max_sequence_length (both tokenizations are cut there), and the
# conditioner's min_sequence_length (its output is zero-padded to it).
MAX_TOKENS = 512

# The transformer's tensors in the diffusers layout and in the original (ComfyUI's) one; the
# LLM adapter (`llm_adapter.`, only in Anima's files) tells Anima from Cosmos-Predict2.
MARKERS = (("patch_embed.proj", "transformer_blocks.0.attn2.to_k"),
           ("llm_adapter.blocks.0.cross_attn", "blocks.0.cross_attn.k_proj"))

SPEC = FamilySpec(
    name="anima",
    text_encoders=(
        # AnimaTextEncoderStep._get_qwen_prompt_embeds: the caption as it is (no template),
        # padded to the longest, cut at 512, Qwen3's last hidden state under the mask with the
        # padding zeroed. Cache entries hold the caption's own tokens (`trim`).
        TextEncoderSpec("qwen3", "decoder", max_length=MAX_TOKENS, hidden="last", pooled=False,
                        mask=True, trim=True, pad="longest"),
        # AnimaTextEncoderStep._get_t5_prompt_ids: the caption's T5 token ids (with </s>),
        # which the conditioner embeds with its own table (`llm_adapter.embed`). That lookup is
        # the "encoder" here (AnimaTokenEmbedding), so its outputs cache like any other.
        TextEncoderSpec("t5_tokens", "t5", max_length=MAX_TOKENS, hidden="last", pooled=False,
                        mask=True, trim=True, pad="longest"),
    ),
    objective="flow",
    kohya_text_encoders_refused="difftune trains Anima's transformer only",
    # The Qwen-Image VAE downscales 8x and the transformer patches 2x2: sides multiple of 16.
    bucket_step=16,
    denoiser_prefix="transformer",
    # ComfyUI's Anima workflows sample with CFG 4 (and the modular pipeline's guider default).
    default_cfg=4.0,
    # The original layout (`diffusion_model.blocks.N.self_attn.q_proj.lora_A.weight`): ComfyUI
    # has no diffusers-name map for Anima (comfy/lora.py maps it by its own state-dict names
    # only), and diffusers' AnimaLoraLoaderMixin reads it through
    # _convert_non_diffusers_anima_lora_to_diffusers. That converter renames keys only, and the
    # loader refuses any key without "lora" in it, so no `.alpha` is written: each module's
    # alpha / rank is folded into its up factor (both readers then apply scale 1).
    default_format="original",
    formats=("original", "diffusers"),
    lycoris_renames=LYCORIS_RENAMES,
    lora_unread=(
        ("diffusers", "ComfyUI", r".*", "ComfyUI maps Anima LoRAs by the original module names "
         "only (comfy/lora.py has no diffusers-name table for Anima)"),
        ("lycoris", "LyCORIS's create_lycoris_from_weights on the diffusers model", r".*",
         "the file names them for ComfyUI, `lora_unet_<original name>`; difftune's --init-lora "
         "and sample --lora read them"),
    ),
    text_encoder_prefixes={"qwen3": "text_encoder", "t5_tokens": "text_conditioner"},
    # Kept out of fp8 storage and quantization: what diffusers keeps out of layerwise casting
    # (patch embedding, final layer, norms), the time embedding, and the token lookups.
    keep_high={
        "denoiser": (r"^patch_embed\.", r"^time_embed\.", r"^proj_out$", r"^norm_out\.",
                     r"norm"),
        "text_encoders": (r"embed_tokens", r"^embed$", r"norm$"),
        "vae": VAE_KEEP_HIGH,
    },
    swap_blocks=("transformer_blocks",),
    compile_blocks=("transformer_blocks",),
    denoiser_part="transformer",
    encoder_parts=(("qwen3", "text_encoder", "tokenizer"),
                   ("t5_tokens", "t5_embedding", "t5_tokenizer")),
    pipeline_class="AnimaModularPipeline",
    # CosmosTransformer3DModel of 28 blocks of width 2048 (16 heads of 128): 1.956B; the text
    # side, frozen: Qwen3-0.6B (0.596B), the LLM adapter (0.135B) and the copy of its T5 table
    # (0.033B). Counted on the meta device (tests/unit/test_anima_files.py).
    sizes=(ModelSize("circlestone-labs/Anima", 1.96, 0.76, 28, 2048),),
    files=ModelFiles(
        # AnimaModularPipeline's layout (modular_model_index.json; transformer/,
        # text_conditioner/, vae/, text_encoder/, tokenizer/, t5_tokenizer/).
        folder="circlestone-labs/Anima-Base-v1.0-Diffusers",
        singles=(("transformer", "anima-base-v1.0.safetensors"),
                 ("vae", "qwen_image_vae.safetensors"),
                 ("text_encoder", "qwen_3_06b_base.safetensors")),
        folder_holds="tokenizer/ and t5_tokenizer/ (Qwen3's and T5's; no single file holds "
                     "them)",
        markers=MARKERS),
    text_encoder_lora_refused=(
        ("qwen3", "difftune trains Anima's transformer only; AnimaLoraLoaderMixin reads "
                  "transformer and text_conditioner LoRAs, not text-encoder ones"),
        ("t5_tokens", "the T5 token ids are looked up in the LLM adapter's table; there is "
                      "no T5 model to adapt")),
    embeddings_refused=("Anima reads each caption twice (Qwen3 and T5 token ids, joined by "
                        "its LLM adapter); textual inversion is not supported for it"),
)

# What other trainers call this family (trainer -> their name -> variant), read by
# `difftune import` (importers/families.py).
OTHER_TRAINERS: dict[str, dict[str, str | None]] = {
    "kohya": {"networks.lora_anima": None}, "onetrainer": {"ANIMA": None}}
