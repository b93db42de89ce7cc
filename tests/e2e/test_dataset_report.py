"""`difftune dataset report` on folders made to hold each problem, through the real CLI; and
its summary line in `difftune check`."""

from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageFilter

from difftune.cli import main
from difftune.dataset_report.build import token_limit
from difftune.families.common.tiny import assets_dir
from tests.e2e.conftest import run_toml


def _noise(path: Path, size: tuple[int, int], seed: int) -> Path:
    rng = np.random.default_rng(seed)
    Image.fromarray((rng.random((size[1], size[0], 3)) * 255).astype("uint8")).save(path)
    return path


@pytest.fixture()
def flawed(tmp_path: Path) -> Path:
    """A folder with one image of each problem, and good ones beside them."""
    d = tmp_path / "data"
    d.mkdir()
    for i in range(3):
        _noise(d / f"good{i}.png", (256, 256), i)
        (d / f"good{i}.txt").write_text(f"ohwx, a cat, red, pose {i}", encoding="utf-8")
    Image.open(d / "good1.png").resize((240, 240)).save(d / "copy.jpg", quality=90)
    (d / "copy.txt").write_text("ohwx, a cat", encoding="utf-8")
    Image.open(d / "good2.png").filter(ImageFilter.GaussianBlur(8)).rotate(90).save(d / "soft.png")
    (d / "soft.txt").write_text("", encoding="utf-8")
    _noise(d / "wide.png", (400, 100), 7)
    (d / "wide.txt").write_text("a dog " + "with a long tail " * 30, encoding="utf-8")
    (d / "broken.png").write_bytes(b"not an image")
    return d


def _report(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert main(["dataset", "report", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _flagged(report: dict, check: str) -> dict[str, dict]:
    return {Path(f["image"]).name: f for f in report["findings"] if f["check"] == check}


def test_each_problem_is_found_and_named(flawed: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    rep = _report(capsys, str(flawed), "--trigger", "ohwx", "--resolution", "512",
                  "--family", "sdxl")
    assert rep["images"] == 7
    dup = _flagged(rep, "near_duplicate")
    assert "copy.jpg" in dup or "good1.png" in dup  # the pair, with its distance
    pair = next(f for f in rep["findings"] if f["check"] == "near_duplicate"
                and {Path(f["image"]).name, Path(f["other"]).name} == {"copy.jpg", "good1.png"})
    assert pair["value"] <= rep["settings"]["duplicate_distance"]
    assert set(_flagged(rep, "blurred")) == {"soft.png"}
    up = _flagged(rep, "upscaled")
    assert up["good0.png"]["value"] == 2.0 and "512x512" in up["good0.png"]["detail"]
    assert set(_flagged(rep, "aspect")) == {"wide.png"}
    assert set(_flagged(rep, "caption_empty")) == {"soft.png"}
    assert set(_flagged(rep, "caption_missing")) == set()  # broken.png is not an image
    assert set(_flagged(rep, "unreadable")) == {"broken.png"}
    assert set(_flagged(rep, "trigger_missing")) == {"wide.png"}
    cut = _flagged(rep, "caption_too_long")
    assert set(cut) == {"wide.png"} and cut["wide.png"]["value"] > 77
    assert rep["token_limit"]["max_length"] == 77 and not rep["token_limit"]["exact"]
    assert rep["tags"]["ohwx"] == 4 and rep["tags"]["a cat"] == 4
    assert "blur_measure" in rep["settings"]
    # The terminal table: the summary, the thresholds stated, images named with their reason.
    assert main(["dataset", "report", str(flawed), "--trigger", "ohwx"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("dataset report: 7 image(s); 1 unreadable images;")
    assert "sharpness < 100" in out and "soft.png" in out and "the caption lacks 'ohwx'" in out


def test_token_limit_counts_with_the_familys_tokenizer(tmp_path: Path) -> None:
    shutil.copytree(assets_dir() / "tokenizer", tmp_path / "tokenizer")
    limit = token_limit("sdxl", tmp_path)
    from transformers import CLIPTokenizer

    tok = CLIPTokenizer.from_pretrained(tmp_path / "tokenizer")
    text = "a red circle on a blue background"
    assert limit.exact and limit.max_length == 77
    assert limit.count(text) == len(tok(text).input_ids)


def test_a_run_config_reports_missing_masks_and_edit_partners(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data, masks, before = (tmp_path / n for n in ("data", "masks", "before"))
    for folder in (data, masks, before):
        folder.mkdir()
    for i in range(2):
        _noise(data / f"im{i}.png", (64, 64), i)
        (data / f"im{i}.caption").write_text("a cat", encoding="utf-8")
    _noise(masks / "im0.png", (64, 64), 5)
    _noise(before / "im1.png", (64, 64), 6)
    cfg = tmp_path / "run.toml"
    cfg.write_text(textwrap.dedent(f"""\
        [model]
        family = "flux2"
        flavor = "tiny"
        [[datasets]]
        resolution = 64
        min_side = 32
        [[datasets.subsets]]
        path = "{data.as_posix()}"
        caption_ext = ".caption"
        mask_path = "{masks.as_posix()}"
        [[datasets.subsets]]
        path = "{data.as_posix()}"
        caption_ext = ".caption"
        control_path = "{before.as_posix()}"
        [save]
        dir = "{(tmp_path / 'out').as_posix()}"
        """), encoding="utf-8")
    rep = _report(capsys, "--config", str(cfg))
    assert set(_flagged(rep, "mask_missing")) == {"im1.png"}
    assert set(_flagged(rep, "pair_incomplete")) == {"im0.png"}
    assert not _flagged(rep, "caption_missing")  # .caption files are the run's captions
    assert set(_flagged(rep, "upscaled")) == set()  # 64 px images at resolution 64


def test_check_prints_the_summary_line_and_goes_on(tmp_path: Path, flawed: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    (flawed / "broken.png").unlink()
    cfg = run_toml(tmp_path, flawed)
    assert main(["check", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "ok  dataset report: 6 image(s); 1 near-duplicate pairs; 1 blurred;" in out
    assert "check passed" in out


def test_bad_arguments_exit_2_with_one_message(tmp_path: Path, flawed: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    for args, says in ((["dataset", "report"], "either DATASET_FOLDER or --config"),
                       (["dataset", "report", str(tmp_path / "absent")], "does not exist"),
                       (["dataset", "report", str(flawed), "--family", "sd9"], "not a family"),
                       (["caption", "--model", str(flawed)], "either DATASET_FOLDER"),
                       (["caption", str(tmp_path / "absent"), "--model", str(flawed)],
                        "does not exist")):
        assert main(args) == 2, args
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err, err
