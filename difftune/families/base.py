"""The Family protocol and the plain data passed between the parts of a run.

Core code (data, cache, train, sample) talks to a model family only through `Family`. A family
never branches on another family's name and core code never branches on a family's name: what
differs between families is declared in each family's `spec.py` (text-encoder specs, bucket
step, key layouts; `difftune.families.specs`) or implemented behind these methods.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from difftune.families.specs import ExpertSpec, TextEncoderSpec

if TYPE_CHECKING:
    from diffusers import DiffusionPipeline

    from difftune.config import ModelConfig, TrainConfig
    from difftune.families.common.text import EncodeOptions
    from difftune.precision.policy import PrecisionPolicy
    from difftune.train.objectives import Objective


def pad_cat(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Concatenate same-keyed tensor dicts along the batch, padding variable-length ones.

    Items whose sequence tensors differ in length (trimmed text-encoder outputs: cache entries
    hold each caption's own tokens) are padded at the end of dimension 1 with zeros, and so are
    their masks (any key ending in "mask"), so the padding is marked invalid. Sequence tensors
    are those as long as the item's mask. Equal lengths concatenate unchanged; unequal lengths
    without a mask raise ValueError (they could not be told apart from real tokens).
    """
    keys = list(items[0])
    masks = [k for k in keys if k.endswith("mask")]
    lengths = {it[m].shape[1] for it in items for m in masks}
    if not masks or len(lengths) == 1:
        try:
            return {k: torch.cat([it[k] for it in items]) for k in keys}
        except RuntimeError as err:
            raise ValueError(f"tensors of unequal length and no mask to pad them with: {err}"
                             ) from None
    longest = max(lengths)

    def padded(it: dict[str, torch.Tensor], k: str) -> torch.Tensor:
        v, own = it[k], it[masks[0]].shape[1]
        if v.dim() < 2 or v.shape[1] != own or own == longest:
            return v
        pad = v.new_zeros((v.shape[0], longest - own, *v.shape[2:]))
        return torch.cat([v, pad], dim=1)

    return {k: torch.cat([padded(it, k) for it in items]) for k in keys}


@dataclass
class TextEmbeds:
    """Text-encoder outputs for a batch: named tensors with the batch as first dimension.

    Names are the family's own (e.g. "prompt_embeds", "pooled_prompt_embeds"); the cache stores
    one item per entry (batch of 1) and batches are rebuilt with `cat`.
    """

    tensors: dict[str, torch.Tensor]

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> "TextEmbeds":
        """Move (and optionally cast floating tensors) to a device."""
        out = {}
        for k, v in self.tensors.items():
            cast = dtype if (dtype is not None and v.is_floating_point()) else None
            out[k] = v.to(device=device, dtype=cast)
        return TextEmbeds(out)

    def item(self, i: int) -> "TextEmbeds":
        """The i-th sample as a batch of one."""
        return TextEmbeds({k: v[i : i + 1] for k, v in self.tensors.items()})

    @staticmethod
    def cat(items: list["TextEmbeds"]) -> "TextEmbeds":
        """Concatenate batches along the first dimension (variable lengths padded and masked,
        see `pad_cat`)."""
        return TextEmbeds(pad_cat([it.tensors for it in items]))


@dataclass(frozen=True)
class Conditioning:
    """Per-batch inputs besides latents, text and time, for the families that use them.

    `guidance` is the distilled-guidance input (FLUX.1-dev); sizes are (height, width) and crops
    (top, left), one per sample, for SDXL's micro-conditioning (`add_time_ids`). `controls`
    holds an edit batch's control-image latents, one (B, C, h, w) tensor per control image in
    the order of the subset's `control_path` (empty for text-to-image batches).
    """

    guidance: float
    original_sizes: list[tuple[int, int]]
    crops: list[tuple[int, int]]
    target_sizes: list[tuple[int, int]]
    controls: tuple[torch.Tensor, ...] = ()
    # An image-to-video batch's start-frame condition (`Family.encode_start`'s "start"), one
    # row per sample, and where the model reads the start image through an image encoder,
    # that encoder's features of it ("start_image"); None for other families.
    start: torch.Tensor | None = None
    start_image: torch.Tensor | None = None


@dataclass(frozen=True)
class ModelSpec:
    """How the tools users share LoRAs with name a base model (written into every LoRA file).

    `architecture` and `implementation` are Stability's model-spec values as kohya sd-scripts
    writes them (`modelspec.architecture` gets "/lora" or "/textual-inversion" appended);
    `base_version` and `network_module` are kohya's `ss_base_model_version` and
    `ss_network_module` for this model. Model sites and managers show and filter by them.
    """

    architecture: str
    implementation: str
    base_version: str
    network_module: str


@dataclass
class Components:
    """The loaded parts of a base model.

    `text_encoders` and `tokenizers` are keyed by `TextEncoderSpec.name`. `fingerprint` identifies
    the weights (file identity or flavor + seed) so cache keys change when the model does.
    """

    denoiser: torch.nn.Module
    vae: torch.nn.Module
    text_encoders: dict[str, torch.nn.Module]
    tokenizers: dict[str, Any]
    scheduler: Any
    name: str
    fingerprint: str
    extras: dict[str, Any] = field(default_factory=dict)


def start_encoders(c: Components) -> list[torch.nn.Module]:
    """The modules kept in `c.extras` (an image-to-video model's image encoder): they encode
    the sample images with the VAE into what the latent cache holds, so they travel with the
    VAE (off the accelerator once latents are cached, back on it while sampling) and count
    with the encoders in `check`'s memory estimate."""
    return [m for m in c.extras.values() if isinstance(m, torch.nn.Module)]


def blocks_of(denoiser: torch.nn.Module, names: tuple[str, ...]) -> list[torch.nn.Module]:
    """The blocks under the denoiser's submodules `names` (dotted paths: a two-expert model's
    `transformer.blocks`), in order (a single block counts as a list of one)."""
    out: list[torch.nn.Module] = []
    for name in names:
        part = denoiser.get_submodule(name)
        out += list(part) if isinstance(part, torch.nn.ModuleList) else [part]
    return out


class Family(Protocol):
    """A model family: everything that differs between FLUX.1, SD3 and SDXL."""

    name: str
    text_encoders: tuple[TextEncoderSpec, ...]
    bucket_step: int
    denoiser_prefix: str  # "transformer" or "unet": the LoRA key prefix diffusers expects
    default_cfg: float  # CFG scale for samples whose prompt gives none
    # Text-encoder name -> the pipeline component its LoRA keys start with ("text_encoder_2").
    text_encoder_prefixes: dict[str, str]
    # Part ("denoiser", "text_encoders", "vae") -> module-name regexes kept in high precision
    # under fp8 storage and quantization (embedders, input/output projections).
    keep_high: dict[str, tuple[str, ...]]
    # Attributes of the denoiser holding its blocks (lists or single blocks), in execution
    # order: what train.blocks_to_swap streams (empty: the family cannot swap) and what
    # train.compile compiles one by one.
    swap_blocks: tuple[str, ...]
    compile_blocks: tuple[str, ...]
    # The LoRA key layout written when save.format is unset ("diffusers", "kohya" or
    # "original"): the one that ComfyUI and diffusers both read completely for this family.
    default_format: str
    # LyCORIS-kind files: the denoiser's module-name prefix ("lycoris", "lora_unet"), and the
    # Conv2d layers adapter.conv_rank adapts (regexes; empty: none).
    lycoris_prefix: str
    conv_targets: tuple[str, ...]
    # LyCORIS-kind files: (denoiser module, the file's name for it) where it differs from
    # `<lycoris_prefix>_<module>` (a name ComfyUI maps); (layout, reader, module regex, why)
    # for the modules a reader of the family's files would not apply (`adapters.coverage`).
    lycoris_renames: tuple[tuple[str, str], ...]
    lora_unread: tuple[tuple[str, str, str, str], ...]
    formats: tuple[str, ...]  # the save.format values the family writes
    # A model of two experts its pipeline switches by timestep (`ExpertSpec`s; empty: one
    # denoiser), and where it switches (the pipeline's boundary_ratio).
    experts: tuple[ExpertSpec, ...]
    boundary: float | None
    # How many control/reference images an edit pair or an edit sample prompt may give it
    # (0: it is no edit model).
    control_images: int
    # Video: valid frame counts (step, offset) = step x N + offset, and the default frame rate
    # clips are resampled to; None for a family that trains images only.
    frame_rule: tuple[int, int] | None
    fps: float | None
    # Image-to-video: each sample's own first frame conditions it (`encode_start`), and a
    # sample prompt's one input image is its start frame.
    start_image: bool
    # Names the control-size rule and its parameters (part of control-latent cache keys).
    control_rule: str

    def control_size(self, image_size: tuple[int, int], target_bucket: tuple[int, int],
                     resolution: int) -> tuple[int, int]:
        """The (width, height) a control image of upright `image_size` is encoded at, for a
        target in `target_bucket` of a dataset at `resolution`: the family's pipeline's rule."""
        ...

    def control_pixels(self, path: Path, size: tuple[int, int], resolution: int
                       ) -> torch.Tensor:
        """A control image's (1, 3, H, W) pixels in [-1, 1] at `size` (from `control_size`) for
        a dataset at `resolution`, prepared as the family's pipeline prepares its inputs."""
        ...

    def control_key(self, resolution: int) -> str:
        """The control rule as control-latent cache keys name it (see `control_rule`)."""
        ...

    def lora_refusal(self, c: Components, tensors: dict[str, torch.Tensor],
                     metadata: dict[str, str] | None = None) -> str | None:
        """Why a LoRA file (its tensors and header `metadata`) is made for another kind of
        this family's model than the loaded one (None: it is not, or the family cannot
        tell)."""
        ...

    def text_image_size(self, image_size: tuple[int, int], control_size: tuple[int, int]
                        ) -> tuple[int, int]:
        """The (width, height) a text encoder that reads images (`TextEncoderSpec.image_prompt`)
        reads a control image of upright `image_size` at (encoded at `control_size`)."""
        ...

    # Names the text-image size rule (part of the keys of text entries that read images).
    text_image_rule: str

    def pipeline_text_images(self, images: list[Any]) -> list[Any]:
        """A sample prompt's input images (PIL) as the pipeline's text encoder reads them
        (sized by the pipeline's rule); none for a family whose encoders read no images."""
        ...

    def load(self, cfg: "ModelConfig", policy: "PrecisionPolicy") -> Components:
        """Load (or build, for the tiny flavor) all components from local files."""
        ...

    def load_text_encoders(self, cfg: "ModelConfig", policy: "PrecisionPolicy"
                           ) -> dict[str, torch.nn.Module]:
        """The text encoders alone (by spec name), from the same files as `load`, frozen and
        placed as `load` places them: to bring back encoders unloaded after caching."""
        ...

    def encode_text(self, c: Components, texts: list[str],
                    options: "EncodeOptions | None" = None) -> TextEmbeds:
        """Run every text encoder on a batch of captions (no grad) and combine the outputs."""
        ...

    def combine_text(self, c: Components, outputs: dict[str, dict[str, torch.Tensor]]) -> TextEmbeds:
        """The denoiser's text inputs from each encoder's `text.encode` outputs (by spec name).

        The core runs the encoders one by one (cached or live, with gradients when trained);
        a family only says how their outputs join.
        """
        ...

    def encode_images(self, c: Components, pixels: torch.Tensor) -> torch.Tensor:
        """Pixels in [-1, 1], (B, 3, H, W) -> normalized latents (B, C, h, w)."""
        ...

    def clip_inputs(self, frames: int) -> dict[str, Any]:
        """The pipeline's arguments for a sample of `frames` frames (none for an image)."""
        ...

    def pipeline_clip(self, result: Any) -> Any:
        """A pipeline result's frames, (F, H, W, 3) in [0, 1] (one for an image)."""
        ...

    def encode_clips(self, c: Components, pixels: torch.Tensor) -> torch.Tensor:
        """Video clips, (B, 3, F, H, W) in [-1, 1] -> normalized latents (B, C, f, h, w), for
        a family with a `frame_rule` (F one of its valid counts)."""
        ...

    def encode_start(self, c: Components, pixels: torch.Tensor) -> dict[str, torch.Tensor]:
        """For a `start_image` family only: a sample's (B, 3, F, H, W) pixels in [-1, 1] ->
        what its denoiser reads of the first frame, prepared as the family's image-to-video
        pipeline prepares its start image, by `Conditioning` field ("start", "start_image")."""
        ...

    def objective(self, c: Components, cfg: "TrainConfig") -> "Objective":
        """How this family is trained (noise, timesteps, target, weighting)."""
        ...

    def predict(
        self,
        c: Components,
        noisy: torch.Tensor,
        embeds: TextEmbeds,
        t: torch.Tensor,
        cond: Conditioning,
    ) -> torch.Tensor:
        """Denoiser output for noisy latents at times t (the objective's units), latent layout."""
        ...

    def lora_targets(self, preset: str) -> list[str]:
        """Module-name suffixes of the denoiser that get a LoRA for a preset."""
        ...

    def pipeline(self, c: Components) -> "DiffusionPipeline":
        """A diffusers pipeline over the loaded components, for sampling."""
        ...

    def pipeline_inputs(self, embeds: TextEmbeds, negative: TextEmbeds | None,
                        guidance: float, cfg: float) -> dict[str, Any]:
        """Pipeline keyword arguments: precomputed (negative) embeddings, guidance, CFG scale."""
        ...

    def pipeline_images(self, images: list[Any], width: int, height: int) -> dict[str, Any]:
        """Pipeline keyword arguments for a sample prompt's input images (PIL, upright RGB),
        resized by the family's control rule, for an output of `width` x `height`."""
        ...

    def pipeline_image(self, result: Any) -> Any:
        """The first image of a pipeline call's output (`output_type="np"`: (H, W, 3)); a
        video pipeline's first frame."""
        ...

    def load_pipeline_lora(self, pipe: Any, source: Any, name: str,
                           part: str | None = None) -> None:
        """Load a LoRA (file path or diffusers-named tensors) into the sampling pipeline as
        adapter `name`, into the transformer the family trains (of a two-expert model's, the
        pipeline part `part`)."""
        ...

    def model_spec(self, c: Components) -> ModelSpec:
        """The names other tools give the loaded base model (variant read from its config)."""
        ...

    def distilled(self, c: Components) -> bool:
        """Whether the loaded model is the family's step-distilled checkpoint (read from its
        weights or config, never from file names); the spec's `distilled_note` says why that
        matters for training."""
        ...

    def single_file_layout(self, c: Components) -> Any:
        """The denoiser's single-file layout (`files.single.Layout`: file name -> the diffusers
        tensors it is made of) as ComfyUI and Forge load it, or None where there is none."""
        ...

    def single_file_extras(self, c: Components) -> dict[str, torch.Tensor]:
        """Frozen tensors the denoiser's single file also holds, by their name in it (Anima's
        LLM adapter, without which ComfyUI takes the file for another model); none for most."""
        ...

    def lora_to_format(
        self, c: Components, state: dict[str, torch.Tensor], fmt: str, rank: int, alpha: float
    ) -> dict[str, torch.Tensor]:
        """Convert a diffusers-named LoRA ("transformer.<module>.lora_A.weight") to `fmt`."""
        ...

    def lora_from_format(self, c: Components, tensors: dict[str, torch.Tensor]
                         ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """A LoRA file (any layout `lora_to_format` writes) in diffusers names, plus the alpha
        of each module where the file says it (kohya `.alpha` entries); else {}."""
        ...
