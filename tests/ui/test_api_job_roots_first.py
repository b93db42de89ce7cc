"""/api/jobs: the paths a run file names are checked against the roots before it is loaded, so
a file outside them is never opened (loading reads a model file's header to name its family),
and a missing one is refused as an existing one is (no answer tells whether it exists)."""

from __future__ import annotations

from pathlib import Path

from fastapi.testclient import TestClient

from difftune.ui.context import UiContext

from .opened import flux_safetensors, opened_under
from .test_api_jobs import jobs_api  # noqa: F401 - the fixture

RUN = """[model]
{model}

[[datasets]]
path = "{data}"

[sample]
prompts = "{prompts}"

[save]
dir = "runs/t"
"""
INSIDE = {"model": 'flavor = "tiny"', "data": "data", "prompts": "prompts.txt"}


def _outside(out: Path) -> None:
    """The files and folder a run file names outside the roots."""
    flux_safetensors(out / "model.safetensors")
    flux_safetensors(out / "init.safetensors")
    (out / "data").mkdir()
    (out / "data" / "a.txt").write_text("a secret caption")
    (out / "prompts.txt").write_text("a secret prompt\n")


def _submit(client: TestClient, root: Path, args: list[str], **named: str) -> tuple[int, str]:
    """Submit a train job of a run file (root/cfg/t.toml) naming `named` over INSIDE."""
    (root / "cfg").mkdir(exist_ok=True)
    (root / "cfg" / "data").mkdir(exist_ok=True)
    (root / "cfg" / "t.toml").write_text(RUN.format(**{**INSIDE, **named}))
    answer = client.post("/api/jobs", json={"verb": "train", "config": "cfg/t.toml",
                                            "args": args})
    return answer.status_code, answer.json().get("detail", "")


def test_run_file_paths_outside_the_roots_are_refused_before_any_is_opened(
        jobs_api: tuple[TestClient, UiContext]) -> None:  # noqa: F811
    client, ctx = jobs_api
    root, out = ctx.roots.main, ctx.roots.main.parent / "outside"
    _outside(out)
    (root / "link.safetensors").symlink_to(out / "model.safetensors")
    cases = [  # (field the refusal names, arguments, run-file values), each for a file there
        ("model.transformer", [], {"model": f'transformer = "{out}/model.safetensors"'}),
        ("model.transformer", [], {"model": 'transformer = "../link.safetensors"'}),
        ("datasets.0.path", [], {"data": "../../outside/data"}),
        ("sample.prompts", [], {"prompts": f"{out}/prompts.txt"}),
        ("--init-lora", ["--init-lora", f"{out}/init.safetensors"], {}),
    ]
    with opened_under(out) as opened:
        for field, args, named in cases:
            status, detail = _submit(client, root, args, **named)
            assert status == 403 and field in detail, (field, detail)
            assert "outside the folders this app serves" in detail and "move the file" in detail
            missing = {k: v.replace("outside/", "outside/gone-") for k, v in named.items()}
            gone = [a.replace("outside/", "outside/gone-") for a in args]
            status, refused = _submit(client, root, gone, **missing)
            assert (status, refused.replace("gone-", "")) == (403, detail), (field, refused)
    assert opened == [] and client.get("/api/jobs").json() == []
    assert _submit(client, root, [], data="../data")[0] == 201  # from the run file's folder
