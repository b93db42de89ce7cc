"""The user-facing text keeps up with the code: every family is listed where families are
listed, and the docs point only at files inside the repository."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from difftune.families import registry

ROOT = Path(__file__).resolve().parents[2]


def test_config_reference_lists_every_family() -> None:
    row = next(line for line in (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
               if line.startswith("| `model.family` |") and "model family:" in line)
    missing = [name for name in registry.names() if f'`"{name}"`' not in row]
    assert not missing, f"README's model.family row lacks {missing}"


def test_pyproject_description_is_not_a_subset_of_the_families() -> None:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    for title in ("FLUX.1", "FLUX.2", "Chroma", "SD3", "SDXL", "Z-Image", "Qwen-Image", "Krea 2",
                  "Wan"):
        assert title in meta["description"], title


def test_docs_point_only_inside_the_repository() -> None:
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = page.read_text(encoding="utf-8")
        outside = re.findall(r"(?<!\.)\.\./[\w./-]+", text)  # not an ellipsis ".../x"
        assert not outside, f"{page.name} points outside the repository: {outside}"
        for ref in set(re.findall(r"`(docs/[\w.-]+\.md)`", text)):
            assert (ROOT / ref).is_file(), f"{page.name} names {ref}, which does not exist"
