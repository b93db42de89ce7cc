"""What every family implementation shares: facts from its spec, build-then-freeze, encoding.

A family class names its `spec`, `presets` and `loaders` (the functions of its `tiny.py` and
`files.py` that read its parts); placing them on the policy's device in its dtypes, freezing
them, running the text encoders, picking LoRA targets, building the sampling pipeline and
writing the diffusers layout are the same for all families and are written once here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

import numpy as np
import torch

from difftune.errors import ConfigError, DataError
from difftune.families.base import Components, ModelSpec, TextEmbeds
from difftune.families.common import text
from difftune.families.common.kohya import has_original_prefix, original_to_kohya
from difftune.families.specs import FamilySpec
from difftune.train.objectives import FlowMatching
from difftune.train.objectives.flow import scheduler_shift

if TYPE_CHECKING:
    from diffusers import DiffusionPipeline
    from difftune.files.single import Layout

    from difftune.config import ModelConfig, TrainConfig
    from difftune.precision.policy import PrecisionPolicy
    from difftune.train.objectives import Objective

# The spec facts the `Family` protocol exposes as attributes of the family class.
FACTS = ("name", "text_encoders", "bucket_step", "denoiser_prefix", "default_cfg",
         "text_encoder_prefixes", "keep_high", "swap_blocks", "compile_blocks", "default_format",
         "control_images", "lycoris_prefix", "conv_targets", "lycoris_renames", "lora_unread",
         "formats", "frame_rule", "fps", "experts", "boundary", "start_image")


def place(module: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """Move a module to a device, casting only when its dtype differs."""
    if module.dtype != dtype:
        module = module.to(dtype=dtype)
    return module.to(device)


def freeze(*modules: torch.nn.Module) -> None:
    """No gradients and eval mode for every module (base weights are never trained)."""
    for module in modules:
        module.requires_grad_(False)
        module.eval()


def frozen_encoders(modules: dict[str, torch.nn.Module], policy: "PrecisionPolicy"
                    ) -> dict[str, torch.nn.Module]:
    """Text encoders placed on the policy's device in its text-encoder dtype, frozen, eval."""
    out = {n: place(m, policy.device, policy.text_encoders) for n, m in modules.items()}
    freeze(*out.values())
    return out


def prompt_kwargs(embeds: TextEmbeds, prefix: str = "") -> dict[str, torch.Tensor]:
    """A pipeline's precomputed `prompt_embeds` and `pooled_prompt_embeds` arguments (with
    `prefix` "negative_" for the negative prompt's)."""
    return {f"{prefix}prompt_embeds": embeds.tensors["prompt_embeds"],
            f"{prefix}pooled_prompt_embeds": embeds.tensors["pooled_prompt_embeds"]}


class Loaders(NamedTuple):
    """The functions that read a family's parts, by name in its folder's role modules.

    `tiny` (in tiny.py) builds the tiny flavor's components; `files(cfg, dtypes)` (in files.py)
    reads every component from local files in `dtypes` (keys: the denoiser's part name,
    "text_encoders", "vae") plus "name" and "fingerprint"; `text_files(cfg, dtype)` reads the
    text encoders alone from the same files (a reload after unloading).
    """

    tiny: str
    files: str
    text_files: str


class FamilyBase:
    """The generic half of a family: subclasses set `spec`, `presets` and `loaders` (and
    implement the family-specific protocol methods)."""

    spec: ClassVar[FamilySpec]
    # The control-size rule's name and parameters (in control-latent cache keys): by default a
    # control takes its target's bucket.
    control_rule: ClassVar[str] = "target-bucket"
    # The text-image size rule's name (text entries' keys): by default the control's size.
    text_image_rule: ClassVar[str] = "control-size"
    # LoRA preset -> full-match regexes of denoiser module names.
    presets: ClassVar[dict[str, list[str]]]
    loaders: ClassVar[Loaders]
    # Further arguments of the family's pipeline constructor (components it takes but
    # difftune does not load, such as a safety checker), passed as given.
    pipeline_extras: ClassVar[dict[str, Any]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Copy the spec's facts onto the class (`FluxFamily.keep_high` needs no object);
        intermediate bases without a spec of their own are skipped."""
        super().__init_subclass__(**kwargs)
        if getattr(cls, "spec", None) is None:
            return
        for fact in FACTS:
            setattr(cls, fact, getattr(cls.spec, fact))

    def __init__(self, variant: str | None = None) -> None:
        """The family, of its `variant` where its spec declares variants (the default one for
        None): the variant's spec and facts then replace the class's on this object."""
        spec = type(self).spec.pick(variant)
        if spec is not type(self).spec:
            self.spec = spec
            for fact in FACTS:
                setattr(self, fact, getattr(spec, fact))

    def _role(self, role: str, function: str) -> Callable[..., Any]:
        """A function of one of the family folder's role modules ("tiny", "files"), imported
        only now (they import diffusers and transformers)."""
        package = type(self).__module__.rsplit(".", 1)[0]
        return getattr(importlib.import_module(f"{package}.{role}"), function)

    def _tiny(self) -> dict[str, Any]:
        """The tiny flavor's components (of the spec's variant, passed to the builder, where
        the family has variants)."""
        build = self._role("tiny", self.loaders.tiny)
        return build(self.spec.variant) if self.spec.variant is not None else build()

    def _parts(self, cfg: "ModelConfig", policy: "PrecisionPolicy") -> dict[str, Any]:
        """Every component by its pipeline name, plus "name" and "fingerprint" (and
        "t5_max_length" where the loaded T5 declares one)."""
        if cfg.flavor == "tiny":
            parts = self._tiny()
            name = self.spec.name
            # the variant (where the family has variants) in the fingerprint: caches differ
            kind = "-".join(n for n in (name, self.spec.variant) if n)
            parts.update(name=f"difftune/tiny-{name}", fingerprint=f"tiny-{kind}-v1")
            return parts
        dtypes = {self.spec.denoiser_part: policy.denoiser,
                  **{e.part: policy.denoiser for e in self.spec.experts},
                  "text_encoders": policy.text_encoders, "vae": policy.vae}
        return self._role("files", self.loaders.files)(cfg, dtypes)

    def _text_parts(self, cfg: "ModelConfig", policy: "PrecisionPolicy") -> dict[str, Any]:
        """The text encoders alone, by pipeline name, from the same sources as `_parts`."""
        if cfg.flavor == "tiny":
            return self._tiny()
        return self._role("files", self.loaders.text_files)(cfg, policy.text_encoders)

    def load(self, cfg: "ModelConfig", policy: "PrecisionPolicy") -> Components:
        """Build the tiny flavor or read local files, frozen, in the policy's dtypes."""
        return self.components(self._parts(cfg, policy), cfg, policy)

    def components(self, parts: dict[str, Any], cfg: "ModelConfig",
                   policy: "PrecisionPolicy") -> Components:
        """Place the loaded parts on the device in the policy's dtypes, frozen and in eval mode."""
        spec = self.spec
        extras: dict[str, Any] = {}
        if "t5_max_length" in parts:
            extras["max_length"] = {"t5": int(parts["t5_max_length"])}
        comps = Components(
            denoiser=self._denoiser(parts, policy),
            vae=place(parts["vae"], policy.device, policy.vae),
            text_encoders={name: place(parts[te], policy.device, policy.text_encoders)
                           for name, te, _ in spec.encoder_parts},
            tokenizers={name: parts[tok] for name, _, tok in spec.encoder_parts},
            scheduler=parts["scheduler"],
            name=cfg.name or parts["name"],
            fingerprint=parts["fingerprint"],
            extras=extras,
        )
        freeze(comps.denoiser, comps.vae, *comps.text_encoders.values())
        return comps

    def _denoiser(self, parts: dict[str, Any], policy: "PrecisionPolicy") -> torch.nn.Module:
        """The denoiser placed where the policy says; a model of two experts as one module
        (`Experts`), in host memory with only the running expert on an accelerator."""
        spec = self.spec
        if not spec.experts:
            return place(parts[spec.denoiser_part], policy.denoiser_home, policy.denoiser)
        from difftune.families.common.experts import Experts

        assert spec.boundary is not None, "a spec with experts declares its boundary"
        experts = Experts.of(spec.experts, parts, spec.boundary,
                             int(parts["scheduler"].config.num_train_timesteps))
        place(experts, torch.device("cpu"), policy.denoiser)
        if policy.denoiser_home.type != "cpu":
            experts.keep_one_on(policy.denoiser_home)
        return experts

    def load_text_encoders(self, cfg: "ModelConfig", policy: "PrecisionPolicy"
                           ) -> dict[str, torch.nn.Module]:
        """The text encoders alone, frozen, placed as `load` places them (a reload after they
        were unloaded)."""
        parts = self._text_parts(cfg, policy)
        return frozen_encoders({name: parts[te] for name, te, _ in self.spec.encoder_parts},
                               policy)

    def combine_text(self, c: Components, outputs: dict[str, dict[str, torch.Tensor]]
                     ) -> TextEmbeds:
        """The denoiser's text inputs from each encoder's outputs (family-specific)."""
        raise NotImplementedError

    def encode_text(self, c: Components, texts: list[str],
                    options: "text.EncodeOptions | None" = None) -> TextEmbeds:
        """Encode with every text encoder (no grad) and combine, for sampling."""
        return self.combine_text(c, text.encode_all(self.spec.text_encoders, c, texts, options))

    def lora_targets(self, preset: str) -> list[str]:
        """Full-match regexes of denoiser module names for a preset."""
        return list(self.presets[preset])

    def objective(self, c: Components, cfg: "TrainConfig") -> "Objective":
        """Rectified flow with the configured timestep sampling, whose `flux_shift` is the
        loaded scheduler's resolution-dependent shift (DDPM families override)."""
        return FlowMatching(cfg, scheduler_shift(c.scheduler.config))

    @torch.no_grad()
    def clip_inputs(self, frames: int) -> dict[str, Any]:
        """Pipeline arguments for a sample of `frames` frames: none for an image (a family
        with a `frame_rule` overrides this with its pipeline's frame argument)."""
        if frames != 1:
            raise DataError(f"model.family = \"{self.name}\" samples images only, not clips "
                            f"of {frames} frames")
        return {}

    def pipeline_clip(self, result: Any) -> np.ndarray:
        """A pipeline result's frames, (F, H, W, 3) in [0, 1]: one for an image family."""
        return self.pipeline_image(result)[None]

    def encode_clips(self, c: Components, pixels: torch.Tensor) -> torch.Tensor:
        """Refused: a family without a `frame_rule` trains images only (`data.build` skips
        its video files, so this is reached only by code that ignored that)."""
        raise DataError(f"model.family = \"{self.name}\" trains images only; it has no "
                        "frame axis for video clips")

    def encode_images(self, c: Components, pixels: torch.Tensor) -> torch.Tensor:
        """Pixels in [-1, 1] -> latents normalized with the VAE's shift and scaling factors."""
        vae = c.vae
        device = text.module_device(vae)
        # The mode (mean) rather than a sample: deterministic, so latents can be cached.
        z = vae.encode(pixels.to(device, vae.dtype)).latent_dist.mode()
        shift = vae.config.shift_factor or 0.0
        return (z - shift) * vae.config.scaling_factor

    def control_size(self, image_size: tuple[int, int], target_bucket: tuple[int, int],
                     resolution: int) -> tuple[int, int]:
        """The size a control image is encoded at: its target's bucket, unless the family's
        pipeline sizes its input images by a rule of its own (it then overrides this)."""
        return (target_bucket[0], target_bucket[1])

    def control_pixels(self, path: Path, size: tuple[int, int], resolution: int
                       ) -> torch.Tensor:
        """A control image's (1, 3, H, W) pixels at `size` for a dataset at `resolution`: by
        default stretched to `size` (`load_control_pixels`); a family whose pipeline crops
        instead overrides this."""
        from difftune.data.images import load_control_pixels

        return load_control_pixels(path, size)

    def control_key(self, resolution: int) -> str:
        """The control rule as control-latent cache keys name it: `control_rule`, plus the
        resolution where a family's pixels depend on more than the encoded size."""
        return self.control_rule

    def pipeline_images(self, images: list[Any], width: int, height: int) -> dict[str, Any]:
        """The pipeline's input-image arguments (edit families override; none by default)."""
        return {}

    def text_image_size(self, image_size: tuple[int, int], control_size: tuple[int, int]
                        ) -> tuple[int, int]:
        """The size an image-reading text encoder reads a control image at: the size it is
        encoded at, unless the family's pipeline sizes it otherwise (it then overrides this)."""
        return (control_size[0], control_size[1])

    def pipeline_image(self, result: Any) -> Any:
        """The first image of a pipeline call's output (`output_type="np"`: an (H, W, 3)
        array); a family whose pipeline returns another field (video frames) overrides this."""
        return result.images[0]

    def pipeline_text_images(self, images: list[Any]) -> list[Any]:
        """The images the pipeline's text encoder reads: none, unless an encoder reads them
        (families whose encoders do override this)."""
        return []

    def pipeline(self, c: Components) -> "DiffusionPipeline":
        """The family's diffusers pipeline over the loaded components (text encoders wherever
        they now live), for sampling."""
        import diffusers

        from difftune.families.common.experts import Experts

        spec, den = self.spec, c.denoiser
        experts = isinstance(den, Experts)
        parts: dict[str, Any] = ({den.high: den.expert(den.high), den.low: den.expert(den.low)}
                                 if experts else {spec.denoiser_part: den})
        parts.update(vae=c.vae, scheduler=c.scheduler)
        for name, te, tok in spec.encoder_parts:
            parts.update({te: c.text_encoders[name], tok: c.tokenizers[name]})
        pipe = getattr(diffusers, spec.pipeline_class)(**parts, **self.pipeline_extras)
        if experts:  # the pipeline switches experts where the run trained them apart
            pipe.register_to_config(boundary_ratio=den.ratio)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def lora_refusal(self, c: Components, tensors: dict[str, torch.Tensor],
                     metadata: dict[str, str] | None = None) -> str | None:
        """Why a LoRA file (its tensors as stored) is made for another kind of this family's
        model than the loaded one, or None: where a family can tell (Wan's image-to-video
        LoRAs on text-to-video models), `check_fit` refuses the file with the reason rather
        than leaving readers to skip its modules ("lora key not loaded")."""
        return None

    def load_pipeline_lora(self, pipe: Any, source: Any, name: str,
                           part: str | None = None) -> None:
        """Load a LoRA (a file path, or tensors in diffusers names) into the sampling pipeline
        `pipe` as adapter `name`, with diffusers' own loader (a family whose pipeline holds
        the trained transformer elsewhere, or several (`part`: the one it is for), overrides
        this)."""
        pipe.load_lora_weights(source, adapter_name=name)

    def distilled(self, c: Components) -> bool:
        """Whether the loaded model is the family's step-distilled checkpoint (its spec's
        `distilled_note` says what that means for training); none by default."""
        return False

    def model_spec(self, c: Components) -> ModelSpec:
        """The names other tools give the base model: the constants of the family's `keys.py`
        (`ARCHITECTURE`, `IMPLEMENTATION`, `BASE_VERSION`, `NETWORK_MODULE`); a family whose
        names depend on the loaded variant overrides this."""
        def name(constant: str) -> str:
            return self._role("keys", constant)

        return ModelSpec(name("ARCHITECTURE"), name("IMPLEMENTATION"), name("BASE_VERSION"),
                         name("NETWORK_MODULE"))

    def single_file_layout(self, c: Components) -> "Layout | None":
        """The layout of the single file ComfyUI and Forge load for this family's denoiser
        (`files.single_file_layout(denoiser)` of the family folder), or None where the family
        declares none (a full fine-tune is then written as a diffusers folder only)."""
        package = type(self).__module__.rsplit(".", 1)[0]
        layout = getattr(importlib.import_module(f"{package}.files"), "single_file_layout", None)
        return layout(c.denoiser) if layout is not None else None

    def single_file_extras(self, c: Components) -> dict[str, torch.Tensor]:
        """Frozen tensors the denoiser's single file also holds: none by default."""
        return {}

    def lora_to_format(
        self, c: Components, state: dict[str, torch.Tensor], fmt: str, rank: int, alpha: float
    ) -> dict[str, torch.Tensor]:
        """diffusers-named LoRA -> the requested key layout ("diffusers" as is, "kohya", or
        "original": the model's own module names under `diffusion_model.`, scale folded)."""
        if fmt == "diffusers":
            return dict(state)
        if fmt == "original":
            return self.to_original(c, state, rank, alpha)
        return self.to_kohya(c, state, rank, alpha)

    def to_original(self, c: Components, state: dict[str, torch.Tensor], rank: int,
                    alpha: float) -> dict[str, torch.Tensor]:
        """diffusers-named LoRA -> `diffusion_model.<original module>` keys (family-specific;
        config validation refuses "original" where `spec.formats` lacks it)."""
        raise NotImplementedError

    def to_kohya(self, c: Components, state: dict[str, torch.Tensor], rank: int, alpha: float
                 ) -> dict[str, torch.Tensor]:
        """diffusers-named LoRA -> kohya / ComfyUI keys (family-specific). Here: refused, for
        the families that write no kohya layout (config validation refuses it first where
        `spec.formats` lacks it), naming the layout ComfyUI and diffusers both read."""
        layout = self.spec.default_format
        raise ConfigError(f'save.format = "kohya" is not written for model.family = '
                          f'"{self.spec.name}": ComfyUI and diffusers both read its {layout} '
                          f'layout; use save.format = "{layout}"')


class BlockTableFamily(FamilyBase):
    """A family whose kohya layout is the original (BFL-style) one its `keys.py` converts
    through a `BlockTable`: `kohya_to_diffusers(tensors, prefix)` and
    `diffusers_to_kohya(state, alpha=, rank=)` (FLUX.1, Chroma)."""

    def lora_from_format(self, c: Components, tensors: dict[str, torch.Tensor]
                         ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """A LoRA file's tensors in diffusers names, and per-module alphas: kohya files, and
        the `diffusion_model.<original name>` PEFT keys ComfyUI and ai-toolkit write, go
        through the family's original-layout table; diffusers files are taken as they are."""
        if has_original_prefix(tensors):
            tensors = original_to_kohya(tensors)
        if not any(k.startswith("lora_unet_") for k in tensors):
            return dict(tensors), {}
        return self._role("keys", "kohya_to_diffusers")(tensors, self.spec.denoiser_prefix)

    def to_kohya(self, c: Components, state: dict[str, torch.Tensor], rank: int, alpha: float
                 ) -> dict[str, torch.Tensor]:
        """diffusers-named LoRA -> kohya / ComfyUI keys in the original layout."""
        return self._role("keys", "diffusers_to_kohya")(state, alpha=alpha, rank=rank)
