"""What the web app does with one LoRA file: its inspect and verify reports, and convert or
resize it beside itself. Both the /api/lora routes and the /lora page call these (as the CLI
calls `difftune.lora_tools`); each names the file by a path under the roots."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from difftune.errors import DifftuneError
from difftune.lora_tools.convert import convert
from difftune.lora_tools.inspect import inspect_file
from difftune.lora_tools.resize import resize_file
from difftune.lora_tools.verify import verify_file
from difftune.ui.security import Roots


class NotALora(ValueError):
    """The path names no LoRA file (HTTP 404)."""


class Refused(ValueError):
    """The tool refused the file or the request, with the reason (HTTP 400; 409 when the
    output exists)."""

    def __init__(self, message: str, exists: bool = False) -> None:
        super().__init__(message)
        self.exists = exists


def lora_path(roots: Roots, path: str) -> Path:
    """The LoRA file `path` names under the roots (PathOutsideRoots outside them)."""
    target = roots.resolve(path)
    if not target.is_file() or target.suffix != ".safetensors":
        raise NotALora(f"{path} is not a .safetensors file")
    return target


def _run(call: Any, *args: Any) -> Any:
    """A tool's call, its user-facing refusals turned into `Refused`."""
    try:
        return call(*args)
    except DifftuneError as err:
        raise Refused(str(err), exists="exists; pass --out" in str(err)) from None


def report(roots: Roots, path: str) -> dict[str, Any]:
    """{"inspect": ..., "verify": ...} of the LoRA file at `path`."""
    target = lora_path(roots, path)
    return {"inspect": _run(inspect_file, target).as_json(),
            "verify": _run(verify_file, target).as_json()}


def convert_file(roots: Roots, path: str, to: str) -> dict[str, Any]:
    """Convert the file to layout `to`, beside it (`<stem>-<to>.safetensors`)."""
    return _run(convert, lora_path(roots, path), to).as_json()


def resize(roots: Roots, path: str, rank: int | None, energy: float | None) -> dict[str, Any]:
    """Resize the file to `rank` or `energy`, beside it (`<stem>-r<R>` / `-e<E>`)."""
    return _run(resize_file, lora_path(roots, path), rank, energy).as_json()


def report_text(roots: Roots, path: str) -> tuple[str, str]:
    """The inspect and verify reports as the CLI prints them."""
    from difftune.verbs.lora import inspect_text, verify_text

    target = lora_path(roots, path)
    return (inspect_text(_run(inspect_file, target)),
            verify_text(_run(verify_file, target), limit=50))
