"""The README's "Using the LoRA" section says what the code does: its table of layouts is the
family specs' (generated), and its diffusers snippet runs as written on a tiny FLUX.1 model
with a LoRA trained on it through the CLI, the LoRA changing the image it draws."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch
from diffusers import FluxPipeline
from PIL import Image

from difftune.families import guide
from difftune.families.flux.tiny import build_tiny_flux

from .conftest import train_cli

README = Path(__file__).resolve().parents[2] / "README.md"


def _block(name: str) -> str:
    found = re.search(rf"<!-- {name}:start -->\n(.*?)<!-- {name}:end -->", README.read_text(
        encoding="utf-8"), re.S)
    assert found is not None, name
    return found[1]


def test_the_layout_table_is_the_specs() -> None:
    assert _block("lora-layouts") == guide.layouts_table(), \
        "regenerate it: python -m difftune.families.guide"


def _sub(code: str, old: str, new: str) -> str:
    assert code.count(old) == 1, f"the README snippet no longer has {old!r}"
    return code.replace(old, new)


def test_the_diffusers_snippet_runs(tmp_path: Path, images: Path) -> None:
    code = _block("diffusers-snippet").removeprefix("```python\n").removesuffix("```\n")
    folder = tmp_path / "FLUX.1-dev"
    parts = {k: v for k, v in build_tiny_flux().items() if k != "t5_max_length"}
    FluxPipeline(**parts).save_pretrained(str(folder), safe_serialization=True)
    out = train_cli(tmp_path / "run", images, steps=2, fmt=None)
    picture = tmp_path / "my-subject.png"
    for old, new in (("/models/FLUX.1-dev", folder.as_posix()),
                     ("/runs/my-subject/my-subject.safetensors",
                      (out / "lora.safetensors").as_posix()),
                     ('pipe.to("cuda")', 'pipe.to("cpu")'),
                     ("height=1024, width=1024, num_inference_steps=28",
                      "height=64, width=64, num_inference_steps=2"),
                     ('"my-subject.png"', f'"{picture.as_posix()}"')):
        code = _sub(code, old, new)
    scope: dict = {}
    exec(compile(code, "README.md (diffusers snippet)", "exec"), scope)  # noqa: S102
    pipe = scope["pipe"]
    assert pipe.get_active_adapters() == ["my-subject"]
    drawn = np.asarray(Image.open(picture))
    pipe.set_adapters(["my-subject"], adapter_weights=[0.0])  # the LoRA off: another image
    base = pipe("a photo of sks dog", height=64, width=64, num_inference_steps=2,
                generator=torch.Generator("cpu").manual_seed(0)).images[0]
    assert drawn.shape == (64, 64, 3) and not np.array_equal(drawn, np.asarray(base))
