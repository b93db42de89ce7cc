"""Which trainer most likely wrote a LoRA file, from its metadata and key spelling.

Each rule is (what it looks at, the value, the trainer), checked in order; metadata outranks
key names. The names are the ones each tool documents or writes: kohya sd-scripts'
`ss_network_module` (`networks.lora*`), musubi-tuner's own network modules, LyCORIS's kohya
module, ai-toolkit's `software` entry and its `diffusion_model.` PEFT keys, OneTrainer's
`lora_transformer_` names, SimpleTuner's LyCORIS `lycoris_` names, diffusers' (and PEFT's)
`transformer.`/`unet.` names.
"""

from __future__ import annotations

# (metadata key, text its value contains ("": the key present), trainer). difftune's own
# files also carry the `ss_network_module` of the tool whose layout they share (kohya's,
# musubi-tuner's), so its `difftune.*` entries are looked at first.
METADATA_RULES: tuple[tuple[str, str, str], ...] = (
    ("difftune.format", "", "difftune"),
    ("software", "ai-toolkit", "ai-toolkit"),
    ("ss_network_module", "lycoris.kohya", "LyCORIS (kohya sd-scripts, or difftune)"),
    ("ss_network_module", "networks.lora_qwen_image", "musubi-tuner (or difftune)"),
    ("ss_network_module", "networks.lora_wan", "musubi-tuner"),
    ("ss_network_module", "networks.lora_hunyuan_video", "musubi-tuner"),
    ("ss_network_module", "networks.lora_framepack", "musubi-tuner"),
    ("ss_network_module", "networks.", "kohya sd-scripts (or difftune)"),
)
# (module spelling prefix, tensor name or "" for any, trainer)
KEY_RULES: tuple[tuple[str, str, str], ...] = (
    ("lora_transformer_", "", "OneTrainer"),
    ("lycoris_", "", "SimpleTuner (LyCORIS)"),
    ("diffusion_model.", "lora_A.weight", "ai-toolkit"),
    ("diffusion_model.", "lora_down.weight", "ComfyUI-style (e.g. ComfyUI's LoRA save)"),
    ("lora_unet_", "", "kohya sd-scripts or musubi-tuner"),
    ("transformer.", "", "diffusers / PEFT (SimpleTuner, diffusers' scripts)"),
    ("unet.", "", "diffusers / PEFT (SimpleTuner, diffusers' scripts)"),
    ("base_model.model.", "", "PEFT (get_peft_model_state_dict)"),
)


def likely_trainer(metadata: dict[str, str], spellings: set[tuple[str, str]]
                   ) -> tuple[str, str]:
    """(trainer, the evidence) for a file's metadata and its modules' (prefix, tensor name)
    pairs; ("unknown", "") where no rule fits."""
    for key, text, trainer in METADATA_RULES:
        if key in metadata and text in metadata[key]:
            return trainer, f"metadata {key} = {metadata[key][:60]}"
    for prefix, tensor, trainer in KEY_RULES:
        if any(p == prefix and (not tensor or t == tensor) for p, t in spellings):
            return trainer, f"keys spelled {prefix}<module>" + (f".{tensor}" if tensor else "")
    return "unknown", ""
