"""`/api/datasets`: browse a folder's images and captions, edit a caption, report what training
would make of a folder or run file, and serve images and thumbnails. Every path (the caption
file a write would replace, each file a report reads) is checked against the app's roots: 403
outside them or, for a write, in the app's own folder. A caption write only ever creates or
replaces a caption file (`caption_ext` one of `datasets.CAPTION_EXTENSIONS`, else 422).
Uploads follow `dataset_uploads`' rules (never replacing a file); bulk caption edits and their
undo follow `caption_bulk`'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter, HTTPException, Query, Request, Response
from fastapi.responses import FileResponse
from starlette.concurrency import run_in_threadpool
from pydantic import BaseModel, Field

from difftune.errors import DifftuneError
from difftune.ui import caption_bulk, dataset_uploads, datasets
from difftune.ui.context import UiContext
from difftune.ui.security import PathOutsideRoots


class DatasetImageModel(BaseModel):
    """One image and its caption (see `difftune.ui.datasets.DatasetImage`)."""

    image: str
    caption: str | None
    caption_file: str
    width: int | None
    height: int | None
    bytes: int
    error: str | None
    frames: int | None = Field(None, description="a video's frame count (None: an image)")
    fps: float | None = Field(None, description="a video's frame rate (None: an image)")


class BrowseModel(BaseModel):
    """A page of a folder's images."""

    folder: str
    total: int
    offset: int
    limit: int
    items: list[DatasetImageModel]


class FolderModel(BaseModel):
    """A folder holding images, for the folder picker."""

    path: str
    images: int


# A caption extension as a request may give it: a short suffix, no separators or control
# characters (which one is a caption's, `datasets._ext` decides).
CAPTION_EXT = {"max_length": 16, "pattern": r"^\.?[A-Za-z0-9_-]+$",
               "description": f"the caption files' extension: one of "
                              f"{', '.join(datasets.CAPTION_EXTENSIONS)}"}


class CaptionEdit(BaseModel):
    """A caption to write: the image it belongs to and its new text."""

    image: str
    text: str
    caption_ext: str = Field(datasets.DEFAULT_CAPTION_EXT, **CAPTION_EXT)


class CaptionWritten(BaseModel):
    """The caption file written and the text it now holds."""

    caption_file: str
    caption: str


class ReportModel(BaseModel):
    """Buckets, skipped images with check's reasons, caption statistics."""

    source: str
    buckets: list[dict[str, Any]]
    skipped: list[dict[str, str]]
    missing_captions: list[str]
    tags: list[dict[str, Any]]
    lengths: list[dict[str, int]]
    summary: dict[str, Any]
    caption_styles: dict[str, int]
    error: str | None


class BulkEditModel(BaseModel):
    """A bulk caption edit of a folder (see `difftune.ui.caption_bulk`): over `images` when
    given, else over every image of `folder`."""

    folder: str
    op: caption_bulk.Op
    text: str = Field(min_length=1, max_length=1000)
    where: caption_bulk.Where = "start"
    replacement: str = Field("", max_length=1000)
    images: list[str] | None = None
    caption_ext: str = Field(datasets.DEFAULT_CAPTION_EXT, **CAPTION_EXT)


class FolderOnly(BaseModel):
    """A dataset folder."""

    folder: str


class ChangedFiles(BaseModel):
    """The files a request wrote (or, for an undo, restored)."""

    files: list[str]


def _resolve(ctx: UiContext, path: str) -> Path:
    """`path` under the roots, or HTTP 403 with the reason."""
    try:
        return ctx.roots.resolve(path)
    except PathOutsideRoots as err:
        raise HTTPException(status_code=403, detail=str(err)) from None


def router(ctx: UiContext) -> APIRouter:
    """The /datasets routes over `ctx`'s roots."""
    api = APIRouter(prefix="/datasets", tags=["datasets"])

    @api.get("/folders", response_model=list[FolderModel], summary="Folders holding images")
    def folders(depth: int = Query(4, ge=0, le=8)) -> list[dict[str, Any]]:
        """Folders under the roots that hold images (hidden, cache and run folders left out)."""
        return datasets.image_folders(list(ctx.roots.folders), depth)

    @api.get("/browse", response_model=BrowseModel, summary="A page of a folder's images")
    def browse(path: str, offset: int = Query(0, ge=0), limit: int = Query(48, ge=1, le=500),
               caption_ext: str = Query(datasets.DEFAULT_CAPTION_EXT, **CAPTION_EXT)
               ) -> dict[str, Any]:
        """The images training would find in `path` (recursively, hidden files left out) with
        their captions, `limit` from `offset`."""
        folder = _resolve(ctx, path)
        try:
            return datasets.browse(folder, offset, limit, caption_ext,
                                   inside=datasets.under(ctx.roots)).to_dict()
        except ValueError as err:
            raise HTTPException(status_code=422, detail=str(err)) from None

    @api.put("/caption", response_model=CaptionWritten, summary="Write an image's caption")
    def caption(edit: CaptionEdit) -> dict[str, str]:
        """Write the same-stem caption file of `image` (atomically; nothing else changes)."""
        try:
            written = datasets.edit_caption(ctx.roots, edit.image, edit.text, edit.caption_ext)
        except PathOutsideRoots as err:
            raise HTTPException(status_code=403, detail=str(err)) from None
        except (ValueError, OSError) as err:  # (OSError: e.g. a folder where the file goes)
            raise HTTPException(status_code=422, detail=str(err)) from None
        return {"caption_file": str(written), "caption": written.read_text(encoding="utf-8")}

    @api.get("/report", response_model=ReportModel, summary="What training would make of it")
    def report(path: str, resolution: int = 1024, family: str | None = None) -> dict[str, Any]:
        """Buckets, skipped images (with the reason `check` gives) and caption statistics of
        a folder (bucketed at `resolution`, `family`'s bucket step) or a run file (.toml)."""
        source = _resolve(ctx, path)
        if not source.exists():
            raise HTTPException(status_code=404, detail=f"{path} does not exist")
        try:
            return datasets.report(source, resolution, family, ctx.roots).to_dict()
        except PathOutsideRoots as err:
            raise HTTPException(status_code=403, detail=str(err)) from None
        except (ValueError, DifftuneError) as err:
            raise HTTPException(status_code=422, detail=str(err)) from None

    @api.get("/image", summary="An image of a dataset, or its thumbnail",
             response_class=Response)
    def image(path: str, size: int | None = Query(None, ge=16, le=2048)) -> Response:
        """The image file, or with `size` a JPEG thumbnail at most `size` px on its longer
        side (a video's: its first frame; 422 with check's reason for an unreadable file)."""
        from difftune.data.discover import IMAGE_EXTENSIONS
        from difftune.data.video import VIDEO_EXTENSIONS

        target = _resolve(ctx, path)
        if not target.is_file() or target.suffix.lower() not in (IMAGE_EXTENSIONS
                                                                  | VIDEO_EXTENSIONS):
            raise HTTPException(status_code=404, detail=f"{path} is not an image file")
        if size is None:
            return FileResponse(target)
        try:
            return Response(datasets.thumbnail(target, size), media_type="image/jpeg")
        except ValueError as err:
            raise HTTPException(status_code=422, detail=f"{target}: {err}") from None

    edit_routes(api, ctx)
    return api


def edit_routes(api: APIRouter, ctx: UiContext) -> None:
    """The routes that add files to a dataset folder or edit its captions in bulk."""

    @api.post("/upload", response_model=ChangedFiles, summary="Upload images and captions")
    async def upload(request: Request, folder: str) -> dict[str, list[str]]:
        """Multipart files into `folder`; each refused file (bad name 422, existing 409, too
        large 413, outside the roots 403) is named with its reason, the others are kept."""
        from starlette.datastructures import UploadFile

        async with request.form(max_files=1000) as form:
            files = [dataset_uploads.Incoming(f.filename or "", f.file)
                     for _, f in form.multi_items() if isinstance(f, UploadFile)]
            try:
                saved, refused = await run_in_threadpool(dataset_uploads.save_all, ctx.roots,
                                                         folder, files)
            except PathOutsideRoots as err:
                raise HTTPException(status_code=403, detail=str(err)) from None
            except ValueError as err:
                raise HTTPException(status_code=422, detail=str(err)) from None
        if refused:
            kept = f"; kept: {', '.join(p.name for p in saved)}" if saved else ""
            raise HTTPException(status_code=max(r.status for r in refused),
                                detail="refused " + "; ".join(map(str, refused)) + kept)
        if not saved:
            raise HTTPException(status_code=422, detail="no file in the request; send files "
                                                        "as multipart form parts")
        return {"files": [str(p) for p in saved]}

    @api.post("/bulk-caption", response_model=ChangedFiles, summary="Edit captions in bulk")
    def bulk(body: BulkEditModel) -> dict[str, list[str]]:
        """Add/remove a trigger word or find and replace, over all or the chosen images;
        journaled so `/undo-caption` puts the captions back exactly."""
        edit = caption_bulk.BulkEdit(body.op, body.text, body.where, body.replacement)
        return {"files": [str(p) for p in _edited(caption_bulk.bulk_edit, ctx.roots,
                                                  body.folder, edit, body.images,
                                                  body.caption_ext)]}

    @api.post("/undo-caption", response_model=ChangedFiles, summary="Undo the last bulk edit")
    def undo(body: FolderOnly) -> dict[str, list[str]]:
        """Restore the captions the folder's last bulk edit changed (409 when there is none,
        or a caption changed since)."""
        return {"files": [str(p) for p in _edited(caption_bulk.undo, ctx.roots, body.folder)]}


def _edited(action: Any, *args: Any) -> list[Path]:
    """`action(*args)`, its refusals as HTTP errors (403 outside the roots, 409 nothing to
    undo, 422 bad input)."""
    try:
        return action(*args)
    except PathOutsideRoots as err:
        raise HTTPException(status_code=403, detail=str(err)) from None
    except caption_bulk.NothingToUndo as err:
        raise HTTPException(status_code=409, detail=str(err)) from None
    except (ValueError, OSError) as err:
        raise HTTPException(status_code=422, detail=str(err)) from None
