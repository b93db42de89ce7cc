"""Captioning with a local vision-language model: Qwen2.5-VL / Qwen3-VL instruct (also the
text encoder of Qwen-Image or Krea 2), Florence-2, and LLaVA models such as JoyCaption.

Models load through `AutoModelForImageTextToText` from local files only, in the dtype asked
for, optionally with their language model's Linear layers quantized by difftune's own int8/nf4
machinery (precision/lowbit.py). Generation is greedy and batched (prompts left-padded); chat
templates are asked for no thinking (`enable_thinking=False`) and any thinking block that
still appears is dropped from the caption.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from difftune.caption.detect import CaptionerFiles
from difftune.errors import EnvironmentProblem, ModelFileError

log = logging.getLogger("difftune")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Kept in full precision when quantizing: the vision tower, its projector, embeddings, LM head.
KEEP_HIGH = (r"visual", r"vision", r"multi_modal_projector", r"image_projection", r"embed",
             r"lm_head")
# Qwen-VL reads an image at its own size (up to 12.8 Mpx in its released settings: thousands
# of tokens); a caption needs no more than a megapixel, which keeps a batch fast.
MAX_PIXELS = 1024 * 1024
# JoyCaption's system prompt (LLaVA captioners are trained as chat assistants).
LLAVA_SYSTEM = "You are a helpful image captioner."
# ChatML with an image, for Qwen-VL tokenizers saved without a chat template (Qwen-Image's
# tokenizer/ folder): the format the Qwen-VL instruct models were trained on.
QWEN_CHATML = "<|im_start|>user\n{images}{text}<|im_end|>\n<|im_start|>assistant\n"
QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


@dataclass(frozen=True)
class Hardware:
    """Where and how a captioner runs: `device` ("auto", "cpu", "cuda", "cuda:N"),
    `precision` ("auto": bf16 on CUDA, fp32 on the CPU; or fp32/bf16/fp16) and `quantize`
    ("none", "int8", "nf4": the language model's Linear weights)."""

    device: str = "auto"
    precision: str = "auto"
    quantize: str = "none"

    def torch_device(self) -> torch.device:
        """The device, "auto" resolved; CUDA asked for but absent is an `EnvironmentProblem`."""
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise EnvironmentProblem(f"--device {self.device} but no CUDA device is visible to "
                                     "PyTorch; use --device cpu or auto")
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def dtype(self, device: torch.device) -> torch.dtype:
        """The weights' dtype."""
        if self.precision == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return DTYPES[self.precision]


def _load_model(files: CaptionerFiles, dtype: torch.dtype) -> Any:
    """The model from `files.weights`, local files only, or a `ModelFileError` naming it."""
    from transformers import AutoModelForImageTextToText

    _check_head(files)
    try:
        model = AutoModelForImageTextToText.from_pretrained(files.weights, dtype=dtype,
                                                            local_files_only=True)
    except (OSError, ValueError, KeyError) as err:
        raise ModelFileError(f"cannot load the captioning model in {files.weights}: {err}; "
                             "check that its weights are complete") from None
    return model.eval()


def _check_head(files: CaptionerFiles) -> None:
    """A bare vision-language model (a family's text encoder saved without its LM head, e.g.
    Qwen3VLModel) can caption only when its output embeddings are tied to its input ones."""
    cfg = files.config
    archs = cfg.get("architectures") or []
    bare = bool(archs) and all(not a.endswith("ForConditionalGeneration") for a in archs)
    tied = cfg.get("tie_word_embeddings", (cfg.get("text_config") or {}).get(
        "tie_word_embeddings", False))
    if bare and not tied:
        raise ModelFileError(
            f"{files.weights} holds {', '.join(archs)}: the model without its language-model "
            "head (and its embeddings are not tied), so it cannot write text; give the "
            "instruct model's own folder (with ...ForConditionalGeneration weights)")


def _qwen_processor(files: CaptionerFiles) -> Any:
    """A Qwen-VL processor without video: the folder's image-processor settings, or the
    model family's defaults taken from its vision config (patch and merge sizes)."""
    import transformers
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil

    from difftune.families.common.vl_processor import without_video

    tok = AutoTokenizer.from_pretrained(files.tokenizer, local_files_only=True)
    if (files.processor / "preprocessor_config.json").is_file():
        images = Qwen2VLImageProcessorPil.from_pretrained(files.processor, local_files_only=True)
    else:
        vision = files.config.get("vision_config") or {}
        qwen3 = files.config.get("model_type") == "qwen3_vl"
        # Qwen3-VL normalizes to [-1, 1] and starts at 256x256 pixels; Qwen2(.5)-VL uses
        # CLIP's mean/std (the image processor's default) from 56x56.
        extra = {"image_mean": [0.5] * 3, "image_std": [0.5] * 3} if qwen3 else {}
        images = Qwen2VLImageProcessorPil(
            patch_size=vision.get("patch_size", 14), merge_size=vision.get(
                "spatial_merge_size", 2), temporal_patch_size=vision.get("temporal_patch_size", 2),
            size={"shortest_edge": 65536 if qwen3 else 3136, "longest_edge": 1024 * 1024},
            **extra)
    base = {"qwen3_vl": "Qwen3VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor"}.get(
        files.config.get("model_type"), "Qwen2VLProcessor")
    return without_video(getattr(transformers, base), images, tok,
                         tok.chat_template or _template_file(files.processor))


def _template_file(folder: Path) -> str | None:
    """The processor's chat template where a folder keeps it apart from the tokenizer
    (chat_template.jinja, or chat_template.json's "chat_template"), else None."""
    import json

    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    try:
        data = json.loads((folder / "chat_template.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data.get("chat_template") if isinstance(data, dict) else None


def _processor(files: CaptionerFiles) -> Any:
    """The model's processor (images and text), read locally."""
    from transformers import AutoProcessor

    try:
        if files.kind == "qwen_vl":
            proc = _qwen_processor(files)
        else:
            proc = AutoProcessor.from_pretrained(files.processor, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ModelFileError(f"cannot read the captioning model's processor/tokenizer in "
                             f"{files.processor}: {err}") from None
    if files.kind != "florence2":
        proc.tokenizer.padding_side = "left"  # decoder-only: prompts end where answers start
    return proc


def _chat_prompt(proc: Any, kind: str, text: str, images: int = 1) -> str:
    """The prompt for `images` images (a video's frames, for Qwen-VL) and `text`: the model's
    chat template (no thinking), or, without a usable template, the format it was trained on."""
    content = [{"type": "image"}] * images + [{"type": "text", "text": text}]
    messages = [{"role": "user", "content": content}]
    if kind == "llava":
        messages.insert(0, {"role": "system", "content": [{"type": "text",
                                                           "text": LLAVA_SYSTEM}]})
    image_token = getattr(proc, "image_token", None) or "<image>"
    template = getattr(proc, "chat_template", None) or proc.tokenizer.chat_template or ""
    # Thinking off wherever the template has the switch (Qwen3's); others are never asked.
    extra = {"enable_thinking": False} if "enable_thinking" in str(template) else {}
    try:
        prompt = proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                          **extra)
    except (ValueError, TypeError, AttributeError) as err:  # no template, or a text-only one
        log.debug("chat template not used (%s); writing the prompt format directly", err)
        prompt = ""
    if isinstance(prompt, str) and image_token in prompt:
        return prompt
    if kind == "qwen_vl":
        return QWEN_CHATML.format(images=QWEN_IMAGE * images, text=text)
    return f"USER: {image_token}\n{text} ASSISTANT:"


class VisionLanguageCaptioner:
    """A loaded vision-language captioner: `caption(images)` answers `instruction` for each."""

    def __init__(self, files: CaptionerFiles, hardware: Hardware, instruction: str,
                 max_tokens: int) -> None:
        self.kind, self.max_tokens = files.kind, max_tokens
        self.device = hardware.torch_device()
        self.dtype = hardware.dtype(self.device)
        self.model = _load_model(files, self.dtype)
        self.processor = _processor(files)
        if hardware.quantize != "nf4":  # int8 quantizes on the device; nf4 places itself
            self.model.to(self.device)
        _quantize(self.model, hardware.quantize, self.dtype, self.device)
        self.model.to(self.device)
        self.instruction = instruction
        self.prompt = self._prompt(1)

    def _prompt(self, images: int) -> str:
        """The prompt for `images` images (Florence-2 takes the bare task instruction)."""
        if self.kind == "florence2":
            return self.instruction
        return _chat_prompt(self.processor, self.kind, self.instruction, images)

    def caption(self, images: list[Any]) -> list[str]:
        """One raw answer per image (PIL images), greedy, at most `max_tokens` tokens each."""
        if self.kind == "qwen_vl":
            images = [_at_most(im, MAX_PIXELS) for im in images]
        return self._generate([self.prompt] * len(images), images)

    def caption_frames(self, clips: list[list[Any]]) -> list[str]:
        """One raw answer per clip (a video's sampled frames): Qwen-VL sees all its frames in
        one message; Florence-2 and LLaVA, which read one image, its middle frame."""
        if self.kind != "qwen_vl":
            return self.caption([frames[len(frames) // 2] for frames in clips])
        # A clip's frames share the megapixel one image gets: the prompt stays as long.
        images = [_at_most(im, MAX_PIXELS // len(frames)) for frames in clips for im in frames]
        return self._generate([self._prompt(len(frames)) for frames in clips], images)

    @torch.inference_mode()
    def _generate(self, prompts: list[str], images: list[Any]) -> list[str]:
        """The answers to `prompts`, whose image slots take `images` in order."""
        inputs = self.processor(text=prompts, images=images, return_tensors="pt", padding=True)
        inputs = {k: v.to(self.device, dtype=self.dtype) if v.is_floating_point()
                  else v.to(self.device) for k, v in inputs.items()}
        out = self.model.generate(**inputs, max_new_tokens=self.max_tokens, do_sample=False,
                                  num_beams=1)
        if not self.model.config.is_encoder_decoder:
            out = out[:, inputs["input_ids"].shape[1]:]  # the answer after the prompt
        return self.processor.batch_decode(out, skip_special_tokens=True)


def _at_most(image: Any, pixels: int) -> Any:
    """`image` scaled down (aspect kept) to at most `pixels` pixels; as it is when smaller."""
    area = image.width * image.height
    if area <= pixels:
        return image
    scale = (pixels / area) ** 0.5
    return image.resize((max(1, int(image.width * scale)), max(1, int(image.height * scale))))


def _quantize(model: Any, method: str, dtype: torch.dtype, device: torch.device) -> None:
    """Quantize the language model's Linear weights (int8 through torchao, nf4 through
    bitsandbytes on CUDA); the vision tower, projector, embeddings and head stay as loaded."""
    if method == "none":
        return
    if method == "nf4" and device.type != "cuda":
        raise EnvironmentProblem("--quantize nf4 runs on CUDA only (bitsandbytes); use "
                                 "--quantize int8 on the CPU, or --device cuda")
    from difftune.precision.lowbit import quantize

    count = quantize(model, method, dtype, KEEP_HIGH)
    log.info("captioner: %d linear layers quantized (%s)", count, method)
