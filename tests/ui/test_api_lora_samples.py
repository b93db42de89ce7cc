"""/api/runs/lora-samples on a copy of a real tiny run: "sample with this LoRA" queues a real
`difftune sample` job whose images (one per prompt and seed, at the strength asked) land in a
folder of their own, listed with their prompts and seeds, never among the run's samples; and
every path outside the roots, file that is not a run's LoRA, or bad field is refused."""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from difftune.config import load_config
from difftune.ui import lora_samples
from difftune.ui.api import runs as runs_api
from difftune.ui.context import UiContext
from difftune.ui.jobs.queue import JobQueue
from difftune.ui.limits import MAX_BODY_BYTES, BodyLimit
from difftune.ui.security import Guard, Roots
from tests.ui import tiny_run

RUN = "runs/tiny"


@pytest.fixture()
def served(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[TestClient, UiContext, Path]]:
    """A root holding a copy of the tiny run (its prompt file beside it), a secret LoRA-named
    file outside the root, and a queue running the real CLI."""
    run = tiny_run.make(tmp_path_factory)
    root = tmp_path / "root"
    shutil.copytree(run, root / RUN, ignore=shutil.ignore_patterns("tensorboard"))
    config = root / RUN / "config.resolved.json"
    cfg = json.loads(config.read_text())
    prompts = shutil.copy(cfg["sample"]["prompts"], root / "prompts.txt")
    cfg["sample"]["prompts"] = str(prompts)  # (save.dir still names where it trained)
    config.write_text(json.dumps(cfg))
    (tmp_path / "outside.safetensors").write_bytes((root / RUN / "demo-lora.safetensors")
                                                   .read_bytes())
    roots = Roots.of([root])
    queue = JobQueue(roots.app_folder / "jobs.db", roots, gpus=False)
    ctx = UiContext(roots=roots, queue=queue)
    app = FastAPI()
    app.include_router(runs_api.router(ctx), prefix="/api")
    try:
        yield TestClient(app), ctx, root
    finally:
        queue.close()


def test_sample_with_a_lora_writes_its_own_folder(served: tuple[TestClient, UiContext, Path]
                                                  ) -> None:
    client, ctx, root = served
    lora = root / RUN / "demo-lora-step000002.safetensors"
    before = sorted(p.name for p in (root / RUN / "samples").iterdir())
    made = client.post("/api/runs/lora-samples", json={
        "lora": str(lora), "prompts": ["a red circle", "a blue square --w 64"],
        "seeds": [5, 6], "strength": 0.5})
    assert made.status_code == 201, made.text
    folder = Path(made.json()["folder"])
    assert folder == root / RUN / "lora-samples" / "demo-lora-step000002-1"
    assert (folder / "prompts.txt").read_text().splitlines() == [
        "a red circle --d 5", "a red circle --d 6", "a blue square --w 64 --d 5",
        "a blue square --w 64 --d 6"]
    job = ctx.queue.get(made.json()["job"])
    assert (job.verb, job.run_dir) == ("sample", root / RUN)
    assert job.args[:2] == ["--lora", f"{lora}:0.5"] and job.args[-2:] == ["--out", str(folder)]
    written = load_config(folder / "run.toml")  # the run's own config, in its folder now
    assert (written.save.dir, written.cache.dir) == (root / RUN, root / RUN / "cache")
    again = client.post("/api/runs/lora-samples", json={"lora": str(lora), "prompts": ["x"]})
    assert Path(again.json()["folder"]).name == "demo-lora-step000002-2"
    ctx.queue.stop(again.json()["job"])  # (cancelled while queued)
    for _ in range(600):  # the real `difftune sample` runs
        ctx.queue.tick()
        if ctx.queue.get(job.id).finished:
            break
        time.sleep(0.1)
    assert ctx.queue.get(job.id).state == "succeeded", ctx.queue.tail(job.id)
    sets = client.get("/api/runs/lora-samples", params={"path": RUN}).json()
    done = next(s for s in sets if s["folder"] == str(folder))
    assert (done["lora"], done["strength"], done["seeds"], done["job"]) == (
        str(lora), 0.5, [5, 6], job.id)
    assert [(i["index"], i["prompt"], i["seed"]) for i in done["images"]] == [
        (0, "a red circle", 5), (1, "a red circle", 6), (2, "a blue square", 5),
        (3, "a blue square", 6)]
    shown = client.get("/api/runs/image", params={"path": done["images"][0]["path"]})
    assert shown.status_code == 200 and shown.content[:4] == b"\x89PNG"
    assert sorted(p.name for p in (root / RUN / "samples").iterdir()) == before


def test_refusals(served: tuple[TestClient, UiContext, Path], tmp_path: Path) -> None:
    client, ctx, root = served
    lora = str(root / RUN / "demo-lora.safetensors")

    def post(**body: object) -> tuple[int, str]:
        answer = client.post("/api/runs/lora-samples", json={"lora": lora, "prompts": ["x"]}
                             | body)
        return answer.status_code, answer.json()["detail"]

    status, detail = post(lora=str(tmp_path / "outside.safetensors"))
    assert status == 403 and "outside the folders this app serves" in detail
    assert post(lora="../outside.safetensors")[0] == 403
    (root / RUN / "lora-samples").symlink_to(tmp_path, target_is_directory=True)
    status, detail = post()  # its folder would be written through a link leading out
    assert status == 403 and "lora-samples" in detail
    (root / RUN / "lora-samples").unlink()
    status, detail = post(lora=str(root / RUN / "metrics.jsonl"))
    assert status == 404 and "not a LoRA file of a run folder" in detail
    assert post(lora=str(root / "prompts.txt"))[0] == 404  # not in a run folder
    status, detail = post(prompts=["", "  "])
    assert status == 400 and detail.startswith("prompts:")
    status, detail = post(prompts=["a # comment"])
    assert status == 400 and "'#'" in detail
    status, detail = post(seeds=[])
    assert status == 400 and "seeds" in detail
    status, detail = post(strength=1e9)
    assert status == 400 and detail.startswith("strength:")
    assert not (root / RUN / "lora-samples").exists() or not any(
        (root / RUN / "lora-samples").iterdir())
    assert client.get("/api/runs/lora-samples", params={"path": str(tmp_path)}).status_code \
        == 403
    outside_png = tmp_path / "lora-samples" / "x-1" / "a.png"
    outside_png.parent.mkdir(parents=True)
    outside_png.write_bytes(b"\x89PNG")
    assert client.get("/api/runs/image", params={"path": str(outside_png)}).status_code == 403


def test_a_request_from_another_site_or_too_large_writes_nothing(
        served: tuple[TestClient, UiContext, Path]) -> None:
    _, ctx, root = served
    app = FastAPI()  # the router behind the middleware `difftune ui` puts in front of it
    app.include_router(runs_api.router(ctx), prefix="/api")
    app.add_middleware(BodyLimit)
    app.add_middleware(Guard, token=None, origin_token="t")
    client = TestClient(app, base_url="http://127.0.0.1:8765")
    body = {"lora": str(root / RUN / "demo-lora.safetensors"), "prompts": ["x"]}
    refused = client.post("/api/runs/lora-samples", json=body,
                          headers={"Origin": "http://evil.example"})
    assert refused.status_code == 403 and "another web site" in refused.text
    big = client.post("/api/runs/lora-samples", json=body | {"prompts": ["x" * MAX_BODY_BYTES]})
    assert big.status_code == 413
    assert not (root / RUN / "lora-samples").exists() and ctx.queue.list() == []


@dataclass
class Recorder:
    """A queue that records what it is asked to run (the pairing is decided before it)."""

    args: list[list[str]] = field(default_factory=list)

    def submit(self, verb: str, config: Path, args: list[str], device: str = "default") -> Any:
        self.args.append(list(args))
        return SimpleNamespace(id=len(self.args))


def test_an_expert_file_samples_with_its_partner(tmp_path: Path) -> None:
    """Wan 2.2 A14B: "sample with this LoRA" on either expert's file loads both files of that
    save (a sample runs both experts); an expert file whose partner is missing goes alone."""
    run = tmp_path / "root" / "runs" / "a14b"
    run.mkdir(parents=True)
    (run / "config.resolved.json").write_text(json.dumps({
        "model": {"family": "wan", "variant": "2.2-t2v-a14b"}, "save": {"dir": str(run)}}))
    pair = [run / f"x{s}.safetensors" for s in ("_high_noise", "_low_noise")]
    for path in [*pair, run / "x-step000002_low_noise.safetensors"]:
        path.write_bytes(b"x")
    queue = Recorder()
    ctx = UiContext(roots=Roots.of([tmp_path / "root"]), queue=queue)  # type: ignore[arg-type]
    ask = lora_samples.Request.checked(["a cat"], [0], 0.5)
    for clicked in pair:
        lora_samples.submit(ctx, str(clicked), ask)
        loras = [a for a in queue.args[-1] if a.endswith(".safetensors:0.5")]
        assert loras == [f"{p}:0.5" for p in pair]
    lora_samples.submit(ctx, str(run / "x-step000002_low_noise.safetensors"), ask)
    assert [a for a in queue.args[-1] if ".safetensors" in a] == [
        f"{run / 'x-step000002_low_noise.safetensors'}:0.5"]
