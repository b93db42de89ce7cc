"""The run readers (difftune/ui/runs.py) on a real tiny run folder: summary, metrics read while
being written, samples with their prompt text, files with their safetensors metadata, and the
search for run folders under the roots."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from difftune.ui import run_outputs as outputs
from difftune.ui import runs
from difftune.ui.security import Roots
from tests.ui import tiny_run


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_run.make(tmp_path_factory)


def _copy(run_dir: Path, dest: Path) -> Path:
    """A copy of the run without its heavy files (checkpoints, tensorboard)."""
    shutil.copytree(run_dir, dest, ignore=shutil.ignore_patterns("checkpoints", "tensorboard"))
    return dest


def test_summary_reads_progress_losses_and_the_final_lora(run_dir: Path) -> None:
    s = runs.summary(run_dir)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    vals = [(r["val_loss"], r["step"]) for r in rows if "val_loss" in r]
    assert (s.step, s.total_steps, s.family) == (tiny_run.STEPS, tiny_run.STEPS, "flux")
    assert s.loss == rows[-1]["loss"] and s.loss_smoothed == rows[-1]["loss_smoothed"]
    assert s.it_per_s == rows[-1]["it_per_s"]
    assert (s.best_val_loss, s.best_val_step) == min(vals)
    assert s.finished and s.lora == str(run_dir / "demo-lora.safetensors")
    assert s.eta_s is None and s.gpu_mem is None  # done; a CPU run logs no GPU memory
    assert s.updated == pytest.approx((run_dir / "difftune.log").stat().st_mtime, abs=60)


def test_summary_of_a_running_run_has_an_eta_and_gpu_memory(tmp_path: Path) -> None:
    (tmp_path / "config.resolved.json").write_text(json.dumps({"train": {"steps": 100}}))
    (tmp_path / "metrics.jsonl").write_text(json.dumps(
        {"step": 40, "loss": 0.5, "loss_smoothed": 0.6, "it_per_s": 2.0, "gpu_mem_gib": 7.5}) + "\n")
    s = runs.summary(tmp_path)
    assert (s.step, s.eta_s, s.gpu_mem, s.finished) == (40, 30.0, 7.5, False)


def test_metrics_since_and_a_partial_last_line(run_dir: Path, tmp_path: Path) -> None:
    assert [r["step"] for r in runs.metrics(run_dir, since=2)] == [3, 4]
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "loss": NaN}\n{"step": 3, "lo')
    rows = runs.metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["loss"] is None  # NaN -> null
    with open(path, "a") as f:  # the trainer finishes the line and writes another
        f.write('ss": 0.5}\n{"step": 4, "loss": 0.25}\n')
    assert [(r["step"], r["loss"]) for r in runs.metrics(tmp_path, since=2)] == [(3, 0.5), (4, 0.25)]


def test_metrics_file_rewritten_by_a_resume_is_read_again(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 6)))
    assert len(runs.metrics(tmp_path)) == 5
    tmp = tmp_path / "new"  # a resume from step 2 keeps rows 1-2 and replaces the file
    tmp.write_text("".join(json.dumps({"step": s, "loss": 2.0}) + "\n" for s in (1, 2, 3)))
    os.replace(tmp, path)
    assert [(r["step"], r["loss"]) for r in runs.metrics(tmp_path)] == [(1, 2.0), (2, 2.0), (3, 2.0)]


def test_samples_by_step_with_their_prompt_text(run_dir: Path) -> None:
    found = outputs.samples(run_dir, Roots.of([run_dir.parent]))  # (the prompt file's too)
    assert [(s.step, s.index) for s in found] == [(st, i) for st in (0, 4) for i in range(2)]
    # The first prompt's capitals and punctuation are not in its file name: read back in full.
    assert [s.prompt for s in found[:2]] == list(tiny_run.PROMPTS)
    assert all(Path(s.path).is_file() and "grid" not in s.path for s in found)


def test_a_prompt_edited_away_since_the_sample_shows_as_its_slug(run_dir: Path,
                                                                   tmp_path: Path) -> None:
    run = _copy(run_dir, tmp_path / "run")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("something else entirely\nA red circle, on a blue background!\n")
    cfg = runs.resolved_config(run)
    cfg["sample"]["prompts"] = str(prompts)
    (run / "config.resolved.json").write_text(json.dumps(cfg))
    by_index = {s.index: s.prompt for s in outputs.samples(run, Roots.of([tmp_path]))
                if s.step == 0}
    assert by_index[0] == "A red circle, on a blue background!"  # moved: found by its slug
    assert by_index[1] == "a yellow square on a green background"  # gone: the slug, in words


def test_files_list_loras_and_checkpoints_with_metadata(run_dir: Path, tmp_path: Path) -> None:
    found = outputs.files(run_dir)
    kinds = [(f.kind, Path(f.path).name, f.step, f.final, f.complete) for f in found]
    assert kinds == [("checkpoint", "step-000002", 2, False, True),
                     ("lora", "demo-lora-step000002.safetensors", 2, False, True),
                     ("checkpoint", "step-000004", 4, False, True),
                     ("lora", "demo-lora.safetensors", 4, True, True)]
    for f in found:
        assert f.metadata["difftune.family"] == "flux" and f.size > 0
        assert f.metadata["difftune.steps"] == str(f.step)
    run = _copy(run_dir, tmp_path / "run")
    (run / "checkpoints" / ".tmp-step-000006-1").mkdir(parents=True)  # an interrupted save
    (run / "checkpoints" / "step-000008").mkdir()  # no state.json: not resumable
    ckpts = [f for f in outputs.files(run) if f.kind == "checkpoint"]
    assert [(Path(f.path).name, f.complete) for f in ckpts] == [("step-000008", False)]


def test_find_runs_skips_hidden_cache_and_app_folders(run_dir: Path, tmp_path: Path) -> None:
    _copy(run_dir, tmp_path / "a" / "run1")
    marker = '{"step": 1, "loss": 1.0}\n'
    for hidden in (".hidden/run", ".difftune-ui/run", "a/cache/run", "a/b/c/d/deep"):
        (tmp_path / hidden).mkdir(parents=True)
        (tmp_path / hidden / "metrics.jsonl").write_text(marker)
    (tmp_path / "a" / "run1" / "inner").mkdir()  # runs inside a run folder are not searched
    (tmp_path / "a" / "run1" / "inner" / "metrics.jsonl").write_text(marker)
    found = runs.find_runs(Roots.of([tmp_path]), depth=4)
    assert [Path(r.path) for r in found] == [tmp_path / "a" / "run1"]
    deeper = runs.find_runs(Roots.of([tmp_path]), depth=5)
    assert {Path(r.path).name for r in deeper} == {"run1", "deep"}
    assert found[0].to_dict()["total_steps"] == tiny_run.STEPS


def test_series_thins_long_runs_and_keeps_the_last_point() -> None:
    rows = [{"step": s, "loss": float(s), "val_loss": None if s % 10 else 1.0}
            for s in range(1, 10001)]
    points = runs.series(rows, "loss", max_points=1000)
    assert len(points) <= 1001 and points[0] == [1, 1.0] and points[-1] == [10000, 10000.0]
    assert len(runs.series(rows, "val_loss")) == 1000  # rows without the key are left out


def test_compare_chart_draws_smoothed_and_val_loss_per_run(run_dir: Path) -> None:
    from difftune.ui.pages.compare import loss_chart

    rows = runs.metrics(run_dir)
    chart = loss_chart({"a": rows, "b": [r for r in rows if "val_loss" not in r]}, raw=False)
    names = [s["name"] for s in chart["series"]]
    assert names == ["a · loss (smoothed)", "a · val_loss", "b · loss (smoothed)"]
    assert chart["series"][1]["data"] == [[r["step"], r["val_loss"]] for r in rows
                                          if "val_loss" in r]
    assert chart["series"][0]["itemStyle"] == chart["series"][1]["itemStyle"]  # one colour a run
    assert len(loss_chart({"a": rows}, raw=True)["series"]) == 3


def test_a_two_expert_runs_pair_is_listed_and_finishes_it(tmp_path: Path) -> None:
    """Wan 2.2 A14B writes `<name>_high_noise` and `<name>_low_noise`: the summary's final LoRA
    is the high-noise file, and the files list shows both of each save, steps and finals
    told apart (intermediate `<name>-step000002_<expert>` files are not final)."""
    from safetensors.torch import save_file
    import torch

    cfg = {"model": {"family": "wan", "variant": "2.2-t2v-a14b"}, "save": {"name": "clips"},
           "train": {"steps": 4}}
    (tmp_path / "config.resolved.json").write_text(json.dumps(cfg))
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 4, "loss": 0.5}) + "\n")
    for stem, step in (("clips-step000002", 2), ("clips", 4), ("clips-best", 2)):
        for expert in ("high", "low"):
            save_file({"x": torch.zeros(1)}, str(tmp_path / f"{stem}_{expert}_noise.safetensors"),
                      {"difftune.rank": "4", "difftune.steps": str(step),
                       "difftune.expert": expert})
    s = runs.summary(tmp_path)
    assert s.finished and s.lora == str(tmp_path / "clips_high_noise.safetensors")
    listed = {Path(f.path).name: (f.step, f.final) for f in outputs.files(tmp_path)}
    assert listed == {"clips-step000002_high_noise.safetensors": (2, False),
                      "clips-step000002_low_noise.safetensors": (2, False),
                      "clips-best_high_noise.safetensors": (2, False),
                      "clips-best_low_noise.safetensors": (2, False),
                      "clips_high_noise.safetensors": (4, True),
                      "clips_low_noise.safetensors": (4, True)}


def test_the_rank_page_checks_the_roots_before_measuring_a_run(tmp_path: Path) -> None:
    """Samples never measured are measured from the run's config.resolved.json (its model
    files, training images, metric models): a path there outside the roots is refused before
    anything reads it."""
    from PIL import Image

    from difftune.ui.pages.rank import ranked
    from difftune.ui.security import PathOutsideRoots

    from .opened import flux_safetensors, opened_under

    root, model = tmp_path / "root", flux_safetensors(tmp_path / "outside" / "m.safetensors")
    run = root / "runs" / "r"
    (run / "samples").mkdir(parents=True)
    (run / "config.resolved.json").write_text(json.dumps({
        "model": {"family": "wan", "transformer": str(model)}, "train": {"steps": 4},
        "datasets": [{"subsets": [{"path": str(root / "data")}]}],
        "save": {"dir": str(run)}, "metrics": {"dino": str(root / "dino")}}))
    (run / "lora.safetensors").write_bytes(b"")
    Image.new("RGB", (8, 8)).save(run / "samples" / "step-000004_0_a.png")
    with opened_under(model.parent) as opened, pytest.raises(PathOutsideRoots) as refused:
        ranked(Roots.of([root]), [run], "fidelity")
    assert opened == [] and str(refused.value).startswith(f"model.transformer = {model} in")
