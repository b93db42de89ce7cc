"""`difftune ui`: build the app (pages, API, guard, job queue) and serve it with uvicorn."""

from __future__ import annotations

import fcntl
import logging
import os
import sys
from pathlib import Path
from typing import IO

from difftune.ui.context import UiContext
from difftune.ui.security import Guard, Roots, is_loopback, new_token

log = logging.getLogger("difftune")

# Page and API modules, each with `register(ctx)` (pages) or `router(ctx)` (API).
PAGE_MODULES = ("jobs", "run", "prepare", "datasets", "compare")
API_MODULES = ("jobs", "runs", "config", "datasets")


def build(ctx: UiContext) -> None:
    """Register every page and API route on NiceGUI's app, and the queue's start and stop."""
    import importlib

    from nicegui import app

    for name in API_MODULES:
        module = importlib.import_module(f"difftune.ui.api.{name}")
        app.include_router(module.router(ctx), prefix="/api")
    for name in PAGE_MODULES:
        importlib.import_module(f"difftune.ui.pages.{name}").register(ctx)
    _offline_docs()
    app.add_middleware(Guard, token=ctx.token)
    app.on_startup(ctx.queue.start)
    app.on_shutdown(ctx.queue.close)


def _offline_docs() -> None:
    """The OpenAPI page at /docs with Swagger UI's files served from the swagger-ui-bundle
    package (FastAPI's own /docs loads them from a CDN, which an offline machine cannot reach).
    FastAPI's CDN page is moved aside to /docs-cdn."""
    from fastapi.openapi.docs import get_swagger_ui_html
    from fastapi.responses import HTMLResponse
    from fastapi.staticfiles import StaticFiles
    from nicegui import app
    from swagger_ui_bundle import swagger_ui_path

    app.mount("/docs-assets", StaticFiles(directory=swagger_ui_path), name="docs-assets")
    app.docs_url, app.redoc_url = "/docs-cdn", "/redoc-cdn"
    # The bundle's Swagger UI (4.x) reads OpenAPI 3.0 documents; FastAPI's schema renders
    # under that version label (its nullable fields as anyOf with null, which 4.x shows).
    app.openapi_version = "3.0.3"

    @app.get("/docs", include_in_schema=False)
    def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title="difftune ui API",
                                   swagger_js_url="/docs-assets/swagger-ui-bundle.js",
                                   swagger_css_url="/docs-assets/swagger-ui.css",
                                   swagger_favicon_url="/docs-assets/favicon-32x32.png")


def make_context(roots: list[Path], token: str | None) -> UiContext:
    """The context for `roots`: the job queue's database under the first root, held by this
    app alone (ValueError when another `difftune ui` serves it: two apps starting jobs from
    one queue would run them twice)."""
    from difftune.ui.jobs.queue import JobQueue

    checked = Roots.of(roots)
    state = checked.main / ".difftune-ui"
    state.mkdir(parents=True, exist_ok=True)
    lock = hold_lock(state / "ui.lock")
    ctx = UiContext(roots=checked, queue=JobQueue(state / "jobs.sqlite", checked), token=token)
    ctx.lock = lock
    return ctx


def hold_lock(path: Path) -> IO[str]:
    """An exclusive lock on `path`, held while the returned file stays open (the OS drops it
    when the process ends, crash included, so a stale lock never blocks a restart)."""
    handle = path.open("a+", encoding="utf-8")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise ValueError(f"another difftune ui ({holder}) already serves the job queue in "
                         f"{path.parent}; use that one, stop it, or start this one with another "
                         "first --root") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()}")
    handle.flush()
    return handle


def serve(host: str, port: int, roots: list[Path]) -> int:
    """Serve the app until Ctrl-C. Off loopback a token is made and printed, and required."""
    from nicegui import ui

    token = None if is_loopback(host) else new_token()
    ctx = make_context(roots, token)
    build(ctx)
    shown = f"[{host}]" if ":" in host else host
    address = f"http://{shown}:{port}/" + (f"?token={token}" if token else "")
    print(f"difftune ui: {address}  (roots: {', '.join(map(str, ctx.roots.folders))})",
          flush=True)
    if token:
        print("every request needs this token (or 'Authorization: Bearer <token>')", flush=True)
    ui.run(host=host, port=port, reload=False, show=False, title="difftune",
           fastapi_docs={"title": "difftune ui API"}, show_welcome_message=False,
           uvicorn_logging_level="warning", favicon="🎛️", dark=None)
    sys.stdout.flush()
    return 0
