"""The README's "Your first real LoRA", followed as a user follows it, on the tiny FLUX.1 flavor.

Its blocks are found by their `<!-- walkthrough:NAME -->` comments and run through the real CLI
with the same verbs and the same config keys. What changes: the model source (the tiny flavor
instead of the downloaded folder, which is the one step not run), the folder (`/runs` becomes a
temporary one) and the sizes (steps, resolution, sample sizes), each changed line asserted to be
there, so a walkthrough edited out of shape fails here instead of drifting. Its run file
keeps the settings of the example it says it has, and the table of contents is checked too:
each of its links names a heading of the README.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from safetensors import safe_open

from difftune.cli import main

from ..comfy_keymap import unmapped
from ..ui.browser import _user_env, free_port

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
BLOCK = re.compile(r"<!-- walkthrough:([\w-]+) -->\n```\w+\n(.*?)```", re.S)
STEPS = 2
# The run file's lines made small (exact lines: each must be in the README's block once).
SMALLER = {'path = "/models/FLUX.1-dev"': 'flavor = "tiny"',  # the model source
           "steps = 2000": f"steps = {STEPS}",
           "warmup_steps = 50": "warmup_steps = 1",
           "resolution = 1024": "resolution = 64",
           "min_side = 512": "min_side = 32",
           "max_side = 1536": "max_side = 128",
           "every_n_steps = 250": "every_n_steps = 1",
           "steps = 28": "steps = 2",
           "every_n_steps = 500": "every_n_steps = 1"}


def _blocks() -> dict[str, str]:
    """The walkthrough's marked blocks by name."""
    found = dict(BLOCK.findall(README.read_text(encoding="utf-8")))
    expected = {"download", "prompts", "run-file", "check", "train", "ui", "sample", "comfyui"}
    assert set(found) == expected, f"README walkthrough blocks: {sorted(found)}"
    return found


def _command(block: str, runs: Path) -> list[str]:
    """The block's one command as argv, with `/runs` pointed at `runs`."""
    lines = [ln for ln in block.splitlines() if ln.strip()]
    assert len(lines) == 1, block
    return [re.sub(r"^/runs(?=/|$)", runs.as_posix(), a) for a in shlex.split(lines[0])]


def _run_file(block: str) -> str:
    """The README's run file with the model source and sizes made small."""
    for old, new in SMALLER.items():
        lines = block.splitlines()
        assert lines.count(old) == 1, f"the README's run file no longer has the line {old!r}"
        block = "\n".join(new if ln == old else ln for ln in lines) + "\n"
    return block


def _prompts(block: str) -> str:
    """The README's prompts at sample sizes the tiny model draws in a moment."""
    small = re.sub(r"--w \d+ --h \d+ --s \d+", "--w 32 --h 32 --s 2", block)
    assert small.count("--s 2") == len(block.splitlines()), block
    return small


def _difftune(argv: list[str], capsys) -> str:
    """Run `difftune ARGV` through the CLI's entry point; its standard output."""
    assert argv[0] == "difftune", argv
    code = main(argv[1:])
    out, err = capsys.readouterr()
    assert code == 0, f"{shlex.join(argv)} exited {code}:\n{err}"
    return out


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as answer:
        return answer.read()


def _watch(argv: list[str], runs: Path, run_dir: Path) -> dict:
    """Serve `difftune ui` as the walkthrough starts it (on a free port) and read the run as
    its run page does: the page answers and the summary says the run finished."""
    port = free_port()
    assert argv[:2] == ["difftune", "ui"], argv
    proc = subprocess.Popen([sys.executable, "-m", "difftune", *argv[1:], "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=runs,
                            env=_user_env())
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.communicate()[0]
            try:
                _get(f"{url}/api/jobs")
                break
            except (urllib.error.URLError, ConnectionError):
                assert time.monotonic() < deadline, "difftune ui did not answer in 60 s"
                time.sleep(0.3)
        query = urllib.parse.urlencode({"path": str(run_dir)})
        assert b"<html" in _get(f"{url}/run?{query}").lower()
        return json.loads(_get(f"{url}/api/runs/summary?{query}"))
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_the_walkthrough_runs_as_written(tmp_path: Path, images: Path, capsys) -> None:
    blocks = _blocks()
    runs = tmp_path / "runs"
    run_dir = runs / "my-subject"
    # 1. The download is the one step not run: it must land where the run file looks.
    folder = shlex.split(blocks["download"])[-1]
    assert f'path = "{folder}"' in blocks["run-file"].splitlines()
    # 2. The run folder: the user's images and captions, prompts and run file.
    shutil.copytree(images, run_dir / "images")
    (run_dir / "prompts.txt").write_text(_prompts(blocks["prompts"]), encoding="utf-8")
    (run_dir / "run.toml").write_text(_run_file(blocks["run-file"]), encoding="utf-8")
    # 3. check, 4. train.
    checked = _difftune(_command(blocks["check"], runs), capsys)
    assert "check passed" in checked and "estimated peak" in checked
    _difftune(_command(blocks["train"], runs), capsys)
    lora = run_dir / "my-subject.safetensors"
    assert lora.is_file() and (run_dir / "my-subject-step000001.safetensors").is_file()
    assert list((run_dir / "samples").glob(f"step-{STEPS:06d}_*.png"))
    # 5. Watch it in the web app, then try the LoRA from the run's config.
    summary = _watch(_command(blocks["ui"], runs), runs, run_dir)
    assert summary["finished"] and summary["step"] == STEPS, summary
    _difftune(_command(blocks["sample"], runs), capsys)
    assert len(list((run_dir / "tried").glob("*.png"))) >= 2
    # 6. ComfyUI: the copied file is the run's, and ComfyUI's FLUX.1 key map takes every key.
    (tmp_path / "ComfyUI" / "models" / "loras").mkdir(parents=True)
    subprocess.run(_command(blocks["comfyui"], runs), cwd=tmp_path, check=True)
    copied = tmp_path / "ComfyUI" / "models" / "loras" / lora.name
    assert copied.read_bytes() == lora.read_bytes()
    with safe_open(str(copied), "pt") as f:
        assert unmapped("flux", list(f.keys())) == []


def _flat(table: dict, prefix: str = "") -> dict[str, object]:
    """A TOML document's values by dotted key (array items by index)."""
    items = table.items() if isinstance(table, dict) else enumerate(table)
    flat: dict[str, object] = {}
    for key, value in items:
        if isinstance(value, (dict, list)) and value and isinstance(
                value if isinstance(value, dict) else value[0], dict):
            flat |= _flat(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def test_the_walkthrough_has_the_examples_settings() -> None:
    """The README says its run file has examples/flux-dev-lora.toml's settings: every key it
    sets has the example's value, paths and the file name's layout aside."""
    ours = _flat(tomllib.loads(_blocks()["run-file"]))
    example = _flat(tomllib.loads((ROOT / "examples" / "flux-dev-lora.toml").read_text(
        encoding="utf-8")))
    paths = {"model.path", "datasets.0.subsets.0.path", "sample.prompts", "save.dir"}
    differ = {k: (v, example.get(k)) for k, v in ours.items()
              if k not in paths and example.get(k) != v}
    assert not differ, f"walkthrough vs example (ours, example's): {differ}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_table_of_contents_names_the_headings() -> None:
    text = README.read_text(encoding="utf-8")
    outside_code = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    anchors = {_slug(h) for h in re.findall(r"^#{2,3} (.+)$", outside_code, flags=re.M)}
    anchors.discard("contents")
    contents = text.split("## Contents\n", 1)[1].split("\n## ", 1)[0]
    links = re.findall(r"\]\(#([^)]+)\)", contents)
    assert len(links) == len(anchors) and set(links) == anchors
