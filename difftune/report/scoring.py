"""The metric models (DINOv2 and CLIP from local folders) and the features they give.

Image features are DINOv2's pooled output (the layer-normed class token), L2-normalized so a
dot product is a cosine similarity. The CLIP score is CLIPScore's definition: 100 times the
cosine of the image and prompt embeddings, floored at 0. Everything runs without gradients,
on `metrics.device`, in float32 (the models are small next to the trained one).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from difftune.cache.keys import entry_key, file_hash
from difftune.config.metrics import MetricsConfig
from difftune.errors import ModelFileError

WEIGHT_SUFFIXES = (".safetensors", ".bin")


def folder_fingerprint(folder: Path) -> str:
    """A content hash of a model folder: its config and weight files (part of feature keys,
    so a different model never reads another's cached features)."""
    files = sorted(p for p in folder.iterdir()
                   if p.name.endswith(WEIGHT_SUFFIXES) or p.name == "config.json")
    return entry_key({p.name: file_hash(p) for p in files})


def _load(folder: Path, what: str, processor_cls: str) -> tuple[Any, Any]:
    """A transformers model and its processor from a local folder, in eval mode."""
    import transformers

    try:
        model = transformers.AutoModel.from_pretrained(folder, local_files_only=True)
        processor = getattr(transformers, processor_cls).from_pretrained(
            folder, local_files_only=True)
    except (OSError, ValueError, KeyError) as err:
        raise ModelFileError(f"metrics.{what}: {folder} cannot be loaded ({err}); point it at "
                             "a folder saved by transformers' save_pretrained") from None
    return model.eval(), processor


@dataclass
class Scorers:
    """The loaded metric models; `clip` is None without `metrics.clip`."""

    dino: tuple[Any, Any]
    clip: tuple[Any, Any] | None
    device: torch.device
    fingerprint: str  # of the DINOv2 folder

    @classmethod
    def load(cls, cfg: MetricsConfig) -> "Scorers":
        """Load the configured models (cfg.dino is set: the config requires it)."""
        assert cfg.dino is not None
        device = torch.device(cfg.device)
        dino = _load(cfg.dino, "dino", "AutoImageProcessor")
        clip = _load(cfg.clip, "clip", "AutoProcessor") if cfg.clip is not None else None
        for model, _ in (dino, *([clip] if clip else [])):
            model.to(device)
        return cls(dino, clip, device, folder_fingerprint(cfg.dino))

    @torch.no_grad()
    def features(self, images: list[Image.Image]) -> torch.Tensor:
        """Unit-length DINOv2 features of `images` (N x D, float32, on the CPU)."""
        model, processor = self.dino
        pixels = processor(images=[i.convert("RGB") for i in images], return_tensors="pt")
        out = model(pixel_values=pixels["pixel_values"].to(self.device))
        return torch.nn.functional.normalize(out.pooler_output.float(), dim=-1).cpu()

    @torch.no_grad()
    def clip_scores(self, images: list[Image.Image], prompts: list[str]) -> torch.Tensor | None:
        """CLIPScore of each image against its prompt (N,), or None without a CLIP model."""
        if self.clip is None:
            return None
        model, processor = self.clip
        inputs = processor(text=prompts, images=[i.convert("RGB") for i in images],
                           return_tensors="pt", padding=True, truncation=True)
        inputs = {k: v.to(self.device) for k, v in inputs.items()}
        img = model.get_image_features(pixel_values=inputs["pixel_values"])
        txt = model.get_text_features(input_ids=inputs["input_ids"],
                                      attention_mask=inputs.get("attention_mask"))
        img, txt = (_pooled(x) for x in (img, txt))
        cos = (torch.nn.functional.normalize(img, dim=-1)
               * torch.nn.functional.normalize(txt, dim=-1)).sum(-1)
        return (100 * cos.clamp(min=0)).float().cpu()


def _pooled(out: Any) -> torch.Tensor:
    """The projected embedding, whether transformers returns it bare or in an output object."""
    return out if isinstance(out, torch.Tensor) else out.pooler_output


def read_image(path: Path) -> Image.Image:
    """An image file as RGB, fully read (the file is closed at once)."""
    with Image.open(path) as im:
        return im.convert("RGB")
