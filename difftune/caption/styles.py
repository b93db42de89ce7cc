"""Caption styles: what each kind of captioner is asked, and how its answer becomes a line.

Instruct models (Qwen-VL, LLaVA) get a plain instruction; Florence-2 gets its task tokens
(it was trained on them, not on free instructions); a tagger has only one style, tags.
"""

from __future__ import annotations

import re

from difftune.errors import ConfigError

STYLES = ("short", "detailed", "tags", "prompt")
INSTRUCTIONS = {
    "short": "Write a one-sentence caption for this image: the subject, what it does and the "
             "setting. Answer with the caption only.",
    "detailed": "Describe this image in one detailed paragraph: the subject and its appearance, "
                "the setting, lighting, composition and visual style. Answer with the "
                "description only.",
    "tags": "List booru-style tags for this image, comma-separated, most important first "
            "(subject, clothing, pose, setting, style). Answer with the tags only.",
}
FLORENCE_TASKS = {"short": "<CAPTION>", "detailed": "<MORE_DETAILED_CAPTION>"}
THINKING = re.compile(r"<think>.*?(</think>|$)", re.DOTALL)


def default_style(kind: str) -> str:
    """The style a captioner kind uses when none is given: tags for a tagger, else short."""
    return "tags" if kind == "wd14" else "short"


def instruction(kind: str, style: str, prompt: str | None) -> str:
    """The text a captioner of `kind` is given for `style` (`prompt` for the "prompt" style);
    a `ConfigError` for a style the kind cannot do."""
    if style == "prompt":
        if not prompt:
            raise ConfigError("--style prompt needs --prompt TEXT (the instruction each image "
                              "is captioned with)")
        return prompt
    if kind == "wd14":
        if style != "tags":
            raise ConfigError(f"a WD14 tagger writes tags only, not --style {style}; use "
                              "--style tags, or a vision-language model for sentences")
        return ""
    if kind == "florence2":
        if style not in FLORENCE_TASKS:
            raise ConfigError(f"Florence-2 writes sentences, not --style {style}; use short or "
                              "detailed, or a WD14 tagger (or a Qwen-VL model) for tags")
        return FLORENCE_TASKS[style]
    return INSTRUCTIONS[style]


def clean(answer: str) -> str:
    """A model's answer as one caption line: any thinking block dropped, whitespace (newlines
    included) collapsed, surrounding quotes removed."""
    text = THINKING.sub(" ", answer)
    text = " ".join(text.split())
    return text.strip().strip('"').strip()


def with_prefix(caption: str, prefix: str, trigger: str) -> str:
    """`prefix`, then `trigger` unless the caption already holds it as a word, then the
    caption, joined with ", " (the separator tag captions use and sentence captions read)."""
    has_trigger = bool(trigger) and re.search(rf"(?<!\w){re.escape(trigger)}(?!\w)", caption,
                                              re.IGNORECASE) is not None
    parts = (prefix.strip(), "" if has_trigger else trigger.strip(), caption)
    return ", ".join(p for p in parts if p)


def appended(existing: str, caption: str) -> str:
    """`caption` after an existing caption (--append), joined with ", "."""
    existing = existing.strip().rstrip(",").strip()
    return f"{existing}, {caption}" if existing else caption
