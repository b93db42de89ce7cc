"""`/api/datasets/captioning` and `/api/datasets/findings`: caption a dataset folder in the
background with a local model (start, state, stop; ui/captioning.py) and the dataset report's
findings (dataset_report/). Paths are checked against the roots (403 outside them); a model
folder that is not a captioner, or a bad style, is 422; a second start on a folder being
captioned is 409."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, HTTPException, Query
from pydantic import BaseModel, Field

from difftune.errors import DifftuneError
from difftune.ui import captioning
from difftune.ui.api.datasets import _resolve
from difftune.ui.context import UiContext
from difftune.ui.security import PathOutsideRoots


class CaptionStart(BaseModel):
    """What to caption (`folder`), with what (`model`), how (`style`, `prompt`, `trigger`)."""

    folder: str
    model: str
    style: str = Field("short", description="short, detailed, tags or prompt")
    prompt: str = Field("", max_length=2000)
    trigger: str = Field("", max_length=200)


def router(ctx: UiContext) -> APIRouter:
    """The captioning and findings routes over `ctx`'s roots."""
    api = APIRouter(prefix="/datasets", tags=["datasets"])

    @api.post("/captioning", status_code=202, summary="Caption a folder in the background")
    def start(body: CaptionStart) -> dict[str, Any]:
        """Start `difftune caption` on the folder's uncaptioned images; its state."""
        try:
            folder = captioning.start_under(ctx.roots, body.folder, body.model, body.style,
                                            body.prompt, body.trigger)
        except PathOutsideRoots as err:
            raise HTTPException(status_code=403, detail=str(err)) from None
        except captioning.AlreadyRunning as err:
            raise HTTPException(status_code=409, detail=str(err)) from None
        except (ValueError, DifftuneError) as err:
            raise HTTPException(status_code=422, detail=str(err)) from None
        return captioning.status(ctx.roots.app_folder, folder).to_dict()

    @api.get("/captioning", summary="The state of a folder's captioning")
    def state(folder: str) -> dict[str, Any]:
        """Its state, captions written of the total, speed, time left, newest captions."""
        return captioning.status(ctx.roots.app_folder, _resolve(ctx, folder)).to_dict()

    @api.delete("/captioning", summary="Stop a folder's captioning")
    def stop(folder: str) -> dict[str, Any]:
        """Stop after the current batch (every caption written is kept); 409 when none runs."""
        target = _resolve(ctx, folder)
        if not captioning.stop(ctx.roots.app_folder, target):
            raise HTTPException(status_code=409, detail=f"{folder} is not being captioned")
        return captioning.status(ctx.roots.app_folder, target).to_dict()

    @api.get("/findings", summary="The dataset report of a folder or run file")
    def findings(path: str, resolution: int = Query(1024, ge=64, le=8192)) -> dict[str, Any]:
        """`difftune dataset report --json` of a folder (at `resolution`) or a run file."""
        source = _resolve(ctx, path)
        if not source.exists():
            raise HTTPException(status_code=404, detail=f"{path} does not exist")
        try:
            return captioning.findings(source, resolution, ctx.roots).to_dict()
        except PathOutsideRoots as err:
            raise HTTPException(status_code=403, detail=str(err)) from None
        except (ValueError, DifftuneError) as err:
            raise HTTPException(status_code=422, detail=str(err)) from None

    return api
