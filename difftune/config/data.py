"""The data and cache sections of a run configuration: datasets, subsets and the disk cache."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import AliasChoices, BaseModel, Field, field_validator, model_validator

from difftune.config.base import Section as _Section

# A file extension, with or without its dot: not empty, not a bare dot, no folder separator.
_EXTENSION = re.compile(r"\.?[^./\\][^/\\]*")


class SubsetConfig(_Section):
    """One folder of images with same-stem caption files."""

    path: Path = Field(..., description="Folder of png/jpg/webp images (searched recursively).")
    repeats: int = Field(1, ge=1, description="How many times each image appears per epoch.")
    caption_ext: str = Field(".txt", description="Caption file extension (e.g. .txt, .caption).")
    default_caption: str = Field("", description="Caption for images with no caption file.")
    control_path: list[Path] = Field(
        default_factory=list,
        description="Edit training: folder(s) of control/reference images, each matched to a "
                    "target image by its path without extension; the caption is the edit "
                    "instruction. A list gives several references per pair, in order.",
    )
    mask_path: Path | None = Field(
        None,
        description="Masked loss: folder of grayscale masks, each matched to an image by its "
                    "path without extension (white = trained, black = ignored, gray between).",
    )
    alpha_mask: bool = Field(
        False, description="Masked loss: the image's own alpha channel is its mask (the pixels "
                           "are still composited on white).")
    unmasked_weight: float = Field(
        0.1, ge=0, le=1,
        description="Loss weight of the fully unmasked (black) area of a masked image; 0 "
                    "ignores it, 1 turns the mask off.")
    recursive: bool = Field(True, description="Search sub-folders too.")
    flip: bool = Field(False, description="Random horizontal flip (per sample).")
    crop: Literal["center", "random"] = Field(
        "center", description="Where to crop after resizing to the bucket."
    )
    # Caption augmentations (data/captions.py applies them, per sample, in this order).
    caption_prefix: str = Field("", description="Text put before every caption (with a space).")
    caption_suffix: str = Field("", description="Text put after every caption (with a space).")
    wildcards: bool = Field(
        False, description="Resolve `{a|b|c}` in captions to one choice per sample."
    )
    shuffle_caption: bool = Field(False, description="Shuffle the caption's tags per sample.")
    keep_tokens: int = Field(
        0, ge=0, description="Leading tags never shuffled or dropped (e.g. the trigger word)."
    )
    caption_separator: str = Field(",", min_length=1, description="What separates tags.")
    caption_tag_dropout_rate: float = Field(
        0.0, ge=0, lt=1, description="Chance that each (not kept) tag is left out, per sample."
    )
    caption_dropout_rate: float = Field(
        0.0, ge=0, le=1, description="Chance that the whole caption is empty, per sample."
    )
    token_warmup_min: int = Field(1, ge=1, description="Tags kept at step 0 of the warm-up.")
    token_warmup_steps: int = Field(
        0, ge=0, description="Steps over which the tag count grows to the full caption (0: off; "
                              "smaller than train.steps).")

    regularization: bool = Field(
        False, description="A regularization subset (DreamBooth's class images): each epoch "
                           "holds as many of its samples as of the training subsets' (cycled "
                           "or cut), its own repeats setting its images' mix.")
    loss_weight: float = Field(
        1.0, ge=0, validation_alias=AliasChoices("loss_weight", "prior_loss_weight"),
        description="This subset's samples' weight in the loss (`prior_loss_weight` is the "
                    "same field, the name DreamBooth users know).")
    class_prompt: str = Field("", description="Prior preservation: the prompt the base model "
                                              "generates this subset's class images from.")
    class_images: int = Field(0, ge=0, description="Prior preservation: how many images the "
                                                   "folder should hold; the missing ones are "
                                                   "generated once before training (0: off).")
    class_steps: int = Field(20, ge=1, description="Sampling steps of each class image.")
    class_guidance: float = Field(3.5, ge=0, description="Guidance of each class image (as "
                                                         "sample prompts' --g).")

    @model_validator(mode="after")
    def _class_images(self) -> "SubsetConfig":
        """Class images are regularization images made from a prompt: both are needed."""
        if self.class_images and not self.regularization:
            raise ValueError("class_images needs regularization = true (class images are "
                             "regularization images)")
        if self.class_images and not self.class_prompt.strip():
            raise ValueError("class_images needs class_prompt (the prompt the base model "
                             "generates them from, e.g. \"a photo of a dog\")")
        return self

    @field_validator("control_path", mode="before")
    @classmethod
    def _control_list(cls, value: Any) -> Any:
        """One folder may be written as a string; several as a list."""
        return [value] if isinstance(value, (str, Path)) else value

    @model_validator(mode="after")
    def _one_mask_source(self) -> "SubsetConfig":
        """A subset's masks come from one place: a mask folder or the alpha channel."""
        if self.mask_path is not None and self.alpha_mask:
            raise ValueError("give either mask_path (a folder of masks) or alpha_mask = true "
                             "(the images' alpha channel), not both")
        return self

    def masked(self) -> bool:
        """Whether this subset's images are trained with a masked loss."""
        return self.mask_path is not None or self.alpha_mask

    @field_validator("caption_ext")
    @classmethod
    def _extension(cls, ext: str) -> str:
        """An extension a caption file can have (an empty one would name no file at all)."""
        if not _EXTENSION.fullmatch(ext):
            raise ValueError(f"{ext!r} is not a file extension; write one such as \".txt\"")
        return ext

    def ignored_caption_options(self) -> list[str]:
        """Caption options set to a value that has no effect with the others (to warn about)."""
        out = []
        uses_tags = self.shuffle_caption or self.caption_tag_dropout_rate > 0
        if self.keep_tokens and not uses_tags:
            out.append("keep_tokens (needs shuffle_caption or caption_tag_dropout_rate)")
        if self.token_warmup_min != 1 and not self.token_warmup_steps:
            out.append("token_warmup_min (needs token_warmup_steps)")
        if self.caption_separator != "," and not (uses_tags or self.token_warmup_steps):
            out.append("caption_separator (needs shuffle, tag dropout or token warm-up)")
        if "unmasked_weight" in self.model_fields_set and not self.masked():
            out.append("unmasked_weight (needs mask_path or alpha_mask)")
        return out


# A subset's keys as a user may write them: its fields and their other names.
_SUBSET_KEYS = {*SubsetConfig.model_fields, "prior_loss_weight"}


class DatasetConfig(_Section):
    """A dataset: bucketing parameters and one or more subsets.

    For a single folder, give its fields (`path`, `repeats`, ...) directly; they become one subset.
    """

    # The model whose keys the shorthand also accepts (read by the "did you mean" of errors).
    shorthand_of: ClassVar[type[BaseModel]] = SubsetConfig

    resolution: int | list[int] = Field(
        1024, description="Target side: buckets hold ~resolution² px. A list of distinct sides "
                          "(e.g. [512, 768, 1024]) trains every image at each of them.")
    min_side: int = Field(256, ge=16, description="Smallest bucket side.")
    max_side: int = Field(2048, ge=16, description="Largest bucket side.")
    bucket_step: int | None = Field(
        None, ge=8, description="Bucket side granularity (default: the family's, 16 for flux)."
    )
    buckets: bool = Field(True, description="Aspect-ratio bucketing; off = square crops.")
    # Video clips (mp4/webm/mov/mkv files among the images; data/video.py).
    frames: list[int] = Field(
        default_factory=lambda: [33],
        description="Video: the frame counts clips are trained at (each clip takes the largest "
                    "that fits its video); rounded down to the family's rule (Wan: 4N+1).")
    clips: Literal["head", "chunks", "slide", "uniform", "full"] = Field(
        "head", description="Video: how clips are taken from a longer video: from the start, "
                            "consecutive chunks, sliding by clip_stride, clip_count evenly "
                            "spaced, or the whole video up to max_frames.")
    clip_stride: int = Field(16, ge=1, description='Video: frames between the starts of '
                                                   '"slide" clips (at the target rate).')
    clip_count: int = Field(4, ge=1, description='Video: how many "uniform" clips per video.')
    max_frames: int = Field(81, ge=1, description='Video: the longest "full" clip.')
    fps: float | None = Field(
        None, gt=0, description="Video: the frame rate clips are trained at, each source "
                                "resampled to it (default: the family's, 16 for Wan).")
    subsets: list[SubsetConfig] = Field(default_factory=list)

    @field_validator("frames")
    @classmethod
    def _frame_counts(cls, value: list[int]) -> list[int]:
        """At least one count, each at least 1."""
        if not value or min(value) < 1:
            raise ValueError(f"{value}: give one or more frame counts of at least 1, e.g. [33]")
        return value

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data: Any) -> Any:
        if isinstance(data, dict) and "path" in data:
            data = dict(data)
            # Only subset fields move into the subset, so an unknown key is reported where the
            # user wrote it (datasets[0].key), not inside a subset they never wrote.
            subset = {k: data.pop(k) for k in list(data) if k in _SUBSET_KEYS}
            if data.get("subsets"):
                raise ValueError("give either `path` (one folder) or `subsets`, not both")
            data["subsets"] = [subset]
        return data

    @model_validator(mode="after")
    def _sides(self) -> "DatasetConfig":
        if not self.subsets:
            raise ValueError("no images: set `path` or add [[datasets.subsets]] with a path")
        if self.min_side > self.max_side:
            raise ValueError(f"min_side ({self.min_side}) is larger than max_side ({self.max_side})")
        for res in self.resolutions:
            if not self.min_side <= res <= self.max_side:
                raise ValueError(
                    f"resolution ({res}) must lie between min_side ({self.min_side}) "
                    f"and max_side ({self.max_side})"
                )
        return self

    @field_validator("resolution")
    @classmethod
    def _resolution_values(cls, value: int | list[int]) -> int | list[int]:
        """At least 64 each; a list is non-empty and has no side twice (a repeated side would
        only double those copies: use `repeats` for that)."""
        sides = [value] if isinstance(value, int) else value
        if not sides:
            raise ValueError("an empty list trains nothing; give one side (1024) or several "
                             "([512, 768, 1024])")
        if len(set(sides)) != len(sides):
            raise ValueError(f"{value} lists a side twice; give each resolution once")
        small = [r for r in sides if r < 64]
        if small:
            raise ValueError(f"{small[0]} is below 64, the smallest training resolution")
        return value

    @property
    def resolutions(self) -> tuple[int, ...]:
        """Every side this dataset trains at, in the order written (one for a single int)."""
        return (self.resolution,) if isinstance(self.resolution, int) else tuple(self.resolution)


class CacheConfig(_Section):
    """What is computed once before training instead of every step."""

    latents: Literal["memory", "disk", "none"] = Field(
        "memory", description="Cache VAE latents: in memory, on disk (kept across runs), or not."
    )
    text: Literal["memory", "disk", "none"] = Field(
        "memory", description="Cache text-encoder outputs: in memory, on disk, or not."
    )
    dir: Path | None = Field(
        None, description="Folder of the disk caches (default: <save.dir>/cache); shareable."
    )
    caption_variants: int = Field(
        0, ge=0, le=1024,
        description="Random caption augmentations: K variants per caption pre-encoded from the "
                    "seed (encoders can then be offloaded); 0: a fresh draw per sample, encoded "
                    "on demand with the cache as a memo (encoders stay resident).",
    )
    offload: bool = Field(
        True, description="Move the VAE and frozen text encoders off the accelerator once cached."
    )
    unload_text_encoders: bool = Field(
        False, description="Free the frozen text encoders once their outputs are cached; new "
                           "text (an edited prompt file) reloads them from their files."
    )


