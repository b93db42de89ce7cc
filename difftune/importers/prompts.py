"""Sample prompts given inline (ai-toolkit's `sample.prompts`, OneTrainer's `samples`) as the
lines of a difftune prompt file, each prompt's own settings as kohya-style options."""

from __future__ import annotations

from typing import Any

from difftune.importers.notes import Translation

# A prompt's own settings by each trainer's name -> the prompt file's option.
OPTIONS = {"width": "--w", "height": "--h", "seed": "--d", "sample_steps": "--s",
           "diffusion_steps": "--s", "guidance_scale": "--g", "cfg_scale": "--l",
           "neg": "--n", "negative_prompt": "--n"}


def line(prompt: str, settings: dict[str, Any]) -> str:
    """One prompt file line: the prompt, then its options (newlines flattened)."""
    text = " ".join(prompt.split())
    for key, flag in OPTIONS.items():
        value = settings.get(key)
        if value not in (None, "", False):
            text += f" {flag} {' '.join(str(value).split())}"
    return text


def write_prompts(t: Translation, sample: dict[str, Any], trigger: str = "") -> None:
    """ai-toolkit's prompts (strings, or `samples` tables) with the shared negative prompt;
    `[trigger]` replaced by the trigger word, as ai-toolkit does."""
    items: list[Any] = list(sample.get("prompts") or []) + list(sample.get("samples") or [])
    neg = sample.get("neg") or ""
    for item in items:
        if isinstance(item, str):
            t.prompts.append(line(item.replace("[trigger]", trigger), {"neg": neg}))
        elif isinstance(item, dict) and item.get("prompt"):
            prompt = str(item["prompt"]).replace("[trigger]", trigger)
            t.prompts.append(line(prompt, {"neg": neg, **item}))
    prompts_file(t, "sample.prompts")


def prompts_file(t: Translation, source: str) -> None:
    """Point sample.prompts at the prompt file the import writes (when there are prompts)."""
    if t.prompts:
        t.put("sample.prompts", t.prompt_file, f"{source} ({len(t.prompts)} prompts)",
              f"written to {t.prompt_file} beside the run file, one prompt a line")
