"""`difftune caption` through the real CLI: tiny captioning models of every kind (built from
the real transformers classes, saved as the folders users have), a tiny ONNX tagger run by
onnxruntime, what is written where, and what is never overwritten."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import pytest
from PIL import Image

from difftune.caption.detect import detect
from difftune.caption.styles import clean, instruction
from difftune.caption.vlm import Hardware, VisionLanguageCaptioner
from difftune.cli import main
from tests import captioners
from tests.e2e.conftest import run_toml
from tests.videos import write_video

COLORS = {"red": (255, 0, 0), "blue": (0, 0, 255), "mix": (255, 0, 255)}


@pytest.fixture(scope="module")
def tagger(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny WD14-style tagger."""
    return captioners.tagger_folder(tmp_path_factory.mktemp("tagger"))


def _captions(folder: Path, ext: str = ".txt") -> dict[str, str]:
    return {p.stem: p.read_text(encoding="utf-8") for p in sorted(folder.glob(f"*{ext}"))}


def test_tagger_writes_tags_over_thresholds_and_keeps_existing_captions(
        tmp_path: Path, tagger: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = captioners.images_folder(tmp_path / "data", COLORS)
    (data / "broken.png").write_bytes(b"not an image")
    (data / "mix.txt").write_text("my own caption\n", encoding="utf-8")
    assert main(["caption", str(data), "--model", str(tagger), "--trigger", "ohwx",
                 "--batch-size", "2", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "broken.png" in err  # the unreadable image named, and skipped
    assert _captions(data) == {
        "red": "ohwx, red hair, hatsune miku\n",  # rating tag never written; "_" -> " "
        "blue": "ohwx, blue sky, ^_^\n",          # short tags keep their underscore
        "mix": "my own caption\n"}                # never overwritten unasked
    assert not (data / "broken.txt").exists()
    # --append adds to it; a higher character threshold drops the character tag.
    assert main(["caption", str(data), "--model", str(tagger / "model.onnx"), "--append",
                 "--character-threshold", "0.999", "--no-progress"]) == 0
    assert _captions(data)["mix"] == "my own caption, red hair, blue sky, ^_^\n"
    assert main(["caption", str(data), "--model", str(tagger), "--overwrite",
                 "--threshold", "0.999", "--prefix", "photo", "--no-progress"]) == 0
    assert _captions(data)["red"] == "photo, hatsune miku\n"
    assert not list(data.glob(".*.tmp"))  # atomic writes leave nothing behind


def test_options_a_captioner_does_not_use_are_said_to_be_ignored(
        tmp_path: Path, tagger: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = captioners.images_folder(tmp_path / "data", {"red": (255, 0, 0)})
    assert main(["caption", str(data), "--model", str(tagger), "--quantize", "int8",
                 "--prompt", "say", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "--quantize is ignored: it applies to vision-language models" in err
    assert "--prompt is ignored: it applies to --style prompt" in err


def test_a_tagger_exported_with_a_batch_of_one(tmp_path: Path) -> None:
    tagger = captioners.tagger_folder(tmp_path / "tagger", batch=1)
    data = captioners.images_folder(tmp_path / "data", COLORS)
    assert main(["caption", str(data), "--model", str(tagger), "--batch-size", "3",
                 "--no-progress"]) == 0
    assert _captions(data)["blue"] == "blue sky, ^_^\n" and len(_captions(data)) == 3


def test_large_images_are_read_at_a_megapixel_by_qwen_vl(tmp_path: Path) -> None:
    cap = VisionLanguageCaptioner(detect(captioners.qwen_image_folder(tmp_path / "m")),
                                  Hardware("cpu"), "Say.", 2)
    seen: list[tuple[int, int]] = []
    processor = cap.processor

    def recording(*args: object, images: list[Image.Image], **kw: object) -> object:
        seen.extend(im.size for im in images)
        return processor(*args, images=images, **kw)

    cap.processor = recording  # type: ignore[assignment]
    cap.processor.batch_decode = processor.batch_decode  # type: ignore[attr-defined]
    cap.caption([Image.new("RGB", (2400, 1200)), Image.new("RGB", (64, 32))])
    assert seen[0][0] * seen[0][1] <= 1024 * 1024 and abs(seen[0][0] / seen[0][1] - 2) < 0.01
    assert seen[1] == (64, 32)


def test_stop_keeps_every_caption_and_a_rerun_continues(
        tmp_path: Path, tagger: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from difftune.caption.tagger import OnnxTagger

    data = captioners.images_folder(tmp_path / "data", COLORS)
    real, calls = OnnxTagger.caption, []

    def interrupted_second_batch(self: OnnxTagger, images: list[Image.Image]) -> list[str]:
        calls.append(len(images))
        if len(calls) == 2:
            raise KeyboardInterrupt  # Ctrl-C while the second batch is captioned
        return real(self, images)

    monkeypatch.setattr(OnnxTagger, "caption", interrupted_second_batch)
    args = ["caption", str(data), "--model", str(tagger), "--batch-size", "1", "--no-progress"]
    assert main(args) == 130
    assert "run the same command again" in capsys.readouterr().out
    first = _captions(data)
    assert list(first) == ["blue"]  # images in name order: blue, mix, red
    monkeypatch.setattr(OnnxTagger, "caption", real)
    assert main(args) == 0
    assert "2 caption(s) written, 1 already captioned" in capsys.readouterr().out
    assert sorted(_captions(data)) == ["blue", "mix", "red"]


def test_a_run_configs_datasets_get_their_caption_extension(tmp_path: Path,
                                                            tagger: Path) -> None:
    data = captioners.images_folder(tmp_path / "data", COLORS)
    cfg = run_toml(tmp_path, data, extra="")
    # A second dataset of class images the run has not generated yet: nothing to caption.
    later = (tmp_path / "class").as_posix()
    cfg.write_text(cfg.read_text().replace("max_side = 128\n",
                                           'max_side = 128\ncaption_ext = ".caption"\n')
                   .replace("[train]", f'[[datasets]]\npath = "{later}"\nregularization = true\n'
                            'class_images = 2\nclass_prompt = "a cat"\nresolution = 64\n'
                            'min_side = 32\n\n[train]'))
    assert main(["caption", "--config", str(cfg), "--model", str(tagger), "--no-progress"]) == 0
    assert sorted(_captions(data, ".caption")) == ["blue", "mix", "red"]
    assert not list(data.glob("*.txt"))


def _bare_generate(model: Path, images: list[Path], max_tokens: int) -> list[str]:
    """Each image's caption from transformers' generate alone, one image at a time."""
    cap = VisionLanguageCaptioner(detect(model), Hardware("cpu"), instruction(
        detect(model).kind, "short", None), max_tokens)
    return [clean(cap.caption([Image.open(p).convert("RGB")])[0]) for p in images]


BUILDERS: dict[str, Callable[[Path], Path]] = {
    "qwen_image": captioners.qwen_image_folder, "krea2": captioners.krea2_folder,
    "qwen2_5_vl": captioners.qwen25_vl_folder, "florence2": captioners.florence2_folder,
    "llava": captioners.llava_folder}


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_vision_language_models_caption_in_batches(tmp_path: Path, kind: str) -> None:
    model = BUILDERS[kind](tmp_path / "model")
    data = captioners.images_folder(tmp_path / "data", COLORS)
    assert main(["caption", str(data), "--model", str(model), "--batch-size", "3",
                 "--max-tokens", "6", "--device", "cpu", "--trigger", "ohwx",
                 "--no-progress"]) == 0
    written = _captions(data)
    expected = _bare_generate(model, sorted(data.glob("*.png")), 6)
    assert written == {p: f"ohwx, {e}\n" for p, e in zip(sorted(written), expected, strict=True)}


def test_thinking_is_off_and_templates_without_images_get_the_trained_format(
        tmp_path: Path) -> None:
    with_template = captioners.qwen25_vl_folder(tmp_path / "q")
    cap = VisionLanguageCaptioner(detect(with_template), Hardware("cpu"), "Say.", 4)
    # the template's empty thinking block, which it opens only with enable_thinking=False
    assert cap.prompt.endswith("assistant<think>\n\n</think>")
    # A template kept apart from the tokenizer (chat_template.json, as processors save it).
    import json

    apart = captioners.qwen25_vl_folder(tmp_path / "apart")
    config = json.loads((apart / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (apart / "tokenizer_config.json").write_text(json.dumps(config))
    (apart / "chat_template.jinja").unlink(missing_ok=True)
    (apart / "chat_template.json").write_text(json.dumps(
        {"chat_template": captioners.QWEN_VL_TEMPLATE}))
    cap = VisionLanguageCaptioner(detect(apart), Hardware("cpu"), "Say.", 4)
    assert cap.prompt.endswith("assistant<think>\n\n</think>")
    text_only = captioners.qwen_image_folder(tmp_path / "qi")
    cap = VisionLanguageCaptioner(detect(text_only), Hardware("cpu"), "Say.", 4)
    assert "<|vision_start|><|image_pad|><|vision_end|>Say." in cap.prompt
    assert clean('<think>\nhmm</think>\n "a red\n square"') == "a red square"


def test_int8_quantized_captioner(tmp_path: Path) -> None:
    model = captioners.qwen25_vl_folder(tmp_path / "model")
    data = captioners.images_folder(tmp_path / "data", {"red": (255, 0, 0)})
    assert main(["caption", str(data), "--model", str(model), "--quantize", "int8",
                 "--max-tokens", "4", "--device", "cpu", "--no-progress"]) == 0
    assert (data / "red.txt").read_text(encoding="utf-8").strip()


def test_what_is_not_a_captioner_exits_2_naming_what_was_expected(
        tmp_path: Path, tagger: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = captioners.images_folder(tmp_path / "data", COLORS)
    clip = tmp_path / "clip"
    clip.mkdir()
    (clip / "config.json").write_text('{"model_type": "clip", "architectures": ["CLIPModel"]}')
    untied = captioners.krea2_folder(tmp_path / "krea2", tied=False)
    no_tags = tmp_path / "no_tags"
    no_tags.mkdir()
    (no_tags / "model.onnx").write_bytes((tagger / "model.onnx").read_bytes())
    for model, says in ((clip, "model_type 'clip'"), (data, "no config.json"),
                        (untied, "language-model head"), (no_tags, "selected_tags.csv"),
                        (tmp_path / "absent", "does not exist")):
        assert main(["caption", str(data), "--model", str(model)]) == 2
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err
        if model != untied and model != no_tags:
            assert "WD14 tagger folder" in err  # what a captioner folder is
    for extra, says in ((["--style", "detailed"], "tags only"),
                        (["--style", "prompt"], "--prompt TEXT"),
                        (["--video-frames", "0"], "--video-frames must be at least 1")):
        assert main(["caption", str(data), "--model", str(tagger), *extra]) == 2
        assert says in capsys.readouterr().err
    assert not list(data.glob("*.txt"))


def _red_then_blue(index: int, width: int, height: int) -> np.ndarray:
    """Frames 0-5 red, 6-7 blue: of 4 frames sampled over 8 (1, 3, 5, 7), three are red."""
    return np.full((height, width, 3), (255, 0, 0) if index < 6 else (0, 0, 255), np.uint8)


def test_videos_and_frame_folders_are_tagged_from_sampled_frames(
        tmp_path: Path, tagger: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = captioners.images_folder(tmp_path / "data", {"blue": (0, 0, 255)})
    write_video(data / "clip.mp4", 8, caption=None, paint=_red_then_blue)
    (data / "broken.mp4").write_bytes(b"not a video" * 40)
    walk = captioners.images_folder(data / "walk", {"f1": (0, 0, 255), "f2": (0, 0, 255)})
    (data / "walk.txt").write_text("my clip\n", encoding="utf-8")  # a clip of frames
    assert main(["caption", str(data), "--model", str(tagger), "--no-progress"]) == 0
    out = capsys.readouterr()
    assert "broken.mp4" in out.err  # the corrupt video named, skipped, the rest captioned
    assert "2 caption(s) written, 1 already captioned, 1 unreadable file(s)" in out.out
    # A tag is kept at its mean over the frames: red hair (3 of 4 frames) passes 0.35, blue
    # sky (1 of 4) does not, nor the character tag at 0.85 (which each red frame passes).
    assert _captions(data) == {"blue": "blue sky, ^_^\n", "clip": "red hair\n",
                               "walk": "my clip\n"}
    assert main(["caption", str(data), "--model", str(tagger), "--overwrite",
                 "--video-frames", "1", "--no-progress"]) == 0
    assert _captions(data)["clip"] == "red hair, hatsune miku\n"  # frame 4 alone, red
    assert _captions(data)["walk"] == "blue sky, ^_^\n" and not _captions(walk)
    assert not (data / "broken.txt").exists() and not list(data.glob(".*.tmp"))


def test_qwen_vl_sees_a_videos_frames_in_one_message(tmp_path: Path) -> None:
    import av

    model = captioners.qwen25_vl_folder(tmp_path / "model")
    data = captioners.images_folder(tmp_path / "data", {"red": (255, 0, 0)})
    write_video(data / "clip.mp4", 8, caption=None)
    assert main(["caption", str(data), "--model", str(model), "--max-tokens", "6",
                 "--device", "cpu", "--batch-size", "2", "--no-progress"]) == 0
    # The same answer from a message of the 4 frames at 1, 3, 5, 7, decoded here in full.
    cap = VisionLanguageCaptioner(detect(model), Hardware("cpu"), "", 6)
    with av.open(str(data / "clip.mp4")) as container:
        frames = [f.to_image() for f in container.decode(video=0)]
    text = instruction("qwen_vl", "short", None)
    prompt = cap.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}] * 4 + [{"type": "text", "text": text}]}],
        add_generation_prompt=True, tokenize=False, enable_thinking=False)
    inputs = cap.processor(text=[prompt], images=[frames[i] for i in (1, 3, 5, 7)],
                           return_tensors="pt")
    out = cap.model.generate(**inputs, max_new_tokens=6, do_sample=False)
    answer = cap.processor.batch_decode(out[:, inputs["input_ids"].shape[1]:],
                                        skip_special_tokens=True)[0]
    assert prompt.count("<|image_pad|>") == 4 and clean(answer)
    assert _captions(data)["clip"] == clean(answer) + "\n"
    assert (data / "red.txt").read_text(encoding="utf-8").strip()


def test_llava_captions_a_video_from_its_middle_sampled_frame(tmp_path: Path) -> None:
    import av

    model = captioners.llava_folder(tmp_path / "model")
    data = tmp_path / "data"
    data.mkdir()
    # Frame 5 blue, the others red (the tiny model answers the two colours differently).
    write_video(data / "clip.mp4", 8, caption=None, paint=lambda i, w, h: np.full(
        (h, w, 3), (0, 0, 255) if i == 5 else (255, 0, 0), np.uint8))
    assert main(["caption", str(data), "--model", str(model), "--max-tokens", "6",
                 "--device", "cpu", "--no-progress"]) == 0
    with av.open(str(data / "clip.mp4")) as container:
        frames = [f.to_image() for f in container.decode(video=0)]
    frames[5].save(tmp_path / "middle.png")  # sampled: 1, 3, 5, 7; the middle one: 5
    assert _captions(data) == {"clip": _bare_generate(model, [tmp_path / "middle.png"], 6)[0]
                               + "\n"}
