"""The /api/lora routes: a LoRA file's inspect and verify reports, convert and resize."""

from __future__ import annotations

from typing import Any, Callable

from fastapi import APIRouter, HTTPException
from pydantic import BaseModel, Field

from difftune.ui import lora_file
from difftune.ui.context import UiContext
from difftune.ui.security import PathOutsideRoots


class ConvertIn(BaseModel):
    """A file to convert and the layout to write."""

    path: str
    to: str = Field(description="comfy, diffusers or kohya")


class ResizeIn(BaseModel):
    """A file to resize: a rank, or the share of each module's energy to keep."""

    path: str
    rank: int | None = None
    energy: float | None = None


def _answer(call: Callable[..., Any], *args: Any) -> Any:
    """A `lora_file` call with its refusals as HTTP errors naming the path or field."""
    try:
        return call(*args)
    except PathOutsideRoots as err:
        raise HTTPException(403, str(err)) from None
    except lora_file.NotALora as err:
        raise HTTPException(404, str(err)) from None
    except lora_file.Refused as err:
        raise HTTPException(409 if err.exists else 400, str(err)) from None


def router(ctx: UiContext) -> APIRouter:
    """The /lora routes over `ctx`'s roots."""
    api = APIRouter(prefix="/lora", tags=["lora"])

    @api.get("/report", summary="A LoRA file's inspect and verify reports")
    def report(path: str) -> dict[str, Any]:
        """Family, kind, layout, trainer, ranks, metadata (inspect) and what ComfyUI and
        diffusers would apply of it (verify). 403 outside the roots, 404 for a path that is
        not a .safetensors file, 400 for a file the tools cannot read."""
        return _answer(lora_file.report, ctx.roots, path)

    @api.post("/convert", status_code=201, summary="Convert a LoRA file to another layout")
    def convert(body: ConvertIn) -> dict[str, Any]:
        """Write `<stem>-<to>.safetensors` beside the file; 409 when it exists, 400 when the
        layout cannot carry the file (the reason in the detail)."""
        return _answer(lora_file.convert_file, ctx.roots, body.path, body.to)

    @api.post("/resize", status_code=201, summary="Resize a LoRA file")
    def resize(body: ResizeIn) -> dict[str, Any]:
        """Write `<stem>-r<rank>` (or `-e<energy>`) beside the file; 409 when it exists."""
        return _answer(lora_file.resize, ctx.roots, body.path, body.rank, body.energy)

    return api
