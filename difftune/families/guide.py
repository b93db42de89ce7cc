"""Documentation written from the family specs, so it says what the code does: the README's
table of LoRA layouts per family. Tests compare the documents with these functions' output;
`python -m difftune.families.guide` prints it, to paste where they differ."""

from __future__ import annotations

from difftune.families import registry

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
        others = ", ".join(f'`"{f}"`' for f in spec.formats if f != spec.default_format)
        words = _FORMAT_WORDS[spec.default_format].format(part=spec.denoiser_part)
        rows.append(f'| `{name}` | `"{spec.default_format}"`: {words} | {others} |')
    return "\n".join(rows) + "\n"


if __name__ == "__main__":  # the generated blocks, to paste into README.md
    print(layouts_table(), end="")
