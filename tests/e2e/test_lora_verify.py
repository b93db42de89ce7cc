"""`difftune lora verify` against the real readers, on every family's tiny flavor.

Files are written the way each trainer writes them (`tests/lora_files.py`), plus difftune's
own layouts and keys no reader knows. ComfyUI: the keys verify says it drops are exactly the
ones its key map (`tests/comfy_keymap.py`, read from its source) leaves unloaded. diffusers:
the layers verify says it applies are exactly the PEFT layers its loader injects into the
pipeline's denoiser (a file it refuses applies none).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

import pytest
import torch
from peft.tuners.tuners_utils import BaseTunerLayer

from difftune.adapters.formats import save_lora
from difftune.families import registry
from difftune.lora_tools.verify import Verification, verify_file

from ..comfy_keymap import unmapped
from ..lora_files import TRAINERS, diffusers_lora, in_original_names, linear_modules, tiny

FAMILIES = list(registry.names())
# FLUX.1's single blocks are left out of its files: diffusers' kohya converter splits them by
# the full-size model's row counts, so a tiny model's file would fail as a whole there.
MODULES = {"flux": r"^(?!single_transformer_blocks)"}
# Chroma's distilled guidance network has no name in its kohya layout (difftune refuses to
# write it there).
NO_KOHYA_NAME = {"chroma": "transformer.distilled_guidance_layer."}


def written(family: str) -> dict[str, dict[str, torch.Tensor]]:
    """{spelling: tensors} of one LoRA in every trainer's spelling and difftune's layouts."""
    fam, comps = registry.get(family), tiny(family)
    state = diffusers_lora(family, linear_modules(family, MODULES.get(family, "")))
    files = {name: spell(state, fam.denoiser_prefix) for name, spell in TRAINERS.items()}
    carried = {k: v for k, v in state.items()
               if not k.startswith(NO_KOHYA_NAME.get(family, "-"))}
    for fmt in fam.formats:
        if fmt != "diffusers":
            files[fmt] = fam.lora_to_format(comps, carried, fmt, 4, 4.0)
    return files


Verified = dict[str, tuple[Path, dict[str, torch.Tensor], Verification]]


@pytest.fixture(scope="module")
def verified(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Verified]:
    """{spelling: (file, tensors, its verify report)} of a family's `written` files, saved and
    verified once for both readers' tests (verify reports every reader at once)."""
    folder = tmp_path_factory.mktemp("verified")

    @lru_cache(maxsize=None)
    def of(family: str) -> Verified:
        out: Verified = {}
        for name, tensors in written(family).items():
            path = save_lora(folder / f"{family}-{name}.safetensors", tensors, {})
            out[name] = (path, tensors, verify_file(path, family))
        return out
    return of


@pytest.mark.parametrize("family", FAMILIES)
def test_comfyui_drops_exactly_what_its_key_map_leaves_out(
        tmp_path: Path, family: str, verified: Callable[[str], Verified]) -> None:
    files = dict(verified(family))
    some = next(iter(files["diffusers"][1]))
    foreign = {"lora_unet_no_such_layer.lora_down.weight": torch.zeros(2, 2),
               some.replace("lora_A.weight", "lora_X.weight"): torch.zeros(2, 2)}
    path = save_lora(tmp_path / "foreign.safetensors", foreign, {})
    files["foreign"] = (path, foreign, verify_file(path, family))
    for name, (path, tensors, report) in files.items():
        comfy = report.results[0]
        assert comfy.program.startswith("ComfyUI")
        assert sorted(d.key for d in comfy.dropped) == unmapped(family, list(tensors)), name
        assert comfy.applied == len(tensors) - len(comfy.dropped)


def injected(pipe: object, denoiser: torch.nn.Module, path: Path) -> int:
    """How many layers of the denoiser diffusers' loader adapts from the file (0 when it
    refuses it); the pipeline is left without the LoRA."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pipe.load_lora_weights(str(path), adapter_name="verify")  # type: ignore[attr-defined]
        return sum(isinstance(m, BaseTunerLayer) for m in denoiser.modules())
    except (ValueError, KeyError, IndexError, NotImplementedError, AssertionError, RuntimeError):
        return 0  # diffusers refuses the file (some converters fail on keys they do not expect)
    finally:
        pipe.unload_lora_weights()  # type: ignore[attr-defined]


@pytest.mark.parametrize("family", FAMILIES)
def test_diffusers_applies_what_verify_counts(family: str,
                                             verified: Callable[[str], Verified]) -> None:
    comps = tiny(family)
    pipe = registry.get(family).pipeline(comps)
    for name, (path, _, report) in verified(family).items():
        counted = report.results[1]
        assert counted.program == "diffusers"
        assert counted.applied == injected(pipe, comps.denoiser, path), name


def test_lycoris_kinds_are_not_claimed_for_diffusers(tmp_path: Path) -> None:
    """diffusers reads a Z-Image LoKr under `diffusion_model.` (its LoKr converter): verify
    neither counts nor drops such modules for diffusers, it lists them as not known."""
    tensors = {"diffusion_model.layers.0.attention.to_k.lokr_w1": torch.ones(2, 2),
               "diffusion_model.layers.0.attention.to_k.lokr_w2": torch.ones(32, 32)}
    comps = tiny("z_image")
    pipe = registry.get("z_image").pipeline(comps)
    path = save_lora(tmp_path / "lokr.safetensors", tensors, {})
    assert injected(pipe, comps.denoiser, path) == 1  # the fact the rules leave out
    result = verify_file(path, "z_image").results[1]
    assert (result.applied, result.dropped) == (0, [])
    assert result.unmodelled == ["diffusion_model.layers.0.attention.to_k"]


def test_diffusers_reads_sd15_original_names_only_outside_the_blocks(tmp_path: Path) -> None:
    """An SD 1.5 file in the original (LDM) names: diffusers' loader applies its time
    embedding and nothing in the numbered blocks, as verify counts."""
    fam, comps = registry.get("sd15"), tiny("sd15")
    state = diffusers_lora("sd15", linear_modules("sd15", r"attn1\.to_q$|time_embedding"))
    path = save_lora(tmp_path / "ldm.safetensors", in_original_names(
        "sd15", fam.lora_to_format(comps, state, "kohya", 4, 4.0)), {})
    counted = verify_file(path, "sd15").results[1]
    assert counted.applied == injected(fam.pipeline(comps), comps.denoiser, path) == 2
