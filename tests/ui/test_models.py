"""The model picker's scan (ui/models.py): each family's tiny flavor, saved as a diffusers
folder and as a single denoiser file under a name that says nothing (or lies), is recognised
from what the files hold; files no family's denoiser fits are "unknown"."""

from __future__ import annotations

import importlib
import inspect
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from difftune.families import detect, registry
from difftune.ui import models
from difftune.ui.security import Roots
from tests.unit.layouts import to_bfl

# (family, tiny variant, the variant its weights alone tell, the folder's variant)
FLAVORS = [("flux", None, None, "base"), ("sd3", None, None, None), ("sdxl", None, None, None),
           ("chroma", None, None, None), ("z_image", None, None, None),
           ("qwen_image", "edit", None, "edit"), ("flux2", "klein", "klein", "klein"),
           ("flux2", "dev", "dev", "dev"), ("krea2", None, None, None),
           ("wan", "2.1-t2v-1.3b", None, None), ("sd15", None, None, None),
           ("anima", None, None, None)]
FLAVORS.append(("ernie_image", None, None, None))
# Wan 2.2 A14B's folder holds both experts: the variant that trains both (weights alone: no)
FLAVORS += [("wan", "2.2-t2v-a14b", None, "2.2-t2v-a14b"),
            *(pytest.param(family, None, None, None, marks=pytest.mark.full_only)
              for family in ("flux3", "qwen_image_21"))]


def _tiny(family: str, variant: str | None) -> dict[str, Any]:
    module = importlib.import_module(f"difftune.families.{family}.tiny")
    build = next(f for n, f in vars(module).items() if n.startswith("build_tiny_"))
    return build(variant) if variant is not None else build()


def _save_folder(family: str, variant: str | None, tiny: dict[str, Any], path: Path) -> None:
    """The tiny flavor saved by its diffusers pipeline, as `from_pretrained` reads it."""
    import diffusers

    pipeline = getattr(diffusers, registry.spec(family, variant).pipeline_class)
    if issubclass(pipeline, diffusers.ModularPipeline):  # components by its blocks' names
        pipe = pipeline(blocks=getattr(diffusers, pipeline.default_blocks_name)())
        names = {c.name for c in pipe.blocks.expected_components}
        pipe.update_components(**{k: v for k, v in tiny.items() if k in names})
        pipe.save_pretrained(str(path))  # modular_model_index.json
        return
    wanted = inspect.signature(pipeline.__init__).parameters
    args = {k: v for k, v in tiny.items() if k in wanted}
    # components no tiny flavor builds (SD 1.5's safety checker and feature extractor)
    args |= {k: None for k, p in wanted.items()
             if k not in args and k != "self" and p.default is p.empty}
    pipeline(**args).save_pretrained(str(path), safe_serialization=True)


def _denoiser(tiny: dict[str, Any]) -> dict[str, torch.Tensor]:
    module = tiny.get("transformer") or tiny["unet"]
    return {k: v.contiguous() for k, v in module.state_dict().items()}


@pytest.mark.parametrize(("family", "variant", "by_weights", "by_folder"), FLAVORS)
def test_each_family_is_recognised_from_its_files(tmp_path: Path, family: str,
                                                  variant: str | None, by_weights: str | None,
                                                  by_folder: str | None) -> None:
    tiny = _tiny(family, variant)
    _save_folder(family, variant, tiny, tmp_path / "some folder")
    save_file(_denoiser(tiny), str(tmp_path / "renamed.safetensors"))
    found = {Path(f.path).name: f for f in models.scan(Roots.of([tmp_path]))}
    folder, single = found["some folder"], found["renamed.safetensors"]
    assert (folder.kind, folder.family, folder.variant) == ("folder", family, by_folder)
    assert {k: v for k, v in folder.fields.items() if v is not None} == {
        "model.family": family, **({"model.variant": by_folder} if by_folder else {}),
        "model.path": str(tmp_path / "some folder")}
    assert folder.fields["model.transformer"] is None  # a single file named before is unset
    assert (single.kind, single.family, single.variant) == ("file", family, by_weights)
    assert single.fields["model.transformer"] == str(tmp_path / "renamed.safetensors")
    assert not any(Path(f.path).is_relative_to(tmp_path / "some folder") for f in found.values()
                   if f.kind == "file")  # a model folder is not entered


def test_original_layout_and_unknown_files(tmp_path: Path) -> None:
    """FLUX.1 in BFL's layout, prefixed as ComfyUI keeps it, under another family's name, is
    FLUX.1's; an autoencoder, random tensors and a file that is no safetensors are unknown."""
    tiny = _tiny("flux", None)
    bfl = {f"model.diffusion_model.{k}": v.contiguous()
           for k, v in to_bfl(tiny["transformer"].state_dict()).items()}
    save_file(bfl, str(tmp_path / "sd_xl_base_1.0.safetensors"))
    save_file({k: v.contiguous() for k, v in tiny["vae"].state_dict().items()},
              str(tmp_path / "flux1-dev.safetensors"))
    save_file({"weight": torch.zeros(2)}, str(tmp_path / "random.safetensors"))
    (tmp_path / "junk.safetensors").write_bytes(b"\xff" * 64)
    (tmp_path / "deep" / "a" / "b" / "c" / "d" / "e").mkdir(parents=True)
    save_file(bfl, str(tmp_path / "deep" / "a" / "b" / "c" / "d" / "e" / "x.safetensors"))
    found = {Path(f.path).name: f for f in models.scan(Roots.of([tmp_path]), depth=3)}
    assert (found["sd_xl_base_1.0.safetensors"].family,
            found["sd_xl_base_1.0.safetensors"].variant) == ("flux", None)
    for name in ("flux1-dev.safetensors", "random.safetensors", "junk.safetensors"):
        assert found[name].family == models.UNKNOWN and found[name].fields == {}, name
    assert "x.safetensors" not in found  # deeper than the scan goes
    assert len(models.scan(Roots.of([tmp_path]), entries=2)) <= 2


def test_wan_in_its_original_names_is_wans(tmp_path: Path) -> None:
    """A Wan transformer as ComfyUI keeps it (Wan's own names, prefixed) is Wan's."""
    from difftune.families.wan.files import single_file_layout
    from difftune.files.single import write_layout

    model = _tiny("wan", None)["transformer"]
    write_layout(tmp_path / "flux1-dev.safetensors", single_file_layout(model),
                 model.state_dict(), torch.float32)
    found = models.scan(Roots.of([tmp_path]))
    assert [(f.family, f.variant) for f in found] == [("wan", None)]


def test_a_huge_header_is_not_read(tmp_path: Path) -> None:
    path = tmp_path / "huge.safetensors"
    path.write_bytes((detect.MAX_HEADER + 1).to_bytes(8, "little") + b"{}")
    found = models.recognise_file(path)
    assert found.family == models.UNKNOWN and "more than" in found.why


def test_a_folder_of_another_pipeline_is_unknown(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "model_index.json").write_text(json.dumps(
        {"_class_name": "PixArtSigmaPipeline"}))
    assert models.recognise_folder(tmp_path / "m").family == models.UNKNOWN


def test_a_model_index_linked_outside_the_roots_is_not_read(tmp_path: Path) -> None:
    (tmp_path / "root" / "m").mkdir(parents=True)
    (tmp_path / "index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    (tmp_path / "root" / "m" / "model_index.json").symlink_to(tmp_path / "index.json")
    [found] = models.scan(Roots.of([tmp_path / "root"]))
    assert (found.family, found.fields) == (models.UNKNOWN, {})
    assert "leads outside the folders this app serves" in found.why


def test_sd15_and_sdxl_original_checkpoints_are_told_apart(tmp_path: Path) -> None:
    """The LDM-layout UNets of both: SD 1.5's first level has attention and no added
    conditioning (label_emb), SDXL's the reverse."""
    from tests.unit.test_sd_files import to_sgm_unet

    for family in ("sd15", "sdxl"):
        save_file(to_sgm_unet(_tiny(family, None)["unet"]), str(tmp_path / f"{family}.safetensors"))
    found = {Path(f.path).stem: f.family for f in models.scan(Roots.of([tmp_path]))}
    assert found == {"sd15": "sd15", "sdxl": "sdxl"}
