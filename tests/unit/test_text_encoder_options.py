"""Text-encoder options: config checks per family, cache keys and embeddings of mask / clip skip."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from difftune import families
from difftune.cache import MemoryStore
from difftune.cache.sources import TextSource
from difftune.config import load_config
from difftune.errors import ConfigError
from difftune.families.base import Components
from difftune.families.common.text import EncodeOptions
from difftune.families.flux.tiny import build_tiny_flux
from difftune.families.sdxl.tiny import build_tiny_sdxl

BASE = """
[model]
family = "{family}"
flavor = "tiny"
{model}

[adapter]
{adapter}

[[datasets]]
path = "images"
resolution = 64
min_side = 32
max_side = 128

[save]
dir = "out"
format = "{fmt}"
"""


def load(tmp_path: Path, family: str, adapter: str = "", model: str = "",
         fmt: str = "diffusers") -> object:
    path = tmp_path / "run.toml"
    path.write_text(BASE.format(family=family, adapter=adapter, model=model, fmt=fmt))
    return load_config(path)


def test_valid_text_encoder_settings(tmp_path: Path) -> None:
    cfg = load(tmp_path, "flux", 'text_encoders = ["clip_l", "t5"]\ntext_encoder_lr = 1e-5',
               "t5_mask = true")
    assert cfg.adapter.text_encoders == ["clip_l", "t5"] and cfg.model.t5_mask
    assert "q_proj" in cfg.adapter.text_encoder_targets and "wo" in cfg.adapter.text_encoder_targets
    cfg = load(tmp_path, "sdxl", 'text_encoders = ["clip_l", "clip_g"]', "clip_skip = 1",
               fmt="kohya")
    assert cfg.model.clip_skip == 1


@pytest.mark.parametrize("family, adapter, model, fmt, needle", [
    ("sdxl", 'text_encoders = ["t5"]', "", "diffusers", "choose from clip_l, clip_g"),
    ("flux", 'text_encoders = ["clip_g"]', "", "diffusers", "choose from clip_l, t5"),
    ("sdxl", "", "t5_mask = true", "diffusers", "no T5 encoder"),
    ("flux", "", "clip_skip = 1", "diffusers", "nothing to skip"),
    ("flux", 'text_encoders = ["clip_l"]', "", "kohya", "transformer only"),
    ("sd3", 'text_encoders = ["t5"]', "", "kohya", "no kohya key layout"),
])
def test_unsupported_text_encoder_settings_rejected(tmp_path: Path, family: str, adapter: str,
                                                    model: str, fmt: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        load(tmp_path, family, adapter, model, fmt)


def _source(family: str, options: EncodeOptions) -> TextSource:
    fam = families.get(family)
    parts = build_tiny_flux() if family == "flux" else build_tiny_sdxl()
    encoders = ("text_encoder", "text_encoder_2")  # both tiny flavors' first two encoders
    names = [s.name for s in fam.text_encoders]
    comps = Components(
        denoiser=torch.nn.Linear(1, 1), vae=torch.nn.Linear(1, 1),
        text_encoders={n: parts[e].eval() for n, e in zip(names, encoders)},
        tokenizers={n: parts[e.replace("text_encoder", "tokenizer")] for n, e in zip(names, encoders)},
        scheduler=None, name="t", fingerprint="t",
        extras={"max_length": {"t5": parts["t5_max_length"]}} if "t5_max_length" in parts else {})
    return TextSource(fam, comps, MemoryStore(), options)


def test_t5_mask_changes_t5_key_and_embeddings() -> None:
    plain, masked = _source("flux", EncodeOptions()), _source("flux", EncodeOptions(t5_mask=True))
    assert plain._key("t5", "a cat")[0] != masked._key("t5", "a cat")[0]
    assert plain._key("clip_l", "a cat")[0] == masked._key("clip_l", "a cat")[0]
    a, b = plain.get(["a cat"]), masked.get(["a cat"])
    assert not torch.allclose(a.tensors["prompt_embeds"], b.tensors["prompt_embeds"])
    assert torch.equal(a.tensors["pooled_prompt_embeds"], b.tensors["pooled_prompt_embeds"])


def test_clip_skip_changes_sdxl_embeddings_and_keys() -> None:
    plain, skip = _source("sdxl", EncodeOptions()), _source("sdxl", EncodeOptions(clip_skip=1))
    for name in ("clip_l", "clip_g"):
        assert plain._key(name, "a cat")[0] != skip._key(name, "a cat")[0]
    a, b = plain.get(["a cat"]), skip.get(["a cat"])
    assert not torch.allclose(a.tensors["prompt_embeds"], b.tensors["prompt_embeds"])
    # As in diffusers, the pooled output is the final layer's whatever the skip.
    assert torch.equal(a.tensors["pooled_prompt_embeds"], b.tensors["pooled_prompt_embeds"])
    # The per-encoder cache rebuilds what the family's own encode_text gives.
    direct = skip.family.encode_text(skip.comps, ["a cat"], EncodeOptions(clip_skip=1))
    assert torch.equal(direct.tensors["prompt_embeds"], b.tensors["prompt_embeds"])
