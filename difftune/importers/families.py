"""Which difftune family (and variant) each trainer's own model names mean: one table per
trainer, so no reader branches on a family.

A value is (family, variant); variant None lets difftune choose it (from a diffusers folder's
model_index.json, else the family's default). Names whose models difftune does not train map
to None with nothing else: the import then stops and says so. The family names come from the
families' own spec modules, so a new family brings its names with it.
"""

from __future__ import annotations

import importlib

from difftune.families import registry

Target = tuple[str, str | None]

# Each family's own names in the other trainers are declared in its spec module
# (`OTHER_TRAINERS`); here only the names of models difftune does not train, which stop an
# import with that said. kohya sd-scripts' config names no model: its network module (and
# flux_train_network's --model_type) tells the script; ai-toolkit names it by model.arch or an
# older is_* flag; OneTrainer by model_type (modules/util/enum/ModelType.py).
NOT_TRAINED: dict[str, tuple[str, ...]] = {
    "kohya": ("networks.lora_lumina", "networks.lora_hunyuan_image", "train_network.py --v2"),
    "ai-toolkit": (
        "sd2", "pixart", "pixart_sigma", "auraflow", "lumina2", "hidream",
        "wan22_5b", "omnigen2", "flex2", "chroma_radiance", "ltx2",
        "is_v2", "is_lumina2", "is_pixart", "is_pixart_sigma", "is_auraflow"),
    "onetrainer": (
        "STABLE_DIFFUSION_15_INPAINTING", "STABLE_DIFFUSION_20",
        "STABLE_DIFFUSION_20_BASE", "STABLE_DIFFUSION_20_INPAINTING",
        "STABLE_DIFFUSION_20_DEPTH", "STABLE_DIFFUSION_21", "STABLE_DIFFUSION_21_BASE",
        "STABLE_DIFFUSION_XL_10_BASE_INPAINTING", "FLUX_FILL_DEV_1", "WUERSTCHEN_2",
        "STABLE_CASCADE_1", "PIXART_ALPHA", "PIXART_SIGMA", "SANA", "HUNYUAN_VIDEO",
        "HI_DREAM_FULL", "IDEOGRAM_4"),
}

# Names one script serves for several models, read as the one difftune trains where nothing
# else in the config tells (kohya.py `_script`): the import report marks the family a guess,
# with this reason.
GUESSED: dict[str, str] = {
    name: "networks.lora serves SD 1.x/2.x and SDXL and nothing in the config tells which; "
          "difftune trains SDXL unless model.family is changed to SD 1.5's"
    for name in ("networks.lora", "networks.dylora", "networks.lora_fa")}
# The scripts those network modules serve (each named in its family's OTHER_TRAINERS), with
# the side their models were released at: a kohya config does not record its script (its
# --output_config writes the arguments alone), so the importer tells them apart from what
# the config holds.
SHARED_SCRIPTS: dict[str, int] = {"train_network.py": 512, "sdxl_train_network.py": 1024}
# What only one of them reads: the kohya_ss GUI's `sdxl` flag (it runs the SDXL script when
# set), and sdxl_train_util's own arguments, which train_network.py does not take.
SDXL_FLAG = {True: "sdxl_train_network.py", False: "train_network.py"}
SCRIPT_KEYS: dict[str, str] = dict.fromkeys(
    ("cache_text_encoder_outputs", "cache_text_encoder_outputs_to_disk",
     "disable_mmap_load_safetensors"), "sdxl_train_network.py")


def _table(trainer: str) -> dict[str, Target | None]:
    """`trainer`'s names -> (family, variant), from every registered family's spec module,
    and -> None for the models difftune does not train."""
    table: dict[str, Target | None] = dict.fromkeys(NOT_TRAINED[trainer])
    for family, (module, _) in registry.FAMILIES.items():
        names = getattr(importlib.import_module(module), "OTHER_TRAINERS", {})
        table |= {name: (family, variant) for name, variant in names.get(trainer, {}).items()}
    return table


TABLES: dict[str, dict[str, Target | None]] = {trainer: _table(trainer) for trainer in NOT_TRAINED}
KOHYA = TABLES["kohya"]

# kohya keys that only one script's parser has: a config without a network module is read as
# that script's (the name is a KOHYA key above).
KOHYA_KEYS: dict[str, str] = {
    "clip_g": "networks.lora_sd3",
    "t5xxl": "networks.lora_flux",
    "ae": "networks.lora_flux",
}
