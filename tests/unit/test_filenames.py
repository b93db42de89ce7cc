"""File-name rules: one stem rule for embedding files, and names that must fit the file system."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch

from difftune.adapters.formats import save_lora
from difftune.files.names import (TEMP_EXTRA, embedding_stem, name_max, name_too_long,
                                step_name)


def test_embedding_stem_keeps_only_file_name_characters() -> None:
    assert embedding_stem("<sks>") == embedding_stem("sks") == "sks"
    assert embedding_stem("a/b") == "ab" and embedding_stem("<>") == "embedding"


def test_name_max_asks_the_nearest_existing_folder(tmp_path: Path) -> None:
    assert name_max(tmp_path / "not" / "yet") == name_max(tmp_path) > 0


def test_the_temporary_name_of_a_save_is_what_the_rule_counts(tmp_path: Path) -> None:
    """save_lora's temporary file is TEMP_EXTRA bytes longer than the final name: a name at the
    rule's limit is written, one byte more fails the way the rule predicts."""
    limit = name_max(tmp_path)
    fits = "x" * (limit - TEMP_EXTRA - len(".safetensors")) + ".safetensors"
    save_lora(tmp_path / fits, {"w": torch.zeros(2)}, {})
    assert (tmp_path / fits).is_file()
    with pytest.raises(OSError) as err:
        save_lora(tmp_path / ("x" + fits), {"w": torch.zeros(2)}, {})
    assert err.value.errno == errno.ENAMETOOLONG


def test_name_too_long_counts_the_step_tag_of_the_last_step(tmp_path: Path) -> None:
    room = name_max(tmp_path) - TEMP_EXTRA - len(step_name("", 10**7))
    assert name_too_long("n" * room, 10**7, tmp_path) is None
    why = name_too_long("n" * (room + 1), 10**7, tmp_path)
    assert why is not None and f"at most {room} bytes" in why and "-step10000000" in why


def test_a_dora_runs_comfyui_file_counts_in_the_name_rule(tmp_path: Path) -> None:
    """A DoRA run also writes `<name>-stepN-comfyui.safetensors`: a save.name that fits the
    plain files but not that one is refused at load, naming the longer file."""
    from difftune.config import load_config
    from difftune.errors import ConfigError

    room = name_max(tmp_path) - TEMP_EXTRA - len(step_name("", 10))
    text = (f'[model]\nflavor = "tiny"\n[[datasets]]\npath = "{tmp_path.as_posix()}"\n'
            f'[train]\nsteps = 10\n[save]\ndir = "{(tmp_path / "out").as_posix()}"\n'
            f'name = "{"n" * room}"\n')
    cfg = tmp_path / "run.toml"
    cfg.write_text(text, encoding="utf-8")
    load_config(cfg, ["adapter.dora=true", "save.dora_comfyui=false"])
    with pytest.raises(ConfigError, match=r"save.name: .*'<it>-step000010-comfyui.safetensors'"):
        load_config(cfg, ["adapter.dora=true"])
