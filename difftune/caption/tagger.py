"""Booru tags from a WD14-style ONNX tagger (model.onnx + selected_tags.csv) through
onnxruntime.

The taggers take a batch of square BGR images, 0-255 as float32, NHWC, at the side their input
declares (448 for the SmilingWolf v3 models), padded to a square on white; they output one
probability per row of selected_tags.csv, whose `category` column says what a tag is
(0 general, 4 character, 9 rating). Rating tags are never written; a general tag is kept at
`threshold`, a character tag at `character_threshold`.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from difftune.errors import ModelFileError

RATING, CHARACTER = "9", "4"


def read_tags(path: Path) -> tuple[list[str], list[str]]:
    """(names, categories) of selected_tags.csv, names written with spaces for underscores
    (as captions are written), except short ones such as "^_^" whose underscore is the tag."""
    try:
        with open(path, newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
        names = [r["name"] if len(r["name"]) <= 3 else r["name"].replace("_", " ") for r in rows]
        return names, [str(r.get("category", "0")) for r in rows]
    except (OSError, KeyError, UnicodeDecodeError, csv.Error) as err:
        raise ModelFileError(f"{path} is not a tag list (needs a header with name and category "
                             f"columns): {err}") from None


class OnnxTagger:
    """A loaded tagger: `caption(images)` gives each image's tags, most probable first."""

    def __init__(self, folder: Path, threshold: float, character_threshold: float,
                 device: str = "auto") -> None:
        import onnxruntime as ort

        self.names, self.categories = read_tags(folder / "selected_tags.csv")
        wanted = ["CUDAExecutionProvider"] if device.startswith("cuda") or device == "auto" else []
        providers = [p for p in wanted if p in ort.get_available_providers()]
        try:
            self.session = ort.InferenceSession(str(folder / "model.onnx"),
                                                providers=providers + ["CPUExecutionProvider"])
        except Exception as err:  # onnxruntime raises its own exception types
            raise ModelFileError(f"{folder / 'model.onnx'} cannot be loaded by onnxruntime: "
                                 f"{err}") from None
        inp = self.session.get_inputs()[0]
        self.input, self.side, self.batch = inp.name, int(inp.shape[1]), inp.shape[0]
        width = int(self.session.get_outputs()[0].shape[-1])
        if width != len(self.names):
            raise ModelFileError(f"{folder}: model.onnx scores {width} tags but "
                                 f"selected_tags.csv lists {len(self.names)}; use the tag list "
                                 "that came with the model")
        cats = np.array(self.categories)
        # Each tag's threshold by its category; rating tags never pass.
        self.limits = np.where(cats == CHARACTER, character_threshold, threshold)
        self.limits[cats == RATING] = np.inf

    def _pixels(self, image: Image.Image) -> np.ndarray:
        """(side, side, 3) float32 BGR in 0-255: padded to a square on white, then resized."""
        side = max(image.size)
        square = Image.new("RGB", (side, side), (255, 255, 255))
        square.paste(image.convert("RGB"), ((side - image.width) // 2,
                                            (side - image.height) // 2))
        square = square.resize((self.side, self.side), Image.Resampling.BICUBIC)
        return np.asarray(square, dtype=np.float32)[:, :, ::-1]

    def caption(self, images: list[Image.Image]) -> list[str]:
        """Each image's tags above the thresholds, by falling probability, ", "-joined."""
        return [", ".join(self._kept(row)) for row in self._probs(images)]

    def caption_frames(self, clips: list[list[Image.Image]]) -> list[str]:
        """Each clip's tags: a tag is kept when its mean probability over the clip's frames
        passes its threshold (a tag seen in one frame of four is not the video's)."""
        probs = self._probs([im for frames in clips for im in frames])
        ends = np.cumsum([len(frames) for frames in clips])
        return [", ".join(self._kept(probs[end - len(frames):end].mean(axis=0)))
                for frames, end in zip(clips, ends, strict=True)]

    def _probs(self, images: list[Image.Image]) -> Any:
        """(images, tags) probabilities (one image a run for a model exported with a batch
        of 1)."""
        batch = np.stack([self._pixels(im) for im in images])
        step = len(batch) if self.batch != 1 else 1
        return np.concatenate([self.session.run(None, {self.input: batch[i:i + step]})[0]
                               for i in range(0, len(batch), step)])

    def _kept(self, row: Any) -> list[str]:
        """The tag names of one image's probabilities that pass their category's threshold."""
        passed = np.nonzero(row >= self.limits)[0]
        return [self.names[i] for i in passed[np.argsort(-row[passed], kind="stable")]]
