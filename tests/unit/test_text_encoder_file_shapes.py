"""A single-file text encoder whose tensors do not all fit the encoder its shapes describe
(one tensor widened, as a damaged file or one mixing two models has): every family's loader
refuses it with the config field, the file and the shapes (ModelFileError, exit 2), where
transformers raised a RuntimeError about `ignore_mismatched_sizes`. The same file unspoiled
loads, so the refusal is about the one tensor."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from safetensors.torch import save_file

from difftune.errors import ModelFileError

F32 = torch.float32


def _flux2(path: Path) -> Callable[[], Any]:
    from difftune.families.flux2.single import load_text_encoder_file

    return lambda: load_text_encoder_file(path, F32, "klein")


def _z_image(path: Path) -> Callable[[], Any]:
    from difftune.families.z_image.files import load_text_encoder_file

    return lambda: load_text_encoder_file(path, F32)


def _qwen_image(path: Path) -> Callable[[], Any]:
    from difftune.families.qwen_image.files import load_text_encoder_file

    return lambda: load_text_encoder_file(path, F32)


def _krea2(path: Path) -> Callable[[], Any]:
    from difftune.families.krea2.single import load_text_encoder_file

    return lambda: load_text_encoder_file(path, F32)


def _ernie_image(path: Path) -> Callable[[], Any]:
    from difftune.families.ernie_image.files import load_text_encoder_file

    return lambda: load_text_encoder_file(path, F32)


def _clip(path: Path) -> Callable[[], Any]:
    from difftune.families.common.components import load_clip_file
    from difftune.families.flux.tiny import build_tiny_flux

    return lambda: load_clip_file(path, F32, build_tiny_flux()["tokenizer"])


def _t5(path: Path) -> Callable[[], Any]:
    from difftune.families.common.components import load_t5_file

    return lambda: load_t5_file(path, F32)


def _tiny(family: str, part: str) -> dict[str, torch.Tensor]:
    """The tiny flavor's `part` (a text encoder) as a state dict of contiguous tensors."""
    from difftune.families.ernie_image.tiny import build_tiny_ernie_image
    from difftune.families.flux.tiny import build_tiny_flux
    from difftune.families.flux2.tiny import build_tiny_flux2
    from difftune.families.krea2.tiny import build_tiny_krea2
    from difftune.families.qwen_image.tiny import build_tiny_qwen_image
    from difftune.families.z_image.tiny import build_tiny_z_image

    build = {"flux2": lambda: build_tiny_flux2("klein"), "z_image": build_tiny_z_image,
             "qwen_image": build_tiny_qwen_image, "krea2": build_tiny_krea2,
             "flux": build_tiny_flux, "ernie_image": build_tiny_ernie_image}[family]
    # A tied tensor (an LM head, T5's embeddings) saved once, as released files hold it.
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for key, value in build()[part].state_dict().items():
        if value.data_ptr() not in seen:
            seen.add(value.data_ptr())
            out[key] = value.contiguous()
    return out


CASES = [  # family, component, loader, field, a tensor no size is read from
    ("flux2", "text_encoder", _flux2, "model.text_encoder", "layers.0.mlp.down_proj.weight"),
    ("z_image", "text_encoder", _z_image, "model.text_encoder", "layers.0.mlp.down_proj.weight"),
    ("qwen_image", "text_encoder", _qwen_image, "model.text_encoder",
     "layers.0.mlp.down_proj.weight"),
    ("krea2", "text_encoder", _krea2, "model.text_encoder", "layers.0.mlp.down_proj.weight"),
    ("flux", "text_encoder", _clip, "model.clip_l", "layers.0.mlp.fc2.weight"),
    ("flux", "text_encoder_2", _t5, "model.t5", "block.0.layer.1.DenseReluDense.wo.weight"),
    # a bare Mistral3Model's state (its vision tower's tensors beside the language model's)
    ("ernie_image", "text_encoder", _ernie_image, "model.text_encoder",
     "layers.0.mlp.down_proj.weight"),
]


@pytest.mark.parametrize("family,part,loader,field,spoiled", CASES,
                         ids=[f"{c[0]}-{c[3]}" for c in CASES])
def test_a_misshapen_text_encoder_file_is_refused(tmp_path: Path, family: str, part: str,
                                                  loader: Callable[[Path], Callable[[], Any]],
                                                  field: str, spoiled: str) -> None:
    state = _tiny(family, part)
    good, bad = tmp_path / "good.safetensors", tmp_path / "bad.safetensors"
    save_file(state, str(good))
    loader(good)()  # the file as it was loads
    key = next(k for k in state if k.endswith(spoiled) and "visual" not in k)
    rows, cols = state[key].shape
    save_file({**state, key: torch.zeros(rows, cols + 3)}, str(bad))
    with pytest.raises(ModelFileError) as err:
        loader(bad)()
    text = str(err.value)
    assert text.startswith(f"{field} = {bad}: "), text
    assert f"is ({rows}, {cols + 3}), expected ({rows}, {cols})" in text, text
