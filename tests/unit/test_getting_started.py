"""docs/getting-started.md is the family specs' own account of their files: the page equals
the generator's output, every family and variant has a block, and each block's `[model]`
lines (single files included) are a model table the config accepts for that family."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from difftune.config.model_source import source_problems
from difftune.config.sections import ModelConfig
from difftune.families import guide, registry

DOC = Path(__file__).resolve().parents[2] / "docs" / "getting-started.md"


def _generated() -> str:
    found = re.search(r"<!-- getting-started:start -->\n(.*?)<!-- getting-started:end -->",
                      DOC.read_text(encoding="utf-8"), re.S)
    assert found is not None
    return found[1]


def test_the_page_is_the_generators_output() -> None:
    assert _generated() == guide.getting_started(), \
        "regenerate it: python -m difftune.families.guide getting-started"


def test_every_family_and_variant_has_its_files_and_config_lines() -> None:
    blocks = re.split(r"^### ", _generated(), flags=re.M)[1:]
    kinds = [(name, variant, spec) for name in registry.names()
             for variant, spec in registry.variant_specs(name)]
    assert len(blocks) == len(kinds)
    for block, (name, variant, spec) in zip(blocks, kinds):
        assert spec.files.folder in block
        assert all(f"| `{key}` | {what} |" in block for key, what in spec.files.singles)
        toml = re.search(r"```toml\n(.*?)```", block, re.S)[1]
        model = tomllib.loads(toml)["model"]
        assert model["family"] == name and model.get("variant") == variant
        assert source_problems(ModelConfig.model_validate(model)) == []  # the folder
        singles = tomllib.loads(re.sub(r"^# ", "", toml, flags=re.M))["model"]
        assert set(singles) - set(model) == set(spec.files.keys)
        assert source_problems(ModelConfig.model_validate(singles)) == []  # every file named
