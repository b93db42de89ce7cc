"""Hostile inputs through the real CLI (issue 14): every bad config is exit 2 with one message
naming the field and the fix, no traceback, before anything heavy runs; odd images train as the
pictures they are or are skipped with the reason; textual inversion trains on through batches
in which no caption uses the placeholder."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from difftune.cli import main
from difftune.files.names import name_max

from .conftest import metrics_rows, run_toml


def refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run the CLI, which must exit 2 with a message and no traceback; returns stderr."""
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert err.startswith("error: ") and "Traceback" not in err + out
    return err


def edit(path: Path, old: str, new: str) -> Path:
    """Replace `old` (which must be there) by `new` in the run file."""
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))
    return path


def test_infinite_lr_is_refused_in_a_real_process(tmp_path: Path, images: Path) -> None:
    """`lr = inf` was accepted and trained every tensor to NaN with exit 0."""
    cfg = edit(run_toml(tmp_path, images), "lr = 1e-2", "lr = inf")
    proc = subprocess.run([sys.executable, "-m", "difftune", "train", str(cfg), "--no-progress"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "train.lr: Input should be a finite number" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_bad_numbers_and_options_are_all_named_at_once(tmp_path: Path, images: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    cfg = run_toml(tmp_path, images)
    err = refused(capsys, "check", str(cfg), "--set", "train.betas=[1.0, 0.999]",
                  "--set", "train.guidance=nan", "--set", 'datasets.0.caption_ext=""',
                  "--set", "sample.keep_last=2", "--set", "adapter.embedding_lr=-inf")
    for field in ("train.betas[0]", "train.guidance", "datasets[0].subsets[0].caption_ext",
                  "sample.keep_last", "adapter.embedding_lr"):
        assert f"  - {field}: " in err, (field, err)
    assert "save.keep_last" in err  # what to use instead of sample.keep_last


def test_empty_config_lists_every_missing_section(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "run.toml"
    cfg.write_text("")
    err = refused(capsys, "train", str(cfg))
    assert "3 problem(s)" in err
    assert "  - model: " in err and "  - datasets: " in err and "  - save: " in err


def test_config_path_that_is_a_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert f"{tmp_path} is a folder" in refused(capsys, "train", str(tmp_path))


def test_save_dir_that_is_a_file(tmp_path: Path, images: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    cfg = run_toml(tmp_path, images)
    (tmp_path / "out").write_text("my notes")
    err = refused(capsys, "train", str(cfg), "--no-progress")
    assert "save.dir" in err and "is not a folder" in err
    assert (tmp_path / "out").read_text() == "my notes"


def test_token_warmup_longer_than_the_run_is_refused_not_hung(
        tmp_path: Path, images: Path) -> None:
    """A warm-up of 10**12 steps hung while its texts were listed (every step walked)."""
    cfg = edit(run_toml(tmp_path, images, steps=2), "max_side = 128",
               "max_side = 128\ntoken_warmup_steps = 1000000000000")
    proc = subprocess.run([sys.executable, "-m", "difftune", "train", str(cfg), "--no-progress"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "datasets[0].subsets[0].token_warmup_steps (1000000000000) must be smaller than " \
           "train.steps (2)" in proc.stderr


EMBEDDING = '[[adapter.embeddings]]\nname = "{}"\ntokens = 1\ninit = "a red circle"\n\n'


def with_embeddings(cfg: Path, *names: str, only: bool = False, prefix: str = "") -> Path:
    """Add placeholders (and, with `prefix`, a caption prefix); `only`: textual inversion."""
    tables = "".join(EMBEDDING.format(n) for n in names)
    edit(cfg, "[[datasets]]", tables + "[[datasets]]" + (f'\ncaption_prefix = "{prefix}"'
                                                         if prefix else ""))
    edit(cfg, "rank = 4", ('type = "embedding"\n' if only else "") + "embedding_lr = 0.05\nrank = 4")
    return cfg


@pytest.mark.parametrize("a, b", [("<sks>", "sks"), ("a/b", "ab")])
def test_placeholders_with_one_file_name_are_refused(tmp_path: Path, images: Path, a: str, b: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    cfg = with_embeddings(run_toml(tmp_path, images), a, b)
    err = refused(capsys, "train", str(cfg), "--no-progress")
    assert "adapter.embeddings[1].name" in err and "rename one" in err


def test_file_names_fit_the_file_system_or_are_refused_at_load(
        tmp_path: Path, images: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The longest save.name and placeholder the check allows train and save at every step;
    one byte more is refused at load (it failed with ENAMETOOLONG after training)."""
    room = name_max(tmp_path) - len("-step000002.safetensors") - len("..XXXXXXXX.tmp")
    cfg = with_embeddings(run_toml(tmp_path, images, steps=2), f"<{'p' * room}>",
                          prefix=f"<{'p' * room}>")
    edit(cfg, 'dir = "', f'name = "{"n" * room}"\nevery_n_steps = 1\ndir = "')
    too_long = ["--set", f'save.name="{"n" * (room + 1)}"',
                "--set", f'adapter.embeddings.0.name="{"p" * (room + 1)}"']
    err = refused(capsys, "train", str(cfg), "--no-progress", *too_long)
    assert "save.name: file names made from it are too long" in err
    assert "adapter.embeddings[0].name" in err and f"at most {room} bytes" in err
    assert not (tmp_path / "out").exists()
    assert main(["train", str(cfg), "--no-progress"]) == 0
    out = tmp_path / "out"
    assert (out / f"{'n' * room}-step000001.safetensors").is_file()
    assert (out / "embeddings" / f"{'p' * room}-step000001.safetensors").is_file()


def _png_16bit(path: Path, value: int) -> None:
    """A 16-bit grayscale PNG of one value (PIL writes uint16 arrays as mode I;16)."""
    Image.fromarray(np.full((64, 64), value, dtype=np.uint16)).save(path)


def test_check_lists_an_enormous_upscale_and_trains_a_16_bit_png(
        tmp_path: Path, images: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "data"
    shutil.copytree(images, data)
    _png_16bit(data / "gray16.png", 30000)
    (data / "gray16.txt").write_text("a gray square")
    Image.new("L", (1, 600_000), 128).save(data / "strip.png")  # 32x19200000 once resized
    assert main(["check", str(run_toml(tmp_path, data))]) == 0
    out = capsys.readouterr().out
    assert "7 images, 1 skipped" in out
    assert "strip.png" in out and "decompression-bomb limit" in out


# ------------------------------------------------------------- textual inversion, no placeholder


def embedding_steps(out: Path, steps: int) -> list[torch.Tensor]:
    """The placeholder's clip_l vectors saved after each step (save.every_n_steps = 1)."""
    names = [f"sks-step{s:06d}.safetensors" for s in range(1, steps)] + ["sks.safetensors"]
    return [load_file(str(out / "embeddings" / n))["clip_l"] for n in names]


@pytest.mark.parametrize("mixed", ["no", "fp16"])
def test_textual_inversion_without_the_placeholder_in_a_batch_trains_on(
        tmp_path: Path, images: Path, mixed: str) -> None:
    """No caption uses <sks>: each step has nothing to update, is counted and its loss
    reported (it crashed with "element 0 of tensors does not require grad"); with fp16 the
    loss scaler has no gradient to look at either."""
    cfg = with_embeddings(run_toml(tmp_path, images, steps=2), "<sks>", only=True)
    assert main(["train", str(cfg), "--no-progress", "--set", f'precision.mixed="{mixed}"',
                 "--set", "save.every_n_steps=1"]) == 0
    rows = metrics_rows(tmp_path / "out")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(np.isfinite(r["loss"]) for r in rows)
    first, last = embedding_steps(tmp_path / "out", 2)
    assert torch.equal(first, last)  # no update


def test_pivotal_tuning_trains_the_lora_when_no_caption_uses_the_placeholder(
        tmp_path: Path, images: Path) -> None:
    cfg = with_embeddings(run_toml(tmp_path, images, steps=2), "<sks>")
    assert main(["train", str(cfg), "--no-progress", "--set", "save.every_n_steps=1"]) == 0
    out = tmp_path / "out"
    first, last = embedding_steps(out, 2)
    assert torch.equal(first, last)  # the placeholder had nothing to learn
    a, b = (load_file(str(out / n)) for n in ("lora-step000001.safetensors", "lora.safetensors"))
    lora = [k for k in a if "lora_" in k]
    assert lora and any(not torch.equal(a[k], b[k]) for k in lora)  # the LoRA trained


def test_textual_inversion_resumes_exactly_across_steps_without_the_placeholder(
        tmp_path: Path, images: Path) -> None:
    """Caption dropout leaves some batches without <sks>: those steps change nothing, the
    others train it, and a stopped and resumed run equals one that never stopped."""
    sets = ["--set", "datasets.0.caption_dropout_rate=0.7", "--set", "save.every_n_steps=1"]
    runs = {}
    for name in ("whole", "parts"):
        (tmp_path / name).mkdir()
        runs[name] = with_embeddings(run_toml(tmp_path / name, images, steps=4), "<sks>",
                                     only=True, prefix="<sks>")
    assert main(["train", str(runs["whole"]), "--no-progress", *sets]) == 0
    vectors = embedding_steps(tmp_path / "whole" / "out", 4)
    moved = [not torch.equal(a, b) for a, b in zip(vectors, vectors[1:])]
    assert True in moved and False in moved, moved  # both kinds of step happened
    assert main(["train", str(runs["parts"]), "--no-progress", *sets,
                 "--set", "train.steps=2"]) == 0
    assert main(["train", str(runs["parts"]), "--no-progress", *sets, "--resume", "latest"]) == 0
    whole, parts = (metrics_rows(tmp_path / n / "out") for n in ("whole", "parts"))
    assert [r["loss"] for r in whole] == [r["loss"] for r in parts]
    resumed = load_file(str(tmp_path / "parts" / "out" / "embeddings" / "sks.safetensors"))
    assert torch.equal(vectors[-1], resumed["clip_l"])


def test_max_grad_norm_zero_turns_clipping_off(tmp_path: Path, images: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """README: max_grad_norm "unset: off", which TOML cannot write; 0 now means off."""
    calls: list[float] = []
    real = torch.nn.utils.clip_grad_norm_

    def spy(params: object, max_norm: float, *args: object, **kwargs: object) -> torch.Tensor:
        calls.append(max_norm)
        return real(params, max_norm, *args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", spy)
    cfg = run_toml(tmp_path, images, steps=1)
    assert main(["train", str(cfg), "--no-progress", "--set", "train.max_grad_norm=0"]) == 0
    assert calls == []
    assert main(["train", str(cfg), "--no-progress", "--set", "save.overwrite=true"]) == 0
    assert calls == [1.0]  # the default clips, through the same function


def test_a_text_encoder_file_the_family_does_not_read_is_refused(
        tmp_path: Path, images: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`model.text_encoder` for FLUX.1 (CLIP-L + T5, read from model.clip_l / model.t5) was
    silently ignored; `model.clip_l` for SDXL too (its CLIPs come from the checkpoint)."""
    file = tmp_path / "qwen_3_4b.safetensors"
    file.write_bytes(b"")
    for family, field, singles in (("flux", "text_encoder", "model.clip_l, model.t5"),
                                   ("sdxl", "clip_l", "model.transformer, model.vae)")):
        model = f'path = "{tmp_path.as_posix()}"\n{field} = "{file.as_posix()}"'
        cfg = run_toml(tmp_path / family, images, family=family, model=model, fmt=None)
        err = refused(capsys, "check", str(cfg))
        assert f"model.{field}: model.family = \"{family}\"" in err, err
        assert "reads no such file" in err and singles in err, err


def test_a_misshapen_flux2_text_encoder_file_is_refused(tmp_path: Path, images: Path,
                                                        capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    """A FLUX.2 [klein] Qwen3 file with one tensor of another shape: was a traceback from
    transformers (`ignore_mismatched_sizes`), now exit 2 naming the field, file and shapes."""
    import diffusers
    from safetensors.torch import save_file

    from difftune.families.flux2.tiny import build_tiny_flux2

    tiny = build_tiny_flux2("klein")
    folder = tmp_path / "FLUX.2-klein"
    diffusers.Flux2KleinPipeline(**tiny).save_pretrained(str(folder), safe_serialization=True)
    state = {k: v.contiguous() for k, v in tiny["text_encoder"].state_dict().items()
             if k != "lm_head.weight"}  # tied to the embeddings, as ComfyUI's file leaves it
    key = "model.layers.0.mlp.down_proj.weight"
    rows, cols = state[key].shape
    bad = tmp_path / "qwen_3_4b.safetensors"
    save_file({**state, key: torch.zeros(rows, cols + 3)}, str(bad))
    capsys.readouterr()  # save_pretrained's progress bar
    model = f'path = "{folder.as_posix()}"\ntext_encoder = "{bad.as_posix()}"'
    assert main(["check", str(run_toml(tmp_path, images, family="flux2", model=model,
                                       fmt=None))]) == 2
    err = capsys.readouterr().err  # after the model's loading line
    assert "Traceback" not in err and f"error: model.text_encoder = {bad}: 1 tensor(s) have other shapes" in err, err
    assert f"{key} is ({rows}, {cols + 3}), expected ({rows}, {cols})" in err, err
