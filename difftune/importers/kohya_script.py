"""Which kohya script a config of a shared network module (networks.lora) was written for.

networks.lora serves train_network.py (SD 1.x/2.x) and sdxl_train_network.py (SDXL), and a
kohya config does not record its script, so the importer reads what the config holds, most
telling first: `v2` (SD 2.x, which difftune does not train); the base model's own files where
they are local (a single file's tensor names, a diffusers folder's pipeline); the kohya_ss
GUI's `sdxl` flag; a key only one script takes; and, as a guess, the resolution nearest the
side each script's model was released at. Script names map to families through the families'
own `OTHER_TRAINERS` (importers/families.py), so no family is named here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from difftune.families import detect, registry
from difftune.importers.families import KOHYA, SCRIPT_KEYS, SDXL_FLAG, SHARED_SCRIPTS
from difftune.importers.notes import NoEquivalent, src
from difftune.importers.values import local, pair_side

# (script, the report's source, why it is a guess or None)
Script = tuple[str, str, str | None]
SD2 = "train_network.py --v2"  # a name KOHYA refuses: difftune does not train SD 2.x
# The kohya_ss GUI's config key saying its networks.lora run is SDXL's (a key, not a family).
GUI_FLAG = "sdxl"


def script(args: dict[str, Any], base: Path, resolution: Any) -> Script | None:
    """The script `args` (a flattened kohya config, paths relative to `base`) was written
    for, from its keys, its local model and `resolution` (its own or its dataset config's);
    None where nothing tells."""
    if args.get("v2"):
        return SD2, src("v2", args["v2"]), None
    model = args.get("pretrained_model_name_or_path")
    if model is not None and (found := _of_model(local(str(model), base))) is not None:
        return found, f"{src('pretrained_model_name_or_path', model)} (the model's own files)", \
            None
    if isinstance(args.get(GUI_FLAG), bool):
        return SDXL_FLAG[args[GUI_FLAG]], src(GUI_FLAG, args[GUI_FLAG]), None
    key = next((k for k in SCRIPT_KEYS if args.get(k)), None)
    if key is not None:
        return SCRIPT_KEYS[key], src(key, args[key]), f"only {SCRIPT_KEYS[key]} takes {key}"
    return _of_side(resolution)


def _of_model(path: Path) -> str | None:
    """The shared script whose family the local model at `path` is: a single file by its
    tensors' names, a diffusers folder by the pipeline its model_index.json names."""
    if path.is_file():
        families = {family for family, _ in detect.file_families(path)}
    elif (path / "model_index.json").is_file():
        try:
            pipeline = json.loads((path / "model_index.json").read_text(encoding="utf-8")
                                  ).get("_class_name")
        except (OSError, ValueError, AttributeError):
            return None
        families = {family for family in registry.names()
                    if any(s.pipeline_class == pipeline for _, s in registry.variant_specs(family))}
    else:
        return None
    return next((s for s in SHARED_SCRIPTS if (KOHYA.get(s) or ("",))[0] in families), None)


def _of_side(resolution: Any) -> Script | None:
    """A guess from the training resolution: the script whose model's released side is
    nearest (a tie: the smaller)."""
    if resolution is None:
        return None
    try:
        side = pair_side(resolution)
    except (NoEquivalent, ValueError, TypeError):
        return None
    found = min(SHARED_SCRIPTS, key=lambda s: (abs(SHARED_SCRIPTS[s] - side), SHARED_SCRIPTS[s]))
    return found, src("resolution", resolution), (
        f"the config does not name its script; its resolution is nearest the "
        f"{SHARED_SCRIPTS[found]} px of {found}'s models; change model.family if it is the other")
