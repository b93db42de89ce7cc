"""Documentation written from the family specs, so it says what the code does: the README's
table of LoRA layouts per family and the per-family blocks of docs/getting-started.md (from
each spec's `ModelFiles` and `ModelSize`). Tests compare the documents with these functions'
output; `python -m difftune.families.guide` prints the table, and `python -m
difftune.families.guide getting-started` the blocks, to paste where they differ."""

from __future__ import annotations

import re
import sys

from difftune.families import registry
from difftune.families.specs import FamilySpec

# What each `save.format` writes, in words.
_FORMAT_WORDS = {"diffusers": "diffusers names (`{part}.<module>`)",
                 "kohya": "kohya names (`lora_unet_<module>`)",
                 "original": "the model's own names (`diffusion_model.<module>`)"}


def layouts_table() -> str:
    """Per family: the LoRA layout difftune writes by default and the others `save.format`
    takes, from each spec's `default_format` and `formats`."""
    rows = ["| `model.family` | written by default (`save.format` unset) | `save.format` also "
            "takes |", "|---|---|---|"]
    for name in registry.names():
        spec = registry.spec(name)
        others = ", ".join(f'`"{f}"`' for f in spec.formats if f != spec.default_format) or "none"
        words = _FORMAT_WORDS[spec.default_format].format(part=spec.denoiser_part)
        rows.append(f'| `{name}` | `"{spec.default_format}"`: {words} | {others} |')
    return "\n".join(rows) + "\n"


def getting_started() -> str:
    """One block per family and variant: what to download, which single files may replace the
    folder's parts, what the folder must still hold, and the config lines."""
    return "\n".join(_block(spec, variant) for name in registry.names()
                     for variant, spec in registry.variant_specs(name))


def _repo(folder: str) -> str | None:
    """The Hub repository a `ModelFiles.folder` names first (`owner/name`), or None."""
    found = re.match(r"([\w.-]+/[\w.-]+)", folder)
    return found[1] if found else None


def _file(what: str) -> str:
    """The file name a single-file description starts with, or a placeholder for it."""
    first = what.split(",")[0].strip()
    return first if re.fullmatch(r"[\w.-]+\.safetensors", first) else f"<{first}>"


def _no_folder(repos: tuple[str, ...]) -> str:
    """Where the tokenizers come from when a family needs no folder beside its single files."""
    names = " and ".join(f"`{r}`" for r in repos)
    return ("With every single file given, `model.path` may be left out: the tokenizers, which "
            f"no single file holds, are then read from the local Hugging Face cache of {names} "
            "(never downloaded by difftune; this puts only their tokenizer and config files "
            "there):")


def _block(spec: FamilySpec, variant: str | None) -> str:
    """The getting-started block of one family (variant)."""
    files, repo = spec.files, _repo(spec.files.folder)
    local = f"/models/{repo.split('/')[1]}" if repo else "/models/<the folder>"
    title = f"`{spec.name}`" + (f", variant `{variant}`" if variant else "")
    lines = [f"### {title}", "", f"The diffusers folder: **{files.folder}**."]
    if repo:
        lines += ["", "```bash", f"hf download {repo} --local-dir {local}", "```"]
    lines += ["", "Or ComfyUI's single files over that folder's parts:", "",
              "| `[model]` key | the file |", "|---|---|"]
    lines += [f"| `{key}` | {what} |" for key, what in files.singles]
    holds = files.folder_holds
    lines += ["", f"With single files, `model.path` must still hold {holds}; the same "
              "repository has them" if holds else _no_folder(files.tokenizer_repos)]
    parts = re.findall(r"\b([\w]+)/", holds or "") + \
        (["model_index.json"] if holds and "model_index.json" in holds else [])
    if holds is None:
        lines += ["", "```bash"] + [f'hf download {r} --include "*.json" --include "*.txt" '
                                    '--include "*.model"' for r in files.tokenizer_repos]
        lines += ["```"]
    elif repo and parts:
        include = " ".join(f'--include "{p}/*"' if p != "model_index.json" else
                           f'--include "{p}"' for p in parts)
        lines[-1] += ", and this downloads only them:"
        lines += ["", "```bash", f"hf download {repo} {include} --local-dir {local}", "```"]
    elif holds:
        lines[-1] += "."
    lines += ["", "```toml", "[model]", f'family = "{spec.name}"']
    lines += [f'variant = "{variant}"'] if variant else []
    lines += [f'path = "{local}"']
    lines += [f'# {key} = "/models/{_file(what)}"' for key, what in files.singles]
    lines += ["```"]
    if spec.sizes:
        sizes = "; ".join(f"{z.name}: denoiser {z.denoiser:.2f} B, text encoders "
                          f"{z.encoders:.2f} B" for z in spec.sizes)
        lines += ["", f"Parameters ({sizes}) and what each GPU size needs: README, Memory "
                  "savers."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # the generated blocks, to paste into README.md and the docs page
    print(getting_started() if sys.argv[1:] == ["getting-started"] else layouts_table(),
          end="")
