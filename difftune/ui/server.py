"""`difftune ui`: build the app (pages, API, guard, job queue) and serve it with uvicorn."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import sys
from pathlib import Path
from typing import IO

from difftune.ui.context import UiContext
from difftune.ui.limits import BodyLimit
from difftune.ui.security import Guard, Roots, is_loopback, new_token

log = logging.getLogger("difftune")

# How long a page waits for its browser to reconnect; NiceGUI derives its websocket pings from
# it (a ping every 0.8x, answered within 0.4x). Its default (3 s: pings answered within 2 s)
# drops the connection of a page whose app shares a loaded machine with a training job.
RECONNECT_S = 20.0

# Page and API modules, each with `register(ctx)` (pages) or `router(ctx)` (API).
PAGE_MODULES = ("jobs", "run", "prepare", "datasets", "compare", "lora", "rank", "sweep")
API_MODULES = ("jobs", "runs", "config", "datasets", "captioning", "lora")


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
    app.add_middleware(BodyLimit)  # inside the guard: a refused request's body is never read
    app.add_middleware(Guard, token=ctx.token, origin_token=ctx.origin_token)
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
    one queue would run them twice, or when its folder cannot be written; JobDatabaseError
    when the database cannot serve)."""
    from difftune.ui.jobs.queue import JobQueue

    checked = Roots.of(roots)
    state = checked.main / ".difftune-ui"
    try:
        state.mkdir(parents=True, exist_ok=True)
        lock = hold_lock(state / "ui.lock")
    except OSError as err:
        raise ValueError(f"cannot use {state} for the job queue ({err.strerror}); make it a "
                         "writable folder, or start with another first --root") from None
    ctx = UiContext(roots=checked, queue=JobQueue(state / "jobs.sqlite", checked), token=token)
    ctx.lock = lock
    return ctx


def check_address(host: str, port: int) -> None:
    """Raise ValueError naming the value when the app could not listen on `host`:`port` (a
    port outside 1..65535, a host that is no address here, a port in use), before anything
    starts: uvicorn would end with its own line and exit code, or hang."""
    if not 1 <= port <= 65535:
        raise ValueError(f"--port {port} is not a TCP port; give one from 1 to 65535")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # as uvicorn picks it
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host.strip("[]"), port, family=family, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as err:
        raise ValueError(_not_here(host, str(err))) from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(address)
        except OSError as err:
            if err.errno == errno.EADDRNOTAVAIL:
                raise ValueError(_not_here(host, err.strerror)) from None
            what = "is in use by another program" if err.errno == errno.EADDRINUSE else \
                f"cannot be used ({err.strerror})"
            raise ValueError(f"--port {port} on --host {host} {what}; pick another --port "
                             "(or stop what listens there)") from None


def _not_here(host: str, why: str) -> str:
    """The message for a --host that is no address of this machine."""
    return (f"--host {host!r} is not an address of this machine ({why}); give one of its IP "
            "addresses (127.0.0.1, or 0.0.0.0 for all) or a host name that resolves to one")


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
    """Serve the app until Ctrl-C. Off loopback a token is made and printed, and required; on
    loopback one is made for the requests from other web sites (which need it)."""
    check_address(host, port)
    token = None if is_loopback(host) else new_token()
    ctx = make_context(roots, token)
    ctx.origin_token = token or new_token()

    from nicegui import ui  # after the checks: a refused start is quick

    build(ctx)
    shown = f"[{host}]" if ":" in host else host
    address = f"http://{shown}:{port}/" + (f"?token={token}" if token else "")
    print(f"difftune ui: {address}  (roots: {', '.join(map(str, ctx.roots.folders))})",
          flush=True)
    if token:
        print("every request needs this token (or 'Authorization: Bearer <token>')", flush=True)
    else:
        print("requests from other web sites are refused unless they send 'Authorization: "
              f"Bearer {ctx.origin_token}'", flush=True)
    ui.run(host=host, port=port, reload=False, show=False, title="difftune",
           fastapi_docs={"title": "difftune ui API"}, show_welcome_message=False,
           uvicorn_logging_level="warning", favicon="🎛️", dark=None,
           reconnect_timeout=RECONNECT_S)
    sys.stdout.flush()
    return 0
