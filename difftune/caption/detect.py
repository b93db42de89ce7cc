"""Which captioner a local folder holds, read from its files, never from the network.

A transformers folder names its model in config.json (`model_type`); a diffusers folder of a
family whose text encoder is a vision-language model (Qwen-Image's Qwen2.5-VL, Krea 2's
Qwen3-VL) holds it in text_encoder/ with the tokenizer beside it in tokenizer/ (and, for edit
models, processor/); a WD14-style tagger is model.onnx with selected_tags.csv.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from difftune.errors import ModelFileError

# model_type -> the kind of captioner (how it is prompted and its outputs decoded).
KINDS = {"qwen2_vl": "qwen_vl", "qwen2_5_vl": "qwen_vl", "qwen3_vl": "qwen_vl",
         "florence2": "florence2", "llava": "llava"}
EXPECTED = ("a Qwen2.5-VL or Qwen3-VL instruct folder (or a Qwen-Image / Krea 2 diffusers folder, "
            "whose text_encoder/ is one), a Florence-2 folder, a LLaVA (JoyCaption) folder, or a "
            "WD14 tagger folder (model.onnx + selected_tags.csv)")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json")


@dataclass(frozen=True)
class CaptionerFiles:
    """Where a captioner's parts are: `kind` ("qwen_vl", "florence2", "llava", "wd14"),
    `weights` (the folder of config.json and weights, or the tagger's folder), `tokenizer` and
    `processor` (folders to read them from; the same as `weights` for a plain transformers
    folder), and `config` (config.json's content; {} for a tagger)."""

    kind: str
    weights: Path
    tokenizer: Path
    processor: Path
    config: dict


def _has_tokenizer(folder: Path) -> bool:
    return any((folder / name).is_file() for name in TOKENIZER_FILES)


def _read_config(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ModelFileError(f"{path} cannot be read as JSON ({err}); the model folder is "
                             "incomplete: copy it again") from None


def _tagger(folder: Path) -> CaptionerFiles | None:
    """A WD14-style tagger folder, None when there is no model.onnx."""
    if not (folder / "model.onnx").is_file():
        return None
    if not (folder / "selected_tags.csv").is_file():
        raise ModelFileError(f"{folder} has model.onnx but no selected_tags.csv; a WD14 tagger "
                             "needs its tag list beside the model: copy selected_tags.csv there")
    return CaptionerFiles("wd14", folder, folder, folder, {})


def _transformers(folder: Path) -> CaptionerFiles | None:
    """A transformers folder, or a diffusers folder whose text_encoder/ is one (tokenizer/ and
    processor/ beside it), or a text_encoder/ folder given directly (tokenizer/ beside it)."""
    if (folder / "config.json").is_file():
        weights = folder
        tokenizer = folder if _has_tokenizer(folder) else folder.parent / "tokenizer"
    elif (folder / "text_encoder" / "config.json").is_file():
        weights, tokenizer = folder / "text_encoder", folder / "tokenizer"
    else:
        return None
    config = _read_config(weights / "config.json")
    kind = KINDS.get(str(config.get("model_type")))
    if kind is None:
        arch = ", ".join(config.get("architectures") or []) or "no architectures"
        raise ModelFileError(
            f"{folder} is not a captioning model: its config.json names model_type "
            f"{config.get('model_type')!r} ({arch}); give {EXPECTED}")
    if not _has_tokenizer(tokenizer):
        raise ModelFileError(f"{folder}: no tokenizer found (looked in {tokenizer}); a "
                             "captioner needs its tokenizer files beside its config.json, or in "
                             "tokenizer/ of a diffusers folder")
    base = weights.parent if weights.name == "text_encoder" else weights
    processor = base / "processor" if (base / "processor").is_dir() else tokenizer
    return CaptionerFiles(kind, weights, tokenizer, processor, config)


def detect(path: Path) -> CaptionerFiles:
    """The captioner in `path` (a folder, or a tagger's model.onnx), or a `ModelFileError`
    naming what was expected."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelFileError(f"captioning model {path} does not exist; give {EXPECTED}")
    folder = path.parent if path.is_file() and path.suffix == ".onnx" else path
    if not folder.is_dir():
        raise ModelFileError(f"{path} is a file; give a folder: {EXPECTED}")
    found = _tagger(folder) or _transformers(folder)
    if found is None:
        raise ModelFileError(f"{path} holds no config.json, text_encoder/ or model.onnx, so it "
                             f"is not a captioning model; give {EXPECTED}")
    return found
