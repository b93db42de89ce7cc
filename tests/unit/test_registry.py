"""The family registry and the family folders agree, and specs are light (no torch)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

import difftune.families
from difftune import families
from difftune.config import load_config
from difftune.errors import ConfigError
from difftune.families import registry
from difftune.families.specs import FamilySpec

ROLES = ("spec.py", "family.py", "files.py", "keys.py", "tiny.py")
ROOT = Path(difftune.families.__file__).parent
FOLDERS = sorted(p.name for p in ROOT.iterdir()
                 if p.is_dir() and p.name not in ("common", "__pycache__"))


def test_every_folder_has_the_roles_and_a_registry_line() -> None:
    assert FOLDERS == sorted(registry.names())
    for name in FOLDERS:
        missing = [r for r in ROLES if not (ROOT / name / r).is_file()]
        assert not missing, f"families/{name} lacks {missing}"
        spec_module, family_path = registry.FAMILIES[name]
        assert spec_module == f"difftune.families.{name}.spec"
        assert family_path.startswith(f"difftune.families.{name}.family.")


def test_specs_import_without_torch() -> None:
    code = ("import sys\n"
            "from difftune.families import registry\n"
            "for n in registry.names():\n"
            "    registry.spec(n)\n"
            "import difftune.config\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n"
            "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


@pytest.mark.parametrize("name", registry.names())
def test_spec_facts_equal_the_family_class(name: str) -> None:
    spec = families.spec(name)
    assert isinstance(spec, FamilySpec) and spec.name == name
    family = families.get(name)
    for fact in ("name", "text_encoders", "bucket_step", "denoiser_prefix", "default_cfg",
                 "text_encoder_prefixes", "keep_high", "swap_blocks", "compile_blocks",
                 "default_format"):
        assert getattr(family, fact) == getattr(spec, fact), fact
    assert set(spec.text_encoder_prefixes) == set(spec.encoder_names)
    assert [n for n, _, _ in spec.encoder_parts] == list(spec.encoder_names)
    assert spec.objective in ("flow", "ddpm")


@pytest.mark.parametrize("name", registry.names())
def test_spec_names_the_loaded_tiny_components(name: str) -> None:
    import torch

    from difftune.config import ModelConfig, PrecisionConfig
    from difftune.precision.policy import PrecisionPolicy

    spec = families.spec(name)
    policy = PrecisionPolicy.from_config(PrecisionConfig(), torch.device("cpu"))
    comps = families.get(name).load(ModelConfig(family=name, flavor="tiny"), policy)
    assert tuple(comps.text_encoders) == spec.encoder_names
    assert tuple(comps.tokenizers) == spec.encoder_names
    # The denoiser is the class the family's diffusers pipeline declares for that component.
    import inspect

    import diffusers

    pipeline = getattr(diffusers, spec.pipeline_class)
    if issubclass(pipeline, diffusers.ModularPipeline):  # its blocks declare the components
        blocks = getattr(diffusers, pipeline.default_blocks_name)()
        expected = next(c.type_hint for c in blocks.expected_components
                        if c.name == spec.denoiser_part)
    else:
        expected = inspect.signature(pipeline.__init__).parameters[spec.denoiser_part].annotation
    assert isinstance(comps.denoiser, expected)


def test_unknown_family_is_refused_naming_the_choices(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('[model]\nfamily = "sd21"\nflavor = "tiny"\n[[datasets]]\npath = "x"\n'
                    '[save]\ndir = "out"\n')
    with pytest.raises(ConfigError) as err:
        load_config(path)
    names = registry.names()
    choices = ", ".join(repr(n) for n in names[:-1]) + f" or {names[-1]!r}"
    assert f"model.family: Input should be {choices} (got 'sd21')" in str(err.value)
    with pytest.raises(ConfigError, match="choose one of"):
        families.get("sd21")


def test_block_swap_on_a_family_without_swap_blocks_is_refused_at_load(tmp_path: Path) -> None:
    # The dataset path does not exist: the refusal comes from load_config, before any scan.
    path = tmp_path / "run.toml"
    path.write_text('[model]\nfamily = "sdxl"\nflavor = "tiny"\n'
                    '[[datasets]]\npath = "no-such-folder"\n'
                    '[train]\nblocks_to_swap = 2\n[save]\ndir = "out"\n')
    with pytest.raises(ConfigError, match="the sdxl family cannot swap blocks"):
        load_config(path)


def test_spec_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        families.spec("flux").bucket_step = 8  # type: ignore[misc]


def test_output_embeddings_in_a_pooled_only_encoder_are_refused_at_load(tmp_path: Path) -> None:
    # FLUX.1 reads only CLIP-L's pooled output: an output embedding there would change nothing.
    # The dataset path does not exist: the refusal comes from load_config, before any scan.
    path = tmp_path / "run.toml"
    body = ('[model]\nflavor = "tiny"\n[adapter]\ntype = "embedding"\n'
            '[[adapter.embeddings]]\nname = "<sks>"\nkind = "output"\n{encoders}'
            '[[datasets]]\npath = "no-such-folder"\n[save]\ndir = "out"\n')
    path.write_text(body.format(encoders=""))
    with pytest.raises(ConfigError, match="output embeddings in clip_l change nothing"):
        load_config(path)
    path.write_text(body.format(encoders='encoders = ["t5"]\n'))
    assert load_config(path).adapter.embeddings[0].encoders == ["t5"]
