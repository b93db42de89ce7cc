"""Sample metrics (report/sample_metrics.py) against a direct computation with the tiny random
DINOv2 and CLIP models, the training-feature cache, the copy rule (each training image's copy
floor: its degraded copies' least similarity to it), and `[metrics]` config."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from PIL.PngImagePlugin import PngInfo

from difftune.config.metrics import MetricsConfig
from difftune.report.sample_metrics import (PROMPT_KEY, copy_warning, degraded, measure,
                                            read_sample, reference)
from difftune.report.scoring import Scorers
from difftune.verbs.demo import demo_dir

DEMO = sorted(demo_dir().glob("*.png"))


def _sample(path: Path, image: Image.Image, prompt: str) -> Path:
    """A sample PNG as the runner writes it (the prompt in a text chunk)."""
    info = PngInfo()
    info.add_itxt(PROMPT_KEY, prompt)
    image.save(path, pnginfo=info)
    return path


def _noisy(path: Path, seed: int, amount: float = 12.0) -> Image.Image:
    """A copy of an image as a sampler would make one: the same picture, not the same bytes."""
    with Image.open(path) as im:
        pixels = np.asarray(im.convert("RGB"), dtype=np.float32)
    pixels = pixels + np.random.default_rng(seed).normal(0, amount, pixels.shape)
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


@pytest.fixture()
def scorers(scorer_models: tuple) -> Scorers:
    dino, clip = scorer_models
    return Scorers.load(MetricsConfig(enabled=True, dino=dino, clip=clip))


def _dino(dino_dir: Path, images: list[Image.Image]) -> np.ndarray:
    """Unit-length DINOv2 features straight from transformers' own model and processor."""
    from transformers import AutoImageProcessor, AutoModel

    dino, proc = AutoModel.from_pretrained(dino_dir), AutoImageProcessor.from_pretrained(dino_dir)
    with torch.no_grad():
        f = dino(**proc(images=images, return_tensors="pt")).pooler_output.numpy()
    return f / np.linalg.norm(f, axis=1, keepdims=True)


def _direct(scorer_models: tuple, samples: list[Path], prompts: list[str],
            training: list[Path]) -> dict:
    """The figures computed straight from the transformers models' own forward passes."""
    from transformers import AutoModel, AutoProcessor

    dino_dir, clip_dir = scorer_models
    clip, cproc = AutoModel.from_pretrained(clip_dir), AutoProcessor.from_pretrained(clip_dir)
    rgb = lambda ps: [Image.open(p).convert("RGB") for p in ps]  # noqa: E731
    s, t = _dino(dino_dir, rgb(samples)), _dino(dino_dir, rgb(training))
    with torch.no_grad():
        out = clip(**cproc(text=prompts, images=rgb(samples), return_tensors="pt",
                           padding=True))
        cos = (out.logits_per_image / clip.logit_scale.exp()).numpy()
    sims = s @ t.T
    clip_scores = [100 * max(float(cos[i, i]), 0.0) for i in range(len(samples))]
    return {"sims": sims, "clip": clip_scores, "features": s}


def test_metrics_equal_a_direct_computation(tmp_path: Path, scorers: Scorers,
                                            scorer_models: tuple) -> None:
    training = DEMO[:4]
    prompts = ["a red circle", "a red circle", "a pink ring", "a pink ring", "stripes"]
    images = [_noisy(DEMO[0], 1), _noisy(DEMO[1], 2), _noisy(DEMO[4], 3), _noisy(DEMO[5], 4),
              _noisy(DEMO[2], 5)]
    paths = [_sample(tmp_path / f"s{i}.png", im, p)
             for i, (im, p) in enumerate(zip(images, prompts))]
    ref = reference(scorers, training, tmp_path / "cache")
    m = measure(scorers, ref, [read_sample(p) for p in paths])
    d = _direct(scorer_models, paths, prompts, training)
    sims = d["sims"]
    for i, row in enumerate(m["samples"]):
        assert row["prompt"] == prompts[i]
        assert row["fidelity"] == pytest.approx(sims[i].mean(), abs=1e-5)
        assert row["nearest"] == training[int(sims[i].argmax())].name
        assert row["nearest_similarity"] == pytest.approx(sims[i].max(), abs=1e-5)
        assert row["clip_score"] == pytest.approx(d["clip"][i], abs=1e-3)
    assert 0 in d["clip"] or min(d["clip"]) > 0  # the floor at 0 is CLIPScore's
    assert m["fidelity"] == pytest.approx(sims.mean(), abs=1e-5)
    assert m["clip_score"] == pytest.approx(np.mean(d["clip"]), abs=1e-3)
    ring = m["prompts"]["a pink ring"]
    assert ring["fidelity"] == pytest.approx(sims[2:4].mean(), abs=1e-5)
    f = d["features"]
    assert ring["diversity"] == pytest.approx(float(f[2] @ f[3]), abs=1e-5)
    assert "diversity" not in m["prompts"]["stripes"]  # one seed: no pair
    pairs = [float(f[0] @ f[1]), float(f[2] @ f[3])]
    assert m["diversity"] == pytest.approx(np.mean(pairs), abs=1e-5)
    for i, row in enumerate(m["samples"]):  # the floor of its nearest image, computed apart
        image = Image.open(training[int(sims[i].argmax())]).convert("RGB")
        f = _dino(scorer_models[0], [image, *degraded(image)])
        assert row["copy_floor"] == pytest.approx(float((f[1:] @ f[0]).min()), abs=1e-5)
    closest = max(m["samples"], key=lambda r: r["nearest_similarity"] - r["copy_floor"])
    assert m["copy_reference"] == closest["copy_floor"]


def test_training_features_are_cached_by_content(tmp_path: Path, scorers: Scorers) -> None:
    folder = tmp_path / "data"
    folder.mkdir()
    training = []
    for p in DEMO[:3]:
        training.append(folder / p.name)
        training[-1].write_bytes(p.read_bytes())
    cache = tmp_path / "cache"
    first = reference(scorers, training, cache)
    entries = lambda: sorted(cache.rglob("*.safetensors"))  # noqa: E731
    assert len(entries()) == 6  # features and copy floor of each image
    stamps = [e.stat().st_mtime_ns for e in entries()]
    again = reference(scorers, training, cache)
    assert torch.equal(first.features, again.features)
    assert torch.equal(first.floors, again.floors)
    assert [e.stat().st_mtime_ns for e in entries()] == stamps  # read, not rewritten
    _noisy(DEMO[0], 9).save(training[0])  # an edited image is a new entry
    edited = reference(scorers, training, cache)
    assert len(entries()) == 8
    assert not torch.equal(edited.features[0], first.features[0])
    assert torch.equal(edited.features[1:], first.features[1:])
    assert torch.equal(edited.floors[1:], first.floors[1:])


def test_copies_are_flagged_and_new_images_of_the_kind_are_not(tmp_path: Path,
                                                              scorers: Scorers) -> None:
    """The rule on real (tiny random) features: two demo shapes not trained on (stripes, a
    ring) are new pictures of the same kind and stay below their nearest image's copy floor;
    a noised copy of a training image (a lighter noise than the floor's) reaches it."""
    by_name = {p.stem: p for p in DEMO}
    training = [by_name[n] for n in ("cyan_cross", "red_circle", "white_triangle",
                                     "yellow_square")]
    ref = reference(scorers, training, tmp_path / "cache")
    new = [_sample(tmp_path / f"new{i}.png", Image.open(by_name[n]).convert("RGB"), "a shape")
           for i, n in enumerate(("orange_stripes", "pink_ring"))]
    learned = measure(scorers, ref, [read_sample(p) for p in new])
    assert not learned["copying"] and copy_warning(10, learned) is None
    copy = _sample(tmp_path / "copy.png", _noisy(by_name["red_circle"], 7), "a shape")
    copied = measure(scorers, ref, [read_sample(p) for p in [*new, copy]])
    assert copied["copying"]
    warning = copy_warning(10, copied)
    assert warning is not None and "copy.png" in warning and "red_circle.png" in warning


def test_one_training_image_has_its_own_floor_and_copy_similarity_replaces_it(
        tmp_path: Path, scorers: Scorers) -> None:
    """With one training image there is no pair to compare with; its floor is its own. A set
    `metrics.copy_similarity` is every image's floor instead."""
    only = [DEMO[0], DEMO[0]]  # the same image twice is still one
    ref = reference(scorers, only, tmp_path / "cache")
    assert 0.9 < float(ref.floors[0]) < 1 and torch.equal(ref.floors[0], ref.floors[1])
    copy = _sample(tmp_path / "copy.png", _noisy(DEMO[0], 3), "x")
    other = _sample(tmp_path / "other.png", Image.open(DEMO[3]).convert("RGB"), "x")
    assert measure(scorers, ref, [read_sample(copy)])["copying"]
    assert not measure(scorers, ref, [read_sample(other)])["copying"]
    fixed = reference(scorers, only, tmp_path / "cache", 0.2)
    assert fixed.floors.tolist() == pytest.approx([0.2, 0.2])
    assert measure(scorers, fixed, [read_sample(other)])["copying"]


def test_without_clip_there_is_no_clip_score(tmp_path: Path, scorer_models: tuple) -> None:
    scorers = Scorers.load(MetricsConfig(enabled=True, dino=scorer_models[0]))
    ref = reference(scorers, DEMO[:2], tmp_path / "cache", 0.95)
    m = measure(scorers, ref, [read_sample(_sample(tmp_path / "a.png", _noisy(DEMO[3], 1), "x"))])
    assert "clip_score" not in m and "clip_score" not in m["samples"][0]


def _config(tmp_path: Path, metrics: str) -> Path:
    from tests.unit.test_config import GOOD, write

    return write(tmp_path, GOOD + "\n[sample]\nprompts = \"p.txt\"\n\n[metrics]\n" + metrics)


def test_metrics_config_needs_a_dino_folder(tmp_path: Path, scorer_models: tuple) -> None:
    from difftune.config import load_config
    from difftune.errors import ConfigError, ModelFileError

    with pytest.raises(ConfigError, match=r"metrics.*needs metrics.dino"):
        load_config(_config(tmp_path, "enabled = true\n"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelFileError, match=r"metrics.dino: .*empty is not a model folder"):
        load_config(_config(tmp_path, 'enabled = true\ndino = "empty"\n'))
    cfg = load_config(_config(tmp_path, f'enabled = true\ndino = "{scorer_models[0]}"\n'))
    assert cfg.metrics.dino == scorer_models[0] and cfg.metrics.clip is None
    assert not load_config(_config(tmp_path, "")).metrics.enabled  # off by default
    if not torch.cuda.is_available():
        with pytest.raises(ModelFileError, match=r"metrics.device = \"cuda\" but"):
            load_config(_config(tmp_path, f'enabled = true\ndino = "{scorer_models[0]}"\n'
                                          'device = "cuda"\n'))


def test_a_failing_metric_model_turns_metrics_off_without_raising(
        tmp_path: Path, scorer_models: tuple, caplog: pytest.LogCaptureFixture) -> None:
    """Models that cannot load turn the metrics off; every event whose figures will never
    come (those queued, one submitted after, one with nothing sampled) loses its keep_best
    candidate at once, not when the run ends."""
    import time

    from difftune.config.keep_best import Measure
    from difftune.report.metric_worker import MetricWorker
    from difftune.train.best import BestKeeper

    broken = tmp_path / "dino"
    broken.mkdir()
    (broken / "config.json").write_text((scorer_models[0] / "config.json").read_text())
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    keeper = BestKeeper(Measure("fidelity"), tmp_path, "lora", None)
    left = lambda: sorted(int(p.stem[5:]) for p in keeper.candidates.iterdir())  # noqa: E731
    for step in (2, 4, 6, 8):
        keeper.candidate(step, lambda step, path: path.write_bytes(b"lora"))
    got: list[int] = []
    worker = MetricWorker(MetricsConfig(enabled=True, dino=broken), DEMO[:2], tmp_path / "c",
                          lambda step, m: got.append(step), keeper.skipped)
    sample = _sample(tmp_path / "s.png", _noisy(DEMO[0], 1), "x")
    for step in (2, 4, 6):
        worker.submit(step, [sample])
    worker.submit(8, [])  # sampling failed: nothing to measure
    assert 8 not in left()
    deadline = time.monotonic() + 120
    while left() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert left() == []  # before the run's end (close)
    keeper.candidate(10, lambda step, path: path.write_bytes(b"lora"))
    worker.submit(10, [sample])  # metrics are off now
    assert left() == []
    worker.close()
    assert got == []
    assert sum("sample metrics are off (training goes on)" in r.getMessage()
               for r in caplog.records) == 1


def test_the_metrics_process_skips_a_backlog_and_its_death_never_raises(
        tmp_path: Path, scorer_models: tuple, caplog: pytest.LogCaptureFixture) -> None:
    """Events submitted faster than they are measured: at most two wait, the oldest are
    skipped (logged, `on_skip` told) and the newest is measured, in the child process, which
    runs with `metrics.threads` torch threads (it says how many it has). An event the child
    cannot measure, and one whose figures cannot be handed on, are skipped too (`on_skip`
    told: keep_best drops their candidates). Then the child is killed: the next event is
    logged as lost with the reason and `on_skip` told, metrics go off, `close` returns."""
    import os
    import signal
    import time

    from difftune.report.metric_worker import MetricWorker

    got: list[int] = []
    skipped: list[int] = []

    def measured(step: int, figures: dict) -> None:
        got.append(step)
        if step == 5:
            raise OSError("disk full")  # e.g. metrics.jsonl cannot be written

    threads = torch.get_num_threads() + 1  # not what the child would inherit from here
    worker = MetricWorker(MetricsConfig(enabled=True, dino=scorer_models[0], threads=threads),
                          DEMO[:2], tmp_path / "c", measured, skipped.append)
    sample = _sample(tmp_path / "s.png", _noisy(DEMO[0], 1), "x")
    for step in range(1, 6):  # the child is still loading its models: events pile up
        worker.submit(step, [sample])
    deadline = time.monotonic() + 120
    while 5 not in skipped and time.monotonic() < deadline:  # measured, not handed on
        time.sleep(0.1)
    behind = skipped[:-1]
    assert got[-1] == skipped[-1] == 5 and len(behind) >= 2
    assert sorted(got + behind) == [1, 2, 3, 4, 5]
    logged = [r.getMessage() for r in caplog.records if "skipped: measuring is behind" in
              r.getMessage()]
    assert [int(m.split()[4].rstrip(":")) for m in logged] == behind
    assert worker._proc.pid != os.getpid()  # measured in another process
    assert worker.threads == threads
    assert any(r.getMessage().endswith(f"; {threads} torch threads") for r in caplog.records)
    (tmp_path / "bad.png").write_bytes(b"not a PNG")
    worker.submit(6, [tmp_path / "bad.png"])  # the child cannot measure it
    while 6 not in skipped and time.monotonic() < deadline:
        time.sleep(0.1)
    assert skipped[-1] == 6 and 6 not in got
    os.kill(worker._proc.pid, signal.SIGKILL)
    worker._proc.join()
    worker.submit(7, [sample])
    worker.close()
    assert 7 not in got and skipped[-1] == 7
    assert any("the metrics process died (exit code -9) while measuring step 7" in
               r.getMessage() for r in caplog.records)
