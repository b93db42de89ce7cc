"""ComfyUI's LoRA key map for the denoiser of each family difftune trains, written as data.

ComfyUI is not pip-installable, so the tests check difftune's files against ComfyUI's rules as
read from its source: silveroxides/ComfyUI at commit 4f874c5e3a2fafb9938273c5f3fc47d2da017667
(2026-07-29, tracking Comfy-Org/ComfyUI's master), files

- comfy/lora.py `model_lora_keys_unet`: for every weight `diffusion_model.<k>.weight` of the
  loaded model, the keys `diffusion_model.<k>` and `lora_unet_<k, dots as underscores>` (the
  generic map); then per model class (comfy/model_base.py) the names other trainers use, built
  from a table of diffusers names (comfy/utils.py): Flux (FLUX.1, Chroma and FLUX.2 derive from
  it) `transformer.<d>`, `lycoris_<d_>`, `lora_transformer_<d_>` and `<d>` over
  `flux_to_diffusers`; SD3 `transformer.<d>`, `base_model.model.<d>`, `lora_transformer_<d_>`,
  `lycoris_<d_>` over `mmdit_to_diffusers`; QwenImage `<k>`, `transformer.<k>`, `lycoris_<k_>`
  over the model's own names; Krea2 and Lumina2 (Z-Image) `diffusion_model.<d>`,
  `transformer.<d>`, `lycoris_<d_>`, `<d>` over `krea2_to_diffusers` / `z_image_to_diffusers`.
- `load_lora` and comfy/weight_adapter/{lora,loha,lokr}.py `load`: the tensor names read per
  mapped key (`SUFFIXES`); a key of a file that none reads is "lora key not loaded".
- the models' weight names: comfy/ldm/flux/{model,layers}.py (FLUX.1 with per-block modulation,
  FLUX.2 with `global_modulation`: the shared `double_stream_modulation_img/txt.lin` and
  `single_stream_modulation.lin`, no `vector_in`), comfy/ldm/chroma, comfy/ldm/qwen_image
  (diffusers' names), comfy/ldm/lumina (Z-Image), comfy/ldm/krea2, comfy/ldm/modules/mmdit.py,
  comfy/ldm/ernie/model.py (ERNIE-Image: diffusers' names; its branch adds `transformer.<k>`),
  comfy/ldm/wan/model.py (Wan 2.1/2.2's WanModel: `blocks.N.self_attn.q`, `cross_attn`,
  `ffn.0`/`ffn.2`, `time_projection.1`, `head.head`; model_base.WAN21 has no branch in
  `model_lora_keys_unet`, so Wan's keys are the generic map's only),
  comfy/ldm/modules/diffusionmodules/openaimodel.py (SDXL's UNet), and for SDXL the UNet
  branch: `lora_unet_<d_>` and `lycoris_<d_>` over `unet_to_diffusers`.

The text encoders' maps (`model_lora_keys_clip`) are not here: the tests train the denoiser.

Names are regexes over module names with `\\.` for dots (a block index is `\\d+`); `{}` in a form
is the name, `{_}` the name with underscores for dots.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# The tensors per mapped module that ComfyUI's adapters and `load_lora` read.
SUFFIXES = ("alpha", "dora_scale", "lora_up.weight", "lora_down.weight", "lora_mid.weight",
            "lora_A.weight", "lora_B.weight", "lora.up.weight", "lora.down.weight",
            "hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2",
            "lokr_w1", "lokr_w2", "lokr_w1_a", "lokr_w1_b", "lokr_w2_a", "lokr_w2_b", "lokr_t2",
            "diff", "diff_b", "w_norm", "b_norm", "set_weight")
GENERIC_FORMS = ("diffusion_model.{}", "lora_unet_{_}")

# comfy/utils.py flux_to_diffusers: the diffusers names it maps (weights).
_FLUX_TABLE = (
    r"transformer_blocks\.\d+\.(?:attn\.(?:to_q|to_k|to_v|add_q_proj|add_k_proj|add_v_proj|"
    r"to_out\.0|to_add_out|norm_q|norm_k|norm_added_q|norm_added_k)|norm1\.linear|"
    r"norm1_context\.linear|ff\.net\.0\.proj|ff\.net\.2|ff_context\.net\.0\.proj|"
    r"ff_context\.net\.2|ff\.linear_in|ff\.linear_out|ff_context\.linear_in|"
    r"ff_context\.linear_out)",
    r"single_transformer_blocks\.\d+\.(?:attn\.(?:to_q|to_k|to_v|norm_q|norm_k|to_qkv_mlp_proj|"
    r"to_out)|proj_mlp|norm\.linear|proj_out)",
    r"proj_out|x_embedder|context_embedder|norm_out\.linear|controlnet_x_embedder|"
    r"time_text_embed\.(?:timestep_embedder|text_embedder|guidance_embedder)\.linear_[12]",
)
_FLUX_FORMS = ("transformer.{}", "lycoris_{_}", "lora_transformer_{_}", "{}")
# comfy/ldm/flux: the weight names of its blocks and of the layers around them.
_BFL_ATTN_MLP = r"(?:img|txt)_attn\.(?:qkv|proj)|(?:img|txt)_mlp\.[02]"
_BFL_TOP = (r"img_in|txt_in|time_in\.(?:in|out)_layer|guidance_in\.(?:in|out)_layer|"
            r"final_layer\.linear|final_layer\.adaLN_modulation\.1")
# comfy/utils.py mmdit_to_diffusers (SD3): the diffusers names it maps.
_SD3_TABLE = (
    r"transformer_blocks\.\d+\.(?:attn\.(?:to_q|to_k|to_v|add_q_proj|add_k_proj|add_v_proj|"
    r"to_out\.0|to_add_out|norm_q|norm_k|norm_added_q|norm_added_k)|attn2\.(?:to_q|to_k|to_v|"
    r"to_out\.0|norm_q|norm_k)|norm1\.linear|norm1_context\.linear|ff\.net\.0\.proj|ff\.net\.2|"
    r"ff_context\.net\.0\.proj|ff_context\.net\.2)",
    r"context_embedder|pos_embed\.proj|proj_out|norm_out\.linear|"
    r"time_text_embed\.(?:timestep_embedder|text_embedder)\.linear_[12]",
)
# comfy/utils.py z_image_to_diffusers: the diffusers names it maps.
_Z_IMAGE_TABLE = (
    r"(?:layers|context_refiner|noise_refiner)\.\d+\.(?:attention\.(?:to_q|to_k|to_v|to_out\.0|"
    r"norm_q|norm_k)|attention_norm[12]|feed_forward\.w[123]|ffn_norm[12]|adaLN_modulation\.0)",
    r"all_final_layer\.2-1\.(?:linear|adaLN_modulation\.1)|all_x_embedder\.2-1|"
    r"cap_embedder\.[01]|t_embedder\.mlp\.[02]",
)
# comfy/utils.py krea2_to_diffusers: the diffusers names it maps.
_KREA2_BLOCK = (r"\.\d+\.(?:attn\.(?:to_q|to_k|to_v|to_gate|to_out\.0|to_out)|"
                r"ff\.(?:gate|up|down))")
_KREA2_TABLE = (
    r"(?:transformer_blocks|text_fusion\.layerwise_blocks|text_fusion\.refiner_blocks)"
    + _KREA2_BLOCK,
    r"img_in|time_embed\.linear_[12]|time_mod_proj|txt_in\.linear_[12]|text_fusion\.projector|"
    r"final_layer\.linear",
)
_LUMINA_FORMS = ("diffusion_model.{}", "transformer.{}", "lycoris_{_}", "{}")


@dataclass(frozen=True)
class KeyMap:
    """One ComfyUI model class's LoRA key map: its weight names (the generic map's), the
    diffusers names its branch table maps and the forms the branch spells them in, and forms
    its branch adds over its own weight names."""

    model: str
    weights: tuple[str, ...]
    table: tuple[str, ...] = ()
    table_forms: tuple[str, ...] = ()
    weight_forms: tuple[str, ...] = ()
    extra: tuple[str, ...] = ()  # module-key regexes spelled in full

    def pattern(self) -> re.Pattern[str]:
        """One regex matching every module key this map holds."""
        alts = [_spell(form, name) for form in (*GENERIC_FORMS, *self.weight_forms)
                for name in self.weights]
        alts += [_spell(form, name) for form in self.table_forms for name in self.table]
        alts += list(self.extra)
        return re.compile("|".join(f"(?:{a})" for a in alts))


def _spell(form: str, name: str) -> str:
    """A form with a name regex in it (`{_}`: dots as underscores)."""
    if "{_}" in form:
        name, form = name.replace(r"\.", "_"), form.replace("{_}", "{}")
    return re.escape(form.replace("{}", "@")).replace("@", f"(?:{name})")


FLUX = KeyMap("Flux", (
    r"double_blocks\.\d+\.(?:(?:img|txt)_mod\.lin|" + _BFL_ATTN_MLP + ")",
    r"single_blocks\.\d+\.(?:linear1|linear2|modulation\.lin)",
    _BFL_TOP + r"|vector_in\.(?:in|out)_layer"), _FLUX_TABLE, _FLUX_FORMS)
FLUX2 = KeyMap("Flux2", (
    r"double_blocks\.\d+\.(?:" + _BFL_ATTN_MLP + ")", r"single_blocks\.\d+\.(?:linear1|linear2)",
    _BFL_TOP + r"|double_stream_modulation_(?:img|txt)\.lin|single_stream_modulation\.lin"),
    _FLUX_TABLE, _FLUX_FORMS)
CHROMA = KeyMap("Chroma", (
    r"double_blocks\.\d+\.(?:" + _BFL_ATTN_MLP + ")", r"single_blocks\.\d+\.(?:linear1|linear2)",
    r"img_in|txt_in|final_layer\.linear|distilled_guidance_layer\.(?:in_proj|out_proj|"
    r"layers\.\d+\.(?:in|out)_layer)"), _FLUX_TABLE, _FLUX_FORMS)
SD3 = KeyMap("SD3", (
    r"joint_blocks\.\d+\.(?:x_block|context_block)\.(?:attn2?\.(?:qkv|proj)|mlp\.fc[12]|"
    r"adaLN_modulation\.1)",
    r"x_embedder\.proj|context_embedder|t_embedder\.mlp\.[02]|y_embedder\.mlp\.[02]|"
    r"final_layer\.linear|final_layer\.adaLN_modulation\.1"),
    _SD3_TABLE, ("transformer.{}", "base_model.model.{}", "lora_transformer_{_}", "lycoris_{_}"))
QWEN_IMAGE = KeyMap("QwenImage", (
    r"transformer_blocks\.\d+\.(?:attn\.(?:to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|"
    r"add_v_proj|to_add_out)|(?:img|txt)_mod\.1|(?:img|txt)_mlp\.net\.(?:0\.proj|2))",
    r"img_in|txt_in|proj_out|norm_out\.linear|"
    r"time_text_embed\.timestep_embedder\.linear_[12]"),
    weight_forms=("{}", "transformer.{}", "lycoris_{_}"))
Z_IMAGE = KeyMap("Lumina2", (
    r"(?:layers|context_refiner|noise_refiner)\.\d+\.(?:attention\.(?:qkv|out)|"
    r"feed_forward\.w[123]|adaLN_modulation\.0)",
    r"x_embedder|final_layer\.linear|final_layer\.adaLN_modulation\.1|cap_embedder\.1|"
    r"t_embedder\.mlp\.[02]"), _Z_IMAGE_TABLE, _LUMINA_FORMS)
KREA2 = KeyMap("Krea2", (
    r"(?:blocks|txtfusion\.layerwise_blocks|txtfusion\.refiner_blocks)\.\d+\.(?:attn\.(?:wq|wk|"
    r"wv|wo|gate)|mlp\.(?:gate|up|down))",
    r"first|tmlp\.[02]|tproj\.1|txtmlp\.[13]|txtfusion\.projector|last\.linear"),
    _KREA2_TABLE, _LUMINA_FORMS)

# comfy/utils.py unet_to_diffusers (SDXL): the diffusers UNet names its tables
# (UNET_MAP_ATTENTIONS, TRANSFORMER_BLOCKS, UNET_MAP_RESNET, UNET_MAP_BASIC) map, which the
# UNet branch spells `lora_unet_<d_>` and `lycoris_<d_>`, and `<d>` and `unet.<d>` with
# `.to_` written `.processor.to_` (and `.to_out.0` as `.processor.to_out`): old diffusers
# attention-processor names; so a diffusers name with `.to_` is mapped only in that form.
_SD_BLOCKS = r"(?:down_blocks\.\d+|up_blocks\.\d+|mid_block)"
_SD_NOT_ATTENTION = (
    _SD_BLOCKS + r"\.attentions\.\d+\.(?:proj_in|proj_out|norm|transformer_blocks\.\d+\.(?:"
    r"norm[123]|ff\.net\.0\.proj|ff\.net\.2))",
    _SD_BLOCKS + r"\.resnets\.\d+\.(?:conv1|time_emb_proj|conv2|conv_shortcut|norm1|norm2)",
    r"down_blocks\.\d+\.downsamplers\.0\.conv|up_blocks\.\d+\.upsamplers\.0\.conv|"
    r"(?:class_embedding|add_embedding|time_embedding)\.linear_[12]|conv_in|conv_norm_out|"
    r"conv_out")
_SD_PROCESSOR = (_SD_BLOCKS + r"\.attentions\.\d+\.transformer_blocks\.\d+\.attn[12]\."
                 r"processor\.(?:to_q|to_k|to_v|to_out)")
_SD_PLAIN_FORMS = tuple(_spell(form, name) for form in ("{}", "unet.{}")
                        for name in (*_SD_NOT_ATTENTION, _SD_PROCESSOR))
SDXL = KeyMap("SDXL", (
    r"(?:input_blocks\.\d+\.[01]|middle_block\.[012]|output_blocks\.\d+\.[0-2])\.(?:proj_in|"
    r"proj_out|transformer_blocks\.\d+\.(?:attn[12]\.(?:to_q|to_k|to_v|to_out\.0)|"
    r"ff\.net\.(?:0\.proj|2))|in_layers\.2|emb_layers\.1|out_layers\.3|skip_connection|op|conv)",
    r"time_embed\.[02]|label_emb\.0\.[02]|input_blocks\.0\.0|out\.2"), (
    _SD_BLOCKS + r"\.attentions\.\d+\.(?:proj_in|proj_out|norm|transformer_blocks\.\d+\.(?:"
    r"norm[123]|attn[12]\.(?:to_q|to_k|to_v|to_out\.0)|ff\.net\.0\.proj|ff\.net\.2))",
    _SD_BLOCKS + r"\.resnets\.\d+\.(?:conv1|time_emb_proj|conv2|conv_shortcut|norm1|norm2)",
    r"down_blocks\.\d+\.downsamplers\.0\.conv|up_blocks\.\d+\.upsamplers\.0\.conv|"
    r"(?:class_embedding|add_embedding|time_embedding)\.linear_[12]|conv_in|conv_norm_out|"
    r"conv_out"), ("lora_unet_{_}", "lycoris_{_}"), extra=_SD_PLAIN_FORMS)

# comfy/ldm/wan/model.py WanModel (T2V and I2V): its weights; comfy/lora.py has no WAN21
# branch, so only the generic forms map them.
WAN = KeyMap("WAN21", (
    r"blocks\.\d+\.(?:self_attn\.(?:q|k|v|o|norm_q|norm_k)|cross_attn\.(?:q|k|v|o|norm_q|"
    r"norm_k|k_img|v_img|norm_k_img)|norm3|ffn\.[02])",
    r"patch_embedding|text_embedding\.[02]|time_embedding\.[02]|time_projection\.1|"
    r"head\.head|img_emb\.proj\.[0134]"))

# SD 1.5 (comfy/supported_models.py SD15, a model_base.BaseModel): the same UNet branch over
# `unet_to_diffusers`, which builds its table from the loaded UNet's config (same commit), on
# openaimodel.py's UNet without SDXL's label_emb.
SD15 = KeyMap("SD15", SDXL.weights, SDXL.table, SDXL.table_forms, extra=SDXL.extra)

# comfy/ldm/ernie/model.py ErnieImageModel keeps diffusers' ErnieImageTransformer2DModel names;
# comfy/lora.py's ErnieImage branch adds `transformer.<k>` over them.
ERNIE_IMAGE = KeyMap("ErnieImage", (
    r"layers\.\d+\.(?:self_attention\.(?:to_q|to_k|to_v|to_out\.0|norm_q|norm_k)|"
    r"adaLN_sa_ln|adaLN_mlp_ln|mlp\.(?:gate_proj|up_proj|linear_fc2))",
    r"x_embedder\.proj|text_proj|time_embedding\.linear_[12]|adaLN_modulation\.1|"
    r"final_norm\.linear|final_linear"), weight_forms=("transformer.{}",))

# Anima (comfy/supported_models.py Anima, model_base.Anima over comfy/ldm/anima/model.py: the
# Cosmos-Predict2 MiniTrainDIT of comfy/ldm/cosmos/predict2.py plus `llm_adapter`): its weights;
# comfy/lora.py has no Anima branch in `model_lora_keys_unet`, so the generic map only.
ANIMA = KeyMap("Anima", (
    r"blocks\.\d+\.(?:(?:self_attn|cross_attn)\.(?:q_proj|k_proj|v_proj|output_proj|q_norm|"
    r"k_norm)|mlp\.layer[12]|adaln_modulation_(?:self_attn|cross_attn|mlp)\.[12])",
    r"x_embedder\.proj\.1|t_embedder\.1\.linear_[12]|t_embedding_norm|final_layer\.linear|"
    r"final_layer\.adaln_modulation\.[12]",
    r"llm_adapter\.(?:embed|out_proj|norm|blocks\.\d+\.(?:norm_self_attn|norm_cross_attn|"
    r"norm_mlp|mlp\.[02]|(?:self_attn|cross_attn)\.(?:q_proj|k_proj|v_proj|o_proj|q_norm|"
    r"k_norm)))"))
# FLUX.3: ComfyUI at 4f874c5e has no model for it (no comfy/ldm entry, nothing in
# comfy/model_detection.py or comfy/supported_models.py), so it loads no FLUX.3 LoRA key.
FLUX3 = KeyMap("none (no FLUX.3 model)", ())

# Qwen-Image 2.1: comfy/model_detection.py knows Qwen-Image by `txt_norm.weight` (2.1 has
# `txt_in.text_norm`), and no other detection matches its blocks: ComfyUI loads no 2.1 model,
# so its key map for one is empty (every key "lora key not loaded").
QWEN_IMAGE_21 = KeyMap("none (no Qwen-Image 2.1 model)", ())

# difftune family -> the ComfyUI model class that loads its denoiser (variants share it).
MAPS = {"flux": FLUX, "chroma": CHROMA, "flux2": FLUX2, "sd3": SD3, "sdxl": SDXL,
        "qwen_image": QWEN_IMAGE, "z_image": Z_IMAGE, "krea2": KREA2, "wan": WAN, "sd15": SD15,
        "anima": ANIMA, "flux3": FLUX3, "ernie_image": ERNIE_IMAGE,
        "qwen_image_21": QWEN_IMAGE_21}


def split_key(key: str) -> tuple[str, str]:
    """(module, tensor suffix) of a file key, by ComfyUI's tensor names; ("", key) if none."""
    for suffix in sorted(SUFFIXES, key=len, reverse=True):
        if key.endswith("." + suffix):
            return key[: -len(suffix) - 1], suffix
    return "", key


def unmapped(family: str, keys: list[str]) -> list[str]:
    """The keys of a file ComfyUI would not load for `family` ("lora key not loaded")."""
    keymap = MAPS[family]
    pattern = keymap.pattern()
    return sorted(k for k in keys
                  if not (m := split_key(k)[0]) or pattern.fullmatch(m) is None)
