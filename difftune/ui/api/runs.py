"""`/api/runs`: list runs and read what a run wrote (summary, metrics, samples, files), and
download its files. Every path is checked against the app's roots (403 outside them) and must
lie in a run folder (404 otherwise); each file read inside a run folder is checked too (one
that is a link leading outside the roots is left out). Routes are plain `def`: FastAPI runs
them in its thread pool, so reading files never blocks the event loop.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter, HTTPException, Query
from fastapi.responses import FileResponse
from pydantic import BaseModel, Field

from difftune.ui import lora_samples
from difftune.ui import run_outputs as outputs
from difftune.ui import runs
from difftune.ui.context import UiContext
from difftune.ui.security import PathOutsideRoots

# What /image serves inline: sample PNGs, and sampled clips' animated WebP previews.
SAMPLE_TYPES = {".png": "image/png", ".webp": "image/webp"}


class RunSummaryModel(BaseModel):
    """A run's progress and losses (see `difftune.ui.runs.RunSummary`)."""

    name: str
    path: str
    step: int
    total_steps: int | None
    it_per_s: float | None
    eta_s: float | None
    gpu_mem: float | None
    loss: float | None
    loss_smoothed: float | None
    best_val_loss: float | None
    best_val_step: int | None
    updated: float | None
    family: str | None
    lora: str | None
    finished: bool
    best: str | None


class SampleModel(BaseModel):
    """One sample image (see `difftune.ui.outputs.SampleImage`)."""

    step: int | None
    index: int
    prompt: str
    label: str
    path: str
    seed: int | None = Field(None, description="the seed it was drawn with, when the prompt "
                             "file still holds its prompt")
    preview: str | None = Field(None, description="a sampled clip's animated WebP (fetch it "
                                "with /image like the PNG, its first frame); its mp4 sits "
                                "beside it")


class SampleSetModel(BaseModel):
    """A "sample with this LoRA" folder and its images (see `lora_samples.SampleSet`)."""

    folder: str
    lora: str | None
    strength: float | None
    seeds: list[int]
    job: int | None
    images: list[SampleModel]


class LoraSamplesIn(BaseModel):
    """What to sample with a LoRA file of a run: one image per prompt and seed."""

    lora: str = Field(description="a .safetensors LoRA file of a run folder, under the roots")
    prompts: list[str] = Field(description="the prompts (a prompt file's options allowed)")
    seeds: list[int] = Field(default=[0], description="the seeds, each prompt drawn with each")
    strength: float = Field(default=1.0, description="the LoRA's weight (1 = as trained)")
    device: str = Field(default="default", description="default, cpu or cuda:N")


class LoraSamplesOut(BaseModel):
    """The queued `difftune sample` job and the folder its images go to."""

    job: int
    folder: str


class RunFileModel(BaseModel):
    """A LoRA, embedding or model file, or a checkpoint folder (see `outputs.RunFile`)."""

    kind: str
    path: str
    step: int | None
    size: int
    metadata: dict[str, str]
    complete: bool
    final: bool


def resolve(ctx: UiContext, path: str) -> Path:
    """`path` resolved under the roots (HTTP 403 with the reason when it lies outside)."""
    try:
        return ctx.roots.resolve(path)
    except PathOutsideRoots as err:
        raise HTTPException(status_code=403, detail=str(err)) from None


def run_folder(ctx: UiContext, path: str) -> Path:
    """The run folder `path` names (403 outside the roots, 404 when it is not a run)."""
    folder = resolve(ctx, path)
    if not folder.is_dir() or not runs.is_run(folder):
        raise HTTPException(status_code=404, detail=f"{path} is not a run folder (it holds "
                            "neither metrics.jsonl nor config.resolved.json)")
    return folder


def run_file(ctx: UiContext, path: str) -> Path:
    """A regular file inside a run folder under the roots (403 outside them, 404 else)."""
    target = resolve(ctx, path)
    if not target.is_file() or runs.run_of(target.parent) is None:
        raise HTTPException(status_code=404, detail=f"{path} is not a file of a run folder")
    return target


def router(ctx: UiContext) -> APIRouter:
    """The /runs routes over `ctx`'s roots."""
    api = APIRouter(prefix="/runs", tags=["runs"])

    @api.get("", response_model=list[RunSummaryModel], summary="List the runs under the roots")
    def list_runs(depth: int = Query(4, ge=0, le=8)) -> list[dict[str, Any]]:
        """Every run folder (holding metrics.jsonl or config.resolved.json) under the roots,
        newest first, with its summary."""
        return [r.to_dict() for r in runs.find_runs(ctx.roots, depth)]

    @api.get("/summary", response_model=RunSummaryModel, summary="A run's progress")
    def run_summary(path: str) -> dict[str, Any]:
        """Step/total, it/s, ETA, GPU memory, last and best losses of the run at `path`."""
        return runs.summary(run_folder(ctx, path), ctx.roots).to_dict()

    @api.get("/metrics", summary="A run's metrics rows")
    def run_metrics(path: str, since: int = 0) -> list[dict[str, Any]]:
        """The metrics.jsonl rows with step > `since` (poll with the last step seen);
        non-finite values are null."""
        return runs.metrics(run_folder(ctx, path), since, ctx.roots)

    @api.get("/samples", response_model=list[SampleModel], summary="A run's sample images")
    def run_samples(path: str) -> list[dict[str, Any]]:
        """The sample images by step and prompt, with each prompt's text; fetch an image with
        /api/runs/image?path=."""
        return [s.to_dict() for s in outputs.samples(run_folder(ctx, path), ctx.roots)]

    @api.get("/files", response_model=list[RunFileModel], summary="A run's weights and checkpoints")
    def run_files(path: str) -> list[dict[str, Any]]:
        """LoRA / embedding / model files and checkpoint folders with their safetensors
        metadata; download a file with /api/runs/file?path=."""
        return [f.to_dict() for f in outputs.files(run_folder(ctx, path), ctx.roots)]

    @api.get("/file", response_class=FileResponse, summary="Download a file of a run")
    def download(path: str) -> FileResponse:
        """A file inside a run folder (a LoRA, the config, the log, a sample), as a download."""
        target = run_file(ctx, path)
        return FileResponse(target, filename=target.name)

    @api.get("/image", response_class=FileResponse, summary="A sample image")
    def image(path: str) -> FileResponse:
        """A PNG of a run's samples folder or of a "sample with this LoRA" folder (or a
        sampled clip's animated WebP preview), shown inline."""
        target = run_file(ctx, path)
        folder = target.parent
        kind = SAMPLE_TYPES.get(target.suffix.lower())
        if kind is None or not (
                folder.name == "samples" or folder.parent.name == lora_samples.FOLDER):
            raise HTTPException(status_code=404, detail=f"{path} is not a sample image")
        return FileResponse(target, media_type=kind)

    @api.get("/lora-samples", response_model=list[SampleSetModel],
             summary="A run's samples made with one of its LoRA files")
    def sample_sets(path: str) -> list[dict[str, Any]]:
        """The run's `lora-samples/` folders, newest first: the LoRA, strength, seeds and
        job of each, and its images with their prompts and seeds."""
        return [s.to_dict() for s in lora_samples.sample_sets(run_folder(ctx, path),
                                                              ctx.roots)]

    @api.post("/lora-samples", response_model=LoraSamplesOut, status_code=201,
              summary="Sample with a LoRA file of a run")
    def sample_with(body: LoraSamplesIn) -> LoraSamplesOut:
        """Queue `difftune sample` with the LoRA at the given strength, every prompt drawn
        with every seed; the images go to `<run>/lora-samples/<lora stem>-<n>/`, never among
        the run's own samples. 403 for a path outside the roots, 404 for a file that is not
        a LoRA of a run folder, 400 for a bad field."""
        try:
            request = lora_samples.Request.checked(body.prompts, body.seeds, body.strength)
            job, folder = lora_samples.submit(ctx, body.lora, request, body.device)
        except (ValueError, OSError) as err:
            raise HTTPException(lora_samples.refusal_status(err), str(err)) from None
        return LoraSamplesOut(job=job.id, folder=str(folder))

    return api
