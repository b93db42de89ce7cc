"""Light facts about model families: the types `spec.py` modules fill in, importing no torch.

Config validation and the CLI need to know a family's text encoders, objective, refusals and
defaults before anything heavy is imported; the family classes read the same facts from here,
so there is one place each fact is written.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class ExpertSpec:
    """One of the denoisers of a model whose pipeline switches them by timestep (Wan 2.2
    A14B: the high-noise expert in `transformer`, the low-noise one in `transformer_2`).

    `name` is what `train.experts` calls it, `part` the pipeline's component (and the
    diffusers folder's subfolder), `suffix` ends its LoRA file's stem (`<name>_high_noise`),
    `noisy` says which side of the spec's `boundary` it runs: True, the timesteps t (the
    objective's units, 1 = pure noise) with t >= boundary; False, those with t < boundary.
    """

    name: str
    part: str
    suffix: str
    noisy: bool

    def window(self, boundary: float) -> tuple[float, float]:
        """The times [low, high) this expert runs (the noisy one's includes 1)."""
        return (boundary, 1.0) if self.noisy else (0.0, boundary)


@dataclass(frozen=True)
class LoraSource:
    """Another family whose LoRAs this family reads (`sample --lora`, `--init-lora`): a fact of
    the two models' architectures, declared where the reading family lives, e.g. Chroma's
    blocks are FLUX.1 schnell's, so FLUX.1 LoRAs apply to them, as ComfyUI applies them.

    `family` is the source family's registry name; `why` says what makes its modules this
    model's (and where that was read). A file is read by the source family's own LoRA reader
    into diffusers names, then `renames` ((source module-name prefix, this family's), in
    diffusers names with the component prefix) rename it, and the modules matching `lacks`
    ((full-match regex over the renamed module names, why this model has none)) are left out
    with a warning naming them; any other module this model lacks is left out with a warning
    too, and a module whose shape differs is refused. The family's tests check `lacks` against
    the source's and this model's real module names (tiny flavors and released configs).
    """

    family: str
    why: str
    renames: tuple[tuple[str, str], ...] = ()
    lacks: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class TextEncoderSpec:
    """What a family needs from one text encoder, declared rather than sniffed.

    `kind` picks the transformers model class ("decoder": a decoder LLM such as Qwen3, read
    through its hidden states); `hidden` says which hidden state the denoiser reads ("last",
    "penultimate", or "none" when only the pooled output is used); `pooled` whether the
    pooled/projected output is used; `mask` whether the attention mask is applied.
    `chat` wraps each caption as one user message in the tokenizer's chat template, with these
    template options (None: the caption is tokenized as it is); `trim` keeps only the tokens the
    mask marks (variable-length outputs: cache entries hold the caption's own tokens, batches
    are padded back with a mask, see `families.base.pad_cat`). A chat option may also override
    `add_generation_prompt` (True unless given). `system` is a system message put before the
    user message; `parts` writes each message's content as a list of typed text parts (as
    multimodal processors take it) rather than a string; `specials` is whether the tokenizer
    adds its own special tokens (BOS) to the rendered text (False where the chat template
    writes them, as `apply_chat_template(tokenize=True)` does). `strip` lists substrings removed
    from each caption before it is templated (as a pipeline does for tokens its processor would
    read as images). `template` is a format string with `{}` for the caption, used instead of a
    chat template (the pipeline's own fixed prompt); `suffix` is text tokenized on its own and
    appended after the padded caption (so padding sits between them and `max_length` counts the
    output, suffix included); `drop` leading tokens are dropped from the outputs (after the
    mask trim: a template's prefix the pipeline removes). `layers` lists the `hidden_states`
    indices read (instead of `hidden`) and `stack` how several join: "features" concatenates
    them per token along the feature dimension, "axis" stacks them on a new axis after the
    sequence, (batch, seq, layers, dim). `pad` pads a batch to the spec's `max_length`
    ("max_length") or to its longest text ("longest", with `max_length` as the truncation
    limit), or encodes each text on its own, unpadded ("each", truncated at `max_length`: a
    pipeline that loops over its prompts; padded texts' states differ in the last bits), as the
    family's pipeline does. `valid_positions` > 0 passes position ids that count
    only the masked tokens (padding takes no position), repeated over that many rotary axes (3
    for Qwen-VL's mRoPE). `image_prompt` (None: text only) makes a vision-language encoder
    read the item's control images with its caption, through the processor held as its
    tokenizer: this format string (`{}` the image's 1-based number) is written once per image
    before the caption, and the processor expands its image tokens. `clean` tidies each
    caption first as a pipeline's `prompt_clean` does (ftfy's fixes where ftfy is installed,
    HTML entities unescaped twice, runs of whitespace made one space, ends stripped).
    `window` > 0 pads each text to its length rounded up to a multiple of `window` tokens (at
    most `max_length`), as pipelines that size the text window per prompt do (a batch is encoded
    text by text and zero-padded to the longest, as cache entries are batched); `pad_position`
    (None: the model's own) passes position ids 0, 1, ... with every padding token at this
    position.
    `side` is the side a batch is padded on ("left" where the pipeline pads there: each row's
    own tokens are moved to the front before the trim and drop, as the pipeline splits the
    rows by their masks); `empty` is the text an empty caption is read as (None: as it is).
    `token_types` passes the processor's `mm_token_type_ids` to an image-reading encoder, as
    a pipeline that does so (Qwen3-VL's mRoPE requires them; Qwen-Image-Edit's pipelines pass
    none, and Qwen2.5-VL's positions then differ).
    """

    name: str
    kind: Literal["clip", "clip_projection", "t5", "decoder"]
    max_length: int
    hidden: Literal["last", "penultimate", "none"]
    pooled: bool
    mask: bool = False
    chat: tuple[tuple[str, bool], ...] | None = None
    trim: bool = False
    system: str | None = None
    parts: bool = False
    specials: bool = True
    strip: tuple[str, ...] = ()
    template: str | None = None
    suffix: str | None = None
    drop: int = 0
    layers: tuple[int, ...] = ()
    stack: Literal["features", "axis"] = "features"
    pad: Literal["max_length", "longest", "each"] = "max_length"
    valid_positions: int = 0
    image_prompt: str | None = None
    clean: bool = False
    window: int = 0
    pad_position: int | None = None
    side: Literal["right", "left"] = "right"
    empty: str | None = None
    token_types: bool = False

    def key_fields(self) -> dict[str, object]:
        """The fields that decide this encoder's output, for cache keys. The decoder-LLM fields
        (`DECODER_FIELDS`) enter only when set, so the keys of encoders without them (and the
        caches written before those fields existed) stay as they were."""
        fields = {f: getattr(self, f) for f in self.__dataclass_fields__}
        for name in DECODER_FIELDS:
            if fields[name] == self.__dataclass_fields__[name].default:
                del fields[name]
        return fields

    @property
    def is_clip(self) -> bool:
        """Whether this is a CLIP encoder (BOS first, clip_skip meaningful)."""
        return self.kind in CLIP_KINDS

    @property
    def reads_images(self) -> bool:
        """Whether this encoder reads the item's control images with its caption."""
        return self.image_prompt is not None


@dataclass(frozen=True)
class ModelFiles:
    """Where a family's weights come from, as a user would name them: the diffusers folder
    `model.path` takes (`folder`: the released repository whose layout it has), the ComfyUI
    single files it reads over that folder (`singles`: (model key, the released file), in the
    order a run file lists them), and what the folder must still hold when single files are
    given (`folder_holds`: the tokenizers, which no single file stores; None where the single
    files alone are enough when all of them are given; `tokenizer_repos` then names the Hub
    repositories whose tokenizers are read from the local Hugging Face cache). Config messages,
    help and docs/getting-started.md are written from these, so each family's name its own
    files."""

    folder: str
    singles: tuple[tuple[str, str], ...]
    folder_holds: str | None
    tokenizer_repos: tuple[str, ...] = ()
    # What tells this family's (variant's) denoiser apart by its tensors' names, never by a
    # file's name (the web app's model picker, ui/models.py): alternatives, one per layout the
    # family reads (diffusers, the original/ComfyUI one), each the dotted module paths that
    # some tensor of the file must lie under; `unmarked`: paths no tensor may lie under (what a
    # sibling variant has). The first of `singles` is the denoiser's key.
    markers: tuple[tuple[str, ...], ...] = ()
    unmarked: tuple[str, ...] = ()

    def describe_singles(self) -> str:
        """`model.transformer (flux1-dev.safetensors), model.vae (ae.safetensors), ...`."""
        return ", ".join(f"model.{key} ({what})" for key, what in self.singles)

    @property
    def keys(self) -> tuple[str, ...]:
        """The single-file keys of `model` this family reads."""
        return tuple(key for key, _ in self.singles)


@dataclass(frozen=True)
class ModelSize:
    """A released model's size, what the memory estimate (memory/estimate.py) reads: its name
    (the repository it is released as), the denoiser's and the text encoders' parameters
    (billions), its transformer layers (the blocks block swap moves, where the family swaps)
    and their hidden width, and the pixels per image token on a side (`patch`: the VAE's
    downscale times the patch size)."""

    name: str
    denoiser: float
    encoders: float
    layers: int
    width: int
    patch: int = 16


@dataclass(frozen=True)
class FamilySpec:
    """Everything about a family that is plain data (see `families.base.Family` for meanings).

    `objective` is "flow" (rectified flow) or "ddpm"; `kohya_text_encoders_refused` says why a
    kohya-format file cannot hold its text-encoder LoRA (None: it can); `denoiser_part` is the
    pipeline's name for the denoiser ("transformer", "unet") and `encoder_parts` gives, per text
    encoder, its pipeline component and tokenizer names; `pipeline_class` is the diffusers pipeline
that samples it; `text_encoder_lora_refused` names the encoders whose LoRA no reader of the
family's files would load, with the reason.
    """

    name: str
    text_encoders: tuple[TextEncoderSpec, ...]
    objective: Literal["flow", "ddpm"]
    kohya_text_encoders_refused: str | None
    bucket_step: int
    denoiser_prefix: str
    default_cfg: float
    default_format: str
    text_encoder_prefixes: dict[str, str]
    keep_high: dict[str, tuple[str, ...]]
    swap_blocks: tuple[str, ...]
    compile_blocks: tuple[str, ...]
    denoiser_part: str
    encoder_parts: tuple[tuple[str, str, str], ...]
    pipeline_class: str
    # Text encoders that cannot get a LoRA, with the reason: ((name, why), ...); refused when
    # the config loads.
    text_encoder_lora_refused: tuple[tuple[str, str], ...] = ()
    # Why textual-inversion embeddings cannot be trained (None: they can); refused at load.
    embeddings_refused: str | None = None
    # How many control/reference images an edit pair may give the family (0: it trains no
    # edit model, and a dataset's `control_path` is refused at load).
    control_images: int = 0
    # Released kinds that differ in kind (text encoder, pipeline): ((variant name, its spec),
    # ...), the first the default; each variant's spec names itself in `variant`. Chosen by
    # `model.variant`, or read from a diffusers folder's model_index.json (`pipeline_class`).
    # LyCORIS-kind files (adapters/lycoris_files.py): the prefix of the denoiser's module names
    # (`<prefix>_<diffusers module, dots as underscores>`). "lycoris" is what ComfyUI maps for
    # the diffusers-layout families and what LyCORIS's own wrapper reads; a family whose LoRA
    # files are kohya's gives its kohya prefix ("lora_unet").
    lycoris_prefix: str = "lycoris"
    # The LoRA layouts the family writes (save.format values; others are refused at load):
    # "diffusers", "kohya", and "original" (the model's own module names under
    # `diffusion_model.`, scale folded) where the family implements it.
    formats: tuple[str, ...] = ("diffusers", "kohya")
    # LyCORIS-kind files: (denoiser module, the file's module name) for the modules ComfyUI
    # maps by another name than `<lycoris_prefix>_<module>` (e.g. FLUX.2's shared modulation
    # layers, which its generic `lora_unet_<original name>` map reads); `{n}` in a pair stands
    # for any block index, the same on both sides (Wan's blocks).
    lycoris_renames: tuple[tuple[str, str], ...] = ()
    # (layout, reader, module regex, why): modules a reader would not apply from a file in that
    # layout ("diffusers", "kohya", "original", "lycoris"), as read from the reader's source;
    # `difftune check` names them (adapters/coverage.py).
    lora_unread: tuple[tuple[str, str, str, str], ...] = ()
    # Conv2d layers that adapter.conv_rank adapts (full-match regexes on module names, as
    # LyCORIS's presets choose them); empty: the denoiser has none worth adapting, and conv
    # options are refused at load.
    conv_targets: tuple[str, ...] = ()
    # Video: the frame counts the model trains on, (step, offset) for step x N + offset (Wan:
    # (4, 1), its VAE folding 4 frames into one after the first), and the frame rate clips are
    # resampled to by default; None: the family trains images only (video files are skipped).
    frame_rule: tuple[int, int] | None = None
    fps: float | None = None
    # Image-to-video: every sample is conditioned on its own first frame (an image on itself),
    # prepared as the pipeline prepares its start image (`Family.encode_start`), and a sample
    # prompt gives its start image as its one input image (`--ci`).
    start_image: bool = False
    variants: tuple[tuple[str, "FamilySpec"], ...] = ()
    variant: str | None = None
    # Other families whose LoRAs this family reads (`LoraSource`); a LoRA difftune trained for
    # any other family is refused by its `difftune.family` metadata.
    lora_sources: tuple[LoraSource, ...] = ()
    # A model of several experts its pipeline switches by timestep (empty: one denoiser):
    # the first the default of `train.experts`' order; `boundary` the pipeline's
    # boundary_ratio (the fraction of its num_train_timesteps where it switches).
    experts: tuple[ExpertSpec, ...] = ()
    boundary: float | None = None
    # What training a step-distilled checkpoint of this family does, and what to train on
    # instead (None: the family has none). `Family.distilled` tells a loaded model apart;
    # check, cache and train warn with this text when it is one.
    distilled_note: str | None = None
    # The folder and single files a user points `model` at (messages and help name them).
    files: ModelFiles = field(kw_only=True)
    # The released models' sizes (the memory estimate's parameter counts), the first the one
    # the family's example uses.
    sizes: tuple[ModelSize, ...] = field(default=(), kw_only=True)

    def pick(self, variant: str | None) -> "FamilySpec":
        """The spec of `variant` (the default variant's for None; this spec for a family
        without variants). Raises ValueError naming the choices for an unknown variant."""
        if not self.variants:
            if variant is not None:
                raise ValueError(f"model.family = \"{self.name}\" has no variants; remove "
                                 "model.variant")
            return self
        if variant is None:
            return self.variants[0][1]
        for name, spec in self.variants:
            if name == variant:
                return spec
        choices = ", ".join(repr(n) for n, _ in self.variants)
        raise ValueError(f"model.variant = {variant!r} is not a variant of model.family = "
                         f"\"{self.name}\"; choose one of {choices}")

    def variant_of_pipeline(self, pipeline_class: str) -> str | None:
        """The variant whose diffusers pipeline is `pipeline_class` (a folder's model_index.json
        `_class_name`; the first where several share it), or None when no variant declares
        it."""
        return next(iter(self.variants_of_pipeline(pipeline_class)), None)

    def variants_of_pipeline(self, pipeline_class: str) -> tuple[str, ...]:
        """Every variant sampled by `pipeline_class` (several where they differ in size or in
        which of the pipeline's transformers they train, not in the pipeline: Wan's)."""
        return tuple(n for n, s in self.variants if s.pipeline_class == pipeline_class)

    @property
    def encoder_names(self) -> tuple[str, ...]:
        """The text encoders' names, in declaration order."""
        return tuple(s.name for s in self.text_encoders)

    @property
    def clip_hidden(self) -> bool:
        """Whether a CLIP hidden state reaches the denoiser (where clip_skip means something)."""
        return any(s.is_clip and s.hidden != "none" for s in self.text_encoders)


CLIP_KINDS = ("clip", "clip_projection")
# TextEncoderSpec fields that enter cache keys only when they differ from their defaults.
DECODER_FIELDS = ("chat", "trim", "system", "parts", "specials", "strip", "template", "suffix",
                  "drop", "layers", "stack", "pad", "valid_positions", "image_prompt", "clean",
                  "window", "pad_position", "side", "empty", "token_types")
# Kept out of fp8 storage and quantization in every family's autoencoder.
VAE_KEEP_HIGH = (r"conv_in$", r"conv_out$", r"quant_conv$")
# T5's feed-forward output casts its input to `wo`'s stored dtype (fp8 would break it).
T5_KEEP_HIGH = (r"embeddings", r"embed_tokens", r"^shared$", r"text_projection", r"\.wo$")
