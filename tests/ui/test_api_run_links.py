"""/api/runs on a run folder whose files are symbolic links to files outside the roots: each
file is resolved before it is read, so none of their content is served."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from PIL import Image
from safetensors.torch import save_file
import torch

from difftune.ui.api import runs as runs_api
from difftune.ui.context import UiContext
from difftune.ui.security import Roots

PROMPT = "Secret: the Vault Code!"  # its slug is secret-the-vault-code


@pytest.fixture()
def linked(tmp_path: Path) -> tuple[TestClient, Path]:
    """A root with runs/r, whose metrics, LoRA, a sample and a checkpoint are links to files
    outside; its config (a real file) names a prompt file outside."""
    outside, run = tmp_path / "outside", tmp_path / "root" / "runs" / "r"
    (outside / "ckpt").mkdir(parents=True)
    (run / "samples").mkdir(parents=True)
    (run / "checkpoints").mkdir()
    (outside / "metrics.jsonl").write_text(json.dumps({"step": 7, "loss": 0.5}) + "\n")
    (outside / "prompts.txt").write_text(PROMPT + "\n")
    save_file({"w": torch.zeros(1)}, str(outside / "secret.safetensors"),
              metadata={"difftune.rank": "4", "secret": "yes"})
    (outside / "ckpt" / "state.json").write_text("{}")
    Image.new("RGB", (8, 8)).save(outside / "secret.png")
    Image.new("RGB", (8, 8)).save(run / "samples" / "step-000001_01_secret-the-vault-code.png")
    (run / "config.resolved.json").write_text(json.dumps({
        "train": {"steps": 9}, "save": {"name": "lora"},
        "sample": {"prompts": str(outside / "prompts.txt")}}))
    (run / "metrics.jsonl").symlink_to(outside / "metrics.jsonl")
    (run / "lora.safetensors").symlink_to(outside / "secret.safetensors")
    (run / "samples" / "step-000001_00_secret-the-vault-code.png").symlink_to(
        outside / "secret.png")
    (run / "checkpoints" / "step-000002").symlink_to(outside / "ckpt", target_is_directory=True)
    app = FastAPI()
    ctx = UiContext(roots=Roots.of([tmp_path / "root"]), queue=None)  # type: ignore[arg-type]
    app.include_router(runs_api.router(ctx), prefix="/api")
    return TestClient(app), run


def test_linked_metrics_and_lora_are_not_read(linked: tuple[TestClient, Path]) -> None:
    client, _ = linked
    assert client.get("/api/runs/metrics", params={"path": "runs/r"}).json() == []
    summary = client.get("/api/runs/summary", params={"path": "runs/r"}).json()
    assert (summary["step"], summary["total_steps"], summary["lora"]) == (0, 9, None)
    assert client.get("/api/runs/files", params={"path": "runs/r"}).json() == []


def test_linked_samples_and_prompt_file_are_not_read(linked: tuple[TestClient, Path]) -> None:
    client, run = linked
    found = client.get("/api/runs/samples", params={"path": "runs/r"}).json()
    # the own sample's prompt is its file name in words: the prompt file outside is not read
    assert [(s["index"], s["prompt"]) for s in found] == [(1, "secret the vault code")]
    linked_image = run / "samples" / "step-000001_00_secret-the-vault-code.png"
    assert client.get("/api/runs/image", params={"path": str(linked_image)}).status_code == 403
