"""Which difftune family (and variant) each trainer's own model names mean: one table per
trainer, so a new name is one line here and no reader branches on a family.

A value is (family, variant); variant None lets difftune choose it (from a diffusers folder's
model_index.json, else the family's default). Names whose models difftune does not train map
to None with nothing else: the import then stops and says so.
"""

from __future__ import annotations

Target = tuple[str, str | None]

# kohya sd-scripts: the config names no model; its network module (and flux_train_network's
# --model_type) tells the script that reads it.
KOHYA: dict[str, Target | None] = {
    "networks.lora_flux": ("flux", None),
    "networks.oft_flux": ("flux", None),
    "networks.lora_sd3": ("sd3", None),
    # train_network.py / sdxl_train_network.py share networks.lora; difftune trains SDXL and no
    # SD 1.x/2.x, so it is read as SDXL (a guess the report says).
    "networks.lora": ("sdxl", None),
    "networks.dylora": ("sdxl", None),
    "networks.lora_fa": ("sdxl", None),
    "networks.lora_lumina": None,
    "networks.lora_hunyuan_image": None,
    "networks.lora_anima": None,
    # flux_train_network.py --model_type
    "flux": ("flux", None),
    "chroma": ("chroma", None),
}

# ai-toolkit: model.arch (or the older is_flux / is_xl / is_v3 flags, see ai_toolkit.FLAGS).
AI_TOOLKIT: dict[str, Target | None] = {
    "flux": ("flux", None),
    "flex1": ("flux", None),
    "flux_kontext": ("flux", "kontext"),
    "chroma": ("chroma", None),
    "sd3": ("sd3", None),
    "sdxl": ("sdxl", None),
    "qwen_image": ("qwen_image", "base"),
    "qwen_image_edit": ("qwen_image", "edit"),
    "qwen_image_edit_plus": ("qwen_image", "edit-plus"),
    "zimage": ("z_image", None),
    "flux2": ("flux2", "dev"),
    "flux2_klein_4b": ("flux2", "klein"),
    "flux2_klein_9b": ("flux2", "klein"),
    "krea2": ("krea2", None),
    "sd1": None, "sd2": None, "pixart": None, "pixart_sigma": None, "auraflow": None,
    "lumina2": None, "hidream": None, "wan21": None, "wan22_14b": None, "wan22_5b": None,
    "omnigen2": None, "flex2": None, "chroma_radiance": None, "ltx2": None,
}

# OneTrainer: model_type (modules/util/enum/ModelType.py).
ONETRAINER: dict[str, Target | None] = {
    "FLUX_DEV_1": ("flux", None),
    "FLUX_2": ("flux2", None),
    "STABLE_DIFFUSION_3": ("sd3", None),
    "STABLE_DIFFUSION_35": ("sd3", None),
    "STABLE_DIFFUSION_XL_10_BASE": ("sdxl", None),
    "CHROMA_1": ("chroma", None),
    "QWEN": ("qwen_image", None),
    "Z_IMAGE": ("z_image", None),
    "KREA_2": ("krea2", None),
    "STABLE_DIFFUSION_15": None, "STABLE_DIFFUSION_15_INPAINTING": None,
    "STABLE_DIFFUSION_20": None, "STABLE_DIFFUSION_20_BASE": None,
    "STABLE_DIFFUSION_20_INPAINTING": None, "STABLE_DIFFUSION_20_DEPTH": None,
    "STABLE_DIFFUSION_21": None, "STABLE_DIFFUSION_21_BASE": None,
    "STABLE_DIFFUSION_XL_10_BASE_INPAINTING": None, "FLUX_FILL_DEV_1": None,
    "WUERSTCHEN_2": None, "STABLE_CASCADE_1": None, "PIXART_ALPHA": None, "PIXART_SIGMA": None,
    "SANA": None, "HUNYUAN_VIDEO": None, "HI_DREAM_FULL": None, "ANIMA": None, "ERNIE": None,
    "IDEOGRAM_4": None,
}

TABLES: dict[str, dict[str, Target | None]] = {
    "kohya": KOHYA, "ai-toolkit": AI_TOOLKIT, "onetrainer": ONETRAINER,
}

# kohya keys that only one script's parser has: a config without a network module is read as
# that script's (the name is a KOHYA key above).
KOHYA_KEYS: dict[str, str] = {
    "clip_g": "networks.lora_sd3",
    "t5xxl": "networks.lora_flux",
    "ae": "networks.lora_flux",
}
