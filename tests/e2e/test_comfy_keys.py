"""Every key of every denoiser LoRA file difftune writes is one ComfyUI loads (issue 29).

Per family and adapter kind, a prepared tiny run (`adapter.targets = "all_linear"`, the
family's default layout) is saved through the run's own writer, and each key of the file is
looked up in ComfyUI's key map for that model (`tests/comfy_keymap.py`, ComfyUI's rules as
data): a key outside it is one ComfyUI reports as "lora key not loaded" and never applies.

Tiers: a file's module names are a family fact of its layout (the family's default LoRA
layout for a plain LoRA; the LyCORIS layout, the same for DoRA, LoCon, LoHa and LoKr), and its
tensor names a fact of the adapter kind, the same for every family. By default every family
checks its plain LoRA and one LyCORIS kind, the kinds taken in turn along the families
(`default_kind`: each kind on every fourth family, so every kind on several families and
every family's two layouts); a family registered later joins with its two cells. The other
family x kind cells run with `pytest --full`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ..comfy_keymap import MAPS, unmapped
from .test_lycoris_files import adapted_run

KINDS = {"lora": (), "dora": ("adapter.dora=true",), "locon": ('adapter.type="locon"',),
         "loha": ('adapter.type="loha"',), "lokr": ('adapter.type="lokr"',)}


def saved_file(folder: Path, images: Path, family: str, *sets: str) -> dict[str, torch.Tensor]:
    """The tensors of the file a prepared run of `family` writes in the family's default
    layout (adapter set to random values, as training would leave it)."""
    return load_file(str(adapted_run(folder, images, family, *sets)[1]))


LYCORIS_KINDS = [k for k in KINDS if k != "lora"]
# The families ComfyUI loads a model of (an empty key map: it loads none, see comfy_keymap).
LOADED = [family for family, keymap in MAPS.items() if keymap.weights]


def default_kind(family: str) -> str:
    """The LyCORIS kind `family` checks by default: the kinds in turn along LOADED's order."""
    return LYCORIS_KINDS[LOADED.index(family) % len(LYCORIS_KINDS)]


CELLS = [pytest.param(family, kind, id=f"{family}-{kind}",
                      marks=() if kind in ("lora", default_kind(family)) else pytest.mark.full_only)
         for family in LOADED for kind in KINDS]


@pytest.mark.parametrize("family, kind", CELLS)
def test_every_key_is_in_comfyuis_key_map(tmp_path: Path, images: Path, family: str,
                                          kind: str) -> None:
    tensors = saved_file(tmp_path, images, family, *KINDS[kind])
    assert tensors
    assert unmapped(family, list(tensors)) == []


def test_flux2_dev_keys_are_in_comfyuis_key_map(tmp_path: Path, images: Path) -> None:
    """dev adds the guidance embedder: named for ComfyUI in the LoRA and LyCORIS files."""
    sets = ('model.variant="dev"', 'adapter.target_modules=["guidance_embedder.linear_1", '
            '"single_stream_modulation.linear", "to_q"]')
    for name, kind in (("lora", ()), ("lokr", ('adapter.type="lokr"',))):
        tensors = saved_file(tmp_path / name, images, "flux2", *sets, *kind)
        assert any("guidance_in" in k for k in tensors)
        assert unmapped("flux2", list(tensors)) == []
