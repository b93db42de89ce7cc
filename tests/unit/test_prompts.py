"""Prompt-file parsing (kohya option syntax) and its warnings."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from difftune.sample.runner import PromptSpec, parse_line, read_prompts

DEFAULT = PromptSpec("", "", 512, 512, 20, 0, 3.5, 1.0)


def test_all_options() -> None:
    spec = parse_line("a cat on a mat --n blurry, low quality --w 768 --h 512 --s 12 --d 7 "
                      "--g 4.5 --l 2.5", DEFAULT)
    assert spec == PromptSpec("a cat on a mat", "blurry, low quality", 768, 512, 12, 7, 4.5, 2.5)


def test_defaults_fill_missing_options() -> None:
    assert parse_line("just a prompt", DEFAULT) == PromptSpec("just a prompt", "", 512, 512, 20,
                                                             0, 3.5, 1.0)


def test_hyphenated_words_are_not_options() -> None:
    assert parse_line("a well-known--style photo --s 3", DEFAULT).prompt == "a well-known--style photo"


@pytest.mark.parametrize("line, message", [
    ("cat --x 3", "unknown option --x"),
    ("cat --w wide", "--w needs a int"),
    ("--w 64", "empty prompt"),
])
def test_bad_lines(line: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_line(line, DEFAULT)


def test_file_skips_bad_lines_with_file_and_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "prompts.txt"
    path.write_text("# comment\nfirst --d 1\n\nsecond --w nope\nthird # trailing comment\n")
    with caplog.at_level(logging.WARNING, logger="difftune"):
        specs = read_prompts(path, DEFAULT)
    assert [s.prompt for s in specs] == ["first", "third"]
    assert f"{path}:4" in caplog.text


def test_missing_or_empty_file_is_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing\n")
    with caplog.at_level(logging.WARNING, logger="difftune"):
        assert read_prompts(tmp_path / "missing.txt", DEFAULT) == []
        assert read_prompts(empty, DEFAULT) == []
    assert "does not exist" in caplog.text and "holds no prompts" in caplog.text


def test_toml_prompt_file(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "prompts.toml"
    path.write_text('[[prompts]]\nprompt = "a cat"\nnegative = "blurry"\nwidth = 768\n'
                    'guidance = 4\ncfg = 2.5\n\n'
                    '[[prompts]]\nprompt = "a dog"\nsize = 3\n\n'
                    '[[prompts]]\nprompt = "a bird"\nsteps = "many"\n\n'
                    '[[prompts]]\nprompt = "a fish"\nseed = 9\n', encoding="utf-8")
    with caplog.at_level(logging.WARNING, logger="difftune"):
        specs = read_prompts(path, DEFAULT)
    assert specs == [PromptSpec("a cat", "blurry", 768, 512, 20, 0, 4.0, 2.5),
                     PromptSpec("a fish", "", 512, 512, 20, 9, 3.5, 1.0)]
    assert f"{path}: prompts[1] skipped: unknown field(s) ['size']" in caplog.text
    assert f"{path}: prompts[2] skipped: steps must be a int" in caplog.text


def test_broken_toml_is_a_warning_and_no_prompts(tmp_path: Path,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "prompts.toml"
    path.write_text('[[prompts]]\nprompt = "a cat\n', encoding="utf-8")
    with caplog.at_level(logging.WARNING, logger="difftune"):
        assert read_prompts(path, DEFAULT) == []
    assert f"{path}: not valid TOML" in caplog.text and "line 2" in caplog.text


def test_input_images_resolve_against_the_prompt_file_and_a_missing_one_skips_that_prompt(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "refs").mkdir()
    (tmp_path / "refs/cat.png").write_bytes(b"png")
    (tmp_path / "refs/dog 2.png").write_bytes(b"png")
    path = tmp_path / "prompts.txt"
    path.write_text("relight it --ci refs/cat.png --ci refs/dog 2.png --s 3\n"
                    "the same --ci refs/missing.png\nno image at all\n", encoding="utf-8")
    with caplog.at_level(logging.WARNING):
        specs = read_prompts(path, DEFAULT)
    assert [s.prompt for s in specs] == ["relight it", "no image at all"]
    assert specs[0].images == (tmp_path / "refs/cat.png", tmp_path / "refs/dog 2.png")
    assert specs[0].steps == 3 and specs[1].images == ()
    assert f"{path}:2" in caplog.text and "refs/missing.png does not exist" in caplog.text
    toml = tmp_path / "prompts.toml"
    toml.write_text('[[prompts]]\nprompt = "a"\nimages = "refs/cat.png"\n'
                    '[[prompts]]\nprompt = "b"\nimages = ["refs/cat.png", "refs/dog 2.png"]\n'
                    '[[prompts]]\nprompt = "c"\nimages = [1]\n', encoding="utf-8")
    specs = read_prompts(toml, DEFAULT)
    assert [len(s.images) for s in specs] == [1, 2]
    assert "prompts[2] skipped: images must be a path or a list of paths" in caplog.text


def test_a_prompt_with_input_images_is_skipped_by_a_family_that_takes_none(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from difftune import families
    from difftune.config import SampleConfig
    from difftune.sample.runner import SampleRunner

    (tmp_path / "cat.png").write_bytes(b"png")
    path = tmp_path / "prompts.txt"
    path.write_text("relight it --ci cat.png\na plain prompt\n", encoding="utf-8")
    family = families.get("flux")
    assert family.control_images == 0
    runner = SampleRunner(family, None, None, SampleConfig(prompts=path), tmp_path,  # type: ignore[arg-type]
                          (64, 64), None)  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING):
        assert [s.prompt for s in runner.prompts()] == ["a plain prompt"]
    assert "'relight it' skipped: it names 1 input image(s)" in caplog.text
    assert 'model.family = "flux" takes none' in caplog.text
