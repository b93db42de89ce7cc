"""Training paths every family takes through the real CLI on its tiny flavor: block swap and
gradient checkpointing train bitwise like the plain run, exact resume and disk caches with
caption augmentations, two processes against one, and the refusals the family's spec declares
(test_precision_matrix covers every family's precision cells).

Parametrized over the registry. The block swap, resume and disk cache paths are the same code
for every family but for the text embeddings they carry: by default they run once per text
path (`text_path`: each encoder's kind and whether its outputs are trimmed to the caption's
tokens, so variable-length entries are padded back per batch), for the first family in registry
order with that path among the families with a decoder-LLM text encoder (variable-length,
templated or stacked embeddings that the older suites' FLUX.1 runs never exercise) or a trimmed
one (Wan's UMT5): today Z-Image (decoder, trimmed), FLUX.2 (decoder, fixed length, stacked
layers), Wan (trimmed T5) and Anima (a trimmed decoder and trimmed T5 tokens together). The
others run with `--full` (Qwen-Image, ERNIE-Image and Krea 2 repeat one of those paths; the
CLIP/T5 families' paths are covered by test_resume, test_memory_savers, test_distributed and
test_disk_cache). A family registered later joins the default tier here only with a text path
no earlier family has (`conftest.family_tier`). Two processes run by default only for one
family with variable-length captions (the batching two processes could split apart),
Qwen-Image, whose padded batches reach the denoiser (see TWO_PROCESS_DEFAULT). The declared
refusals are family facts: every family by default."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from difftune import families
from difftune.cli import main
from difftune.families.common.diffusers_layout import DiffusersLayoutFamily

from ..conftest import (family_tier, metrics_rows, run_toml, stopped_and_resumed, train_cli,
                        train_exit_code)

AUGMENT = ["datasets.0.shuffle_caption=true", "datasets.0.caption_tag_dropout_rate=0.3",
           "datasets.0.flip=true", "train.grad_accum=2", "save.every_n_steps=3"]


def text_path(name: str) -> tuple[tuple[str, bool], ...] | None:
    """The text path a family's runs take through caches and batches: (kind, trimmed) of each
    text encoder; None for families without a decoder-LLM or trimmed encoder (the older
    suites cover theirs)."""
    encoders = families.spec(name).text_encoders
    if not any(s.kind == "decoder" or s.trim for s in encoders):
        return None
    return tuple((s.kind, s.trim) for s in encoders)


FAMILIES = family_tier(text_path)


# The two-process case of the default tier: Qwen-Image, whose trimmed captions reach its
# denoiser padded per batch with a mask (one process of batch 2 pads, two of batch 1 do not).
# Z-Image, the other variable-length family, takes the same two-process path (per-process
# batches of trimmed disk entries) and hands each caption's own tokens to its denoiser, so no
# padding reaches it: its case repeats Qwen-Image's and runs with --full.
TWO_PROCESS_DEFAULT = "qwen_image"


def _variable_length(name: str) -> object:
    """The family as a parameter for the two-process test: default tier for
    TWO_PROCESS_DEFAULT (captions variable-length: trimmed entries padded per batch, the path
    processes could split differently), else --full (fixed-length text batches like the older
    families', or another variable-length family's repeat of that path)."""
    trims = any(s.trim for s in families.spec(name).text_encoders)
    assert trims or name != TWO_PROCESS_DEFAULT
    return pytest.param(name, marks=() if name == TWO_PROCESS_DEFAULT else pytest.mark.full_only)


VARIABLE_LENGTH = [_variable_length(n) for n in families.names()]


def outputs(out: Path) -> tuple[list[float], dict[str, torch.Tensor]]:
    """A run's losses and its saved LoRA."""
    return [r["loss"] for r in metrics_rows(out)], load_file(str(out / "lora.safetensors"))


def assert_same(a: Path, b: Path) -> None:
    """Bitwise equal losses and LoRA tensors."""
    (la, wa), (lb, wb) = outputs(a), outputs(b)
    assert la == lb
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.parametrize("family", FAMILIES)
def test_block_swap_and_checkpointing_train_like_the_plain_run(family: str, images: Path,
                                                              tmp_path: Path) -> None:
    plain = train_cli(tmp_path / "plain", images, steps=2, family=family)
    ckpt = train_cli(tmp_path / "ckpt", images, "train.gradient_checkpointing=true", steps=2,
                     family=family)
    assert_same(plain, ckpt)
    if not families.spec(family).swap_blocks:
        return
    swap = train_cli(tmp_path / "swap", images, "train.gradient_checkpointing=true",
                     "train.blocks_to_swap=1", steps=2, family=family)
    assert_same(plain, swap)
    assert re.search(r"block swap: 1 of \d+ denoiser blocks live in host memory",
                     (swap / "difftune.log").read_text())


@pytest.mark.parametrize("family", FAMILIES)
def test_stopped_and_resumed_run_equals_an_uninterrupted_one(
        family: str, tmp_path: Path, images: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = run_toml(tmp_path / "a", images, steps=6, family=family)
    b = run_toml(tmp_path / "b", images, steps=6, family=family)
    rows = stopped_and_resumed(a, b, monkeypatch, 3, *AUGMENT)
    assert rows[0] == rows[1]
    assert_same(tmp_path / "a" / "out", tmp_path / "b" / "out")


@pytest.mark.parametrize("family", FAMILIES)
def test_disk_cache_with_caption_augmentations_equals_the_memory_cache(
        family: str, images: Path, tmp_path: Path) -> None:
    """Caption-augmented runs read back from disk train exactly as with the memory cache, the
    second disk run reading what the first wrote."""
    sets = ["datasets.0.shuffle_caption=true", "datasets.0.caption_tag_dropout_rate=0.3"]
    disk = [*sets, 'cache.text="disk"', 'cache.latents="disk"',
            f'cache.dir="{(tmp_path / "cache").as_posix()}"']
    memory = train_cli(tmp_path / "memory", images, *sets, steps=3, family=family)
    first = train_cli(tmp_path / "first", images, *disk, steps=3, family=family)
    entries = sorted(p.name for p in (tmp_path / "cache").rglob("*") if p.is_file())
    second = train_cli(tmp_path / "second", images, *disk, steps=3, family=family)
    assert entries and entries == sorted(p.name for p in (tmp_path / "cache").rglob("*")
                                         if p.is_file())
    assert_same(memory, first)
    assert_same(memory, second)


@pytest.mark.parametrize("family", VARIABLE_LENGTH)
def test_two_processes_match_one_with_the_same_global_batch(family: str, images: Path,
                                                            tmp_path: Path) -> None:
    """Two processes of batch 1 (accelerate launch, gloo, disk caches shared between them) train
    as one process of batch 2 does (whose batches pad captions of unequal length)."""
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    one = run_toml(tmp_path / "one", images, steps=2, family=family)
    assert train_exit_code(one) == 0
    two = run_toml(tmp_path / "two", images, steps=2, family=family)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
           "2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", "0", "-m", "difftune", "train", str(two), "--no-progress",
           "--set", "train.batch_size=1", "--set", 'cache.text="disk"',
           "--set", 'cache.latents="disk"']
    root = Path(__file__).resolve().parents[3]
    done = subprocess.run(cmd, cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    (la, wa), (lb, wb) = outputs(tmp_path / "one" / "out"), outputs(tmp_path / "two" / "out")
    assert la == pytest.approx(lb, rel=1e-5)
    assert wa.keys() == wb.keys()
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) <= 0.1 * 1e-2  # 0.1 x lr


def _declared_refusals(family: str) -> list[tuple[list[str], str]]:
    """(settings, message) for each refusal the family declares: text encoders that cannot get
    a LoRA, and the kohya layout where only the diffusers one is written."""
    spec = families.spec(family)
    out = [([f'adapter.text_encoders=["{name}"]'],
            f"'{name}' of model.family = \"{family}\" cannot get a LoRA")
           for name, _ in spec.text_encoder_lora_refused]
    if isinstance(families.get(family), DiffusersLayoutFamily):
        out.append((['save.format="kohya"'],
                    f'save.format = "kohya" is not written for model.family = "{family}"'))
    return out


@pytest.mark.parametrize("family", families.names())
def test_declared_refusals_stop_the_run_before_anything_is_written(
        family: str, tmp_path: Path, images: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for i, (sets, message) in enumerate(_declared_refusals(family)):
        (tmp_path / str(i)).mkdir()
        cfg = run_toml(tmp_path / str(i), images, family=family)
        args = ["train", str(cfg), "--no-progress", *[x for s in sets for x in ("--set", s)]]
        assert main(args) == 2
        assert message in capsys.readouterr().err
        assert not (tmp_path / str(i) / "out" / "lora.safetensors").exists()
    refused = families.spec(family).embeddings_refused
    if refused is not None:
        (tmp_path / "emb").mkdir()
        cfg = run_toml(tmp_path / "emb", images, family=family)
        cfg.write_text(cfg.read_text().replace(
            "[[datasets]]",
            '[[adapter.embeddings]]\nname = "<sks>"\ninit = "a dog"\n\n[[datasets]]', 1))
        assert main(["check", str(cfg)]) == 2
        assert refused in capsys.readouterr().err
