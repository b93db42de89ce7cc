"""Preparing a run over HTTP: the form's schema, presets, validation, saving and loading run files.

The page /prepare calls these same functions (`service`), so a script sees what a user sees.
Validation answers with the message `difftune check` prints; paths go through the roots.
"""

from __future__ import annotations

import re
from dataclasses import asdict
from pathlib import Path
from typing import Any

from fastapi import APIRouter, HTTPException, Query
from pydantic import BaseModel

from difftune.errors import ConfigError
from difftune.files.atomic import write_atomically
from difftune.ui import models
from difftune.ui.context import UiContext
from difftune.ui.forms import applies, presets, schema, toml_io
from difftune.ui.forms.validate import validate
from difftune.ui.jobs.clone import free_folder
from difftune.ui.jobs.paths import check_named_paths
from difftune.ui.limits import MAX_TEXT_BYTES, TooLarge, encode, read_text
from difftune.ui.security import PathOutsideRoots


class SchemaOut(BaseModel):
    """The form: its sections and fields, the fields that do not apply (with why), and the
    choices that depend on the family."""

    sections: list[schema.SectionSpec]
    hidden: dict[str, str]
    choices: dict[str, list[Any]]


class PresetInfo(BaseModel):
    """A preset as listed (its TOML from GET /config/presets/{name})."""

    name: str
    title: str
    family: str
    gib: int | None
    example: str
    savers: list[str]
    estimate_gib: float | None


class RefusalInfo(BaseModel):
    """An example and GPU size with no preset, and why."""

    example: str
    gib: int
    reason: str


class PresetsOut(BaseModel):
    """Every preset, and the example sizes that have none."""

    presets: list[PresetInfo]
    refused: list[RefusalInfo]


class PresetOut(BaseModel):
    """One preset's run file."""

    name: str
    title: str
    toml: str


class TomlIn(BaseModel):
    """A run file's text; `path` (under the roots) is where it is or will be saved, which
    relative paths in it are taken from (default: the runs folder)."""

    toml: str
    path: str | None = None


class ValidationOut(BaseModel):
    """`ok`, or `message`: what `difftune check` prints after `error: ` for the same file."""

    ok: bool
    message: str | None = None
    warnings: list[str] = []


class FormOut(BaseModel):
    """A run file as the form holds it: its values by field path, hidden fields, choices."""

    toml: str
    values: dict[str, Any]
    hidden: dict[str, str]
    choices: dict[str, list[Any]]


class SaveIn(TomlIn):
    """Save `toml` at `path`; an existing different file needs `overwrite`."""

    overwrite: bool = False


class SaveOut(BaseModel):
    """Where the file was written (absolute, and as shown: relative to its root)."""

    path: str
    shown: str
    validation: ValidationOut


class FileExists(Exception):
    """The target holds a different file and overwrite was not asked for."""


def _write_atomic(target: Path, data: bytes, shown: str) -> None:
    """Write `data` at `target` through a temporary file in its folder, renamed over it; the
    temporary file is removed when anything fails. A folder that cannot be made (a file in the
    way) or written is a ConfigError naming it."""
    folder = next((p for p in (target.parent, *target.parent.parents) if p.exists()), None)
    if folder is not None and not folder.is_dir():
        raise ConfigError(f"cannot save {shown}: {folder} is a file, not a folder; choose "
                          "another path")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(target, data)
    except OSError as err:
        raise ConfigError(f"cannot save {shown}: {err.strerror or err} "
                          f"({err.filename or target}); choose another path") from None


def _jsonable(values: dict[str, Any]) -> dict[str, Any]:
    """Form values as JSON (dates and other TOML-only types as text)."""
    import json

    return json.loads(json.dumps(values, default=str))


class Service:
    """What the routes and the page do, on the app's roots."""

    def __init__(self, ctx: UiContext) -> None:
        self.ctx = ctx

    def place(self, path: str | None) -> tuple[Path, str]:
        """The folder relative paths are taken from and the name the CLI would show."""
        if path is None:
            return self.ctx.runs_dir, "run.toml"
        target = self.ctx.roots.resolve(path)
        return target.parent, str(target)

    def validate(self, text: str, path: str | None = None) -> ValidationOut:
        """Validate `text` as `difftune check` would the file at `path`, once every path it
        names is found under the roots (validation reads model files' headers and asks
        whether files exist: never of a file outside them)."""
        base, source = self.place(path)
        outside = self.outside(text, base, source)
        if outside is not None:
            return ValidationOut(ok=False, message=outside)
        result = validate(text, base, source)
        return ValidationOut(ok=result.ok, message=result.message, warnings=result.warnings)

    def outside(self, text: str, base: Path, source: str) -> str | None:
        """The problem line of the first path `text` names outside the roots (or in the app's
        own folder), worded as validation words a field's problem, or None (also for text
        that is not TOML: validation says why)."""
        try:
            data = toml_io.plain(toml_io.parse(text, source))
        except ConfigError:
            return None
        try:
            check_named_paths(data, base, self.ctx.roots, lambda field, _: "  - " + re.sub(
                r"\.(\d+)(?=\.|$)", r"[\1]", field))
        except PathOutsideRoots as err:
            return f"{source}: a path outside the folders this app serves:\n{err}"
        return None

    def form(self, text: str) -> FormOut:
        """The form's view of `text` (bad TOML, or text with no UTF-8 form, raises
        ConfigError)."""
        encode(text, "the run file")
        values = _jsonable(toml_io.values(toml_io.parse(text)))
        return FormOut(toml=text, values=values, hidden=applies.hidden(values),
                       choices=applies.choices(values))

    def save(self, text: str, path: str, overwrite: bool = False) -> SaveOut:
        """Write `text` at `path` (atomically); refuse to replace a different file unless
        `overwrite`, and a file that is not a run file (not UTF-8 text, or too large) at all.
        Bad TOML, text with no UTF-8 form and a path that cannot hold a file are refused
        (ConfigError); config problems are reported, not refused, so a draft can be kept."""
        data = encode(text, path)
        if len(data) > MAX_TEXT_BYTES:
            raise TooLarge(f"{path}: the text is {len(data)} bytes, more than a run file may be "
                           f"({MAX_TEXT_BYTES} bytes); shorten it")
        toml_io.parse(text, path)
        target = self.ctx.roots.resolve(path, write=True)  # never the app's own files
        shown = self.ctx.roots.relative(target)
        if target.is_dir():
            raise ConfigError(f"{path} is a folder; give the path of a .toml file in it")
        if target.exists():
            if not target.is_file():
                raise ConfigError(f"{shown} is not a regular file; choose another path")
            # Only a run file may be replaced: a file that is not one (an image, a file that
            # is not UTF-8) is refused even with overwrite.
            if read_text(target, "run file") != text and not overwrite:
                raise FileExists(f"{shown} already exists and differs; choose another path or "
                                 "save with overwrite")
        _write_atomic(target, data, shown)
        return SaveOut(path=str(target), shown=shown, validation=self.validate(text, str(target)))

    def load(self, path: str) -> FormOut:
        """The run file at `path` as the form holds it (TooLarge past MAX_TEXT_BYTES, unread;
        ConfigError when it is not UTF-8 text)."""
        target = self.ctx.roots.resolve(path)
        if not target.is_file():
            raise FileNotFoundError(f"{self.ctx.roots.relative(target)} is not a file; give the "
                                    "path of a .toml run file")
        return self.form(read_text(target, "run file"))

    def default_path(self, text: str) -> Path:
        """Where a new run file goes: `<runs>/<save.name or "run">/run.toml`, or in
        `<name>-2`, `-3`, ... when that folder exists or a job uses it: a new run never
        lands in an existing run's folder."""
        try:
            name = toml_io.values(toml_io.parse(text)).get("save.name") or "run"
        except ConfigError:
            name = "run"
        return free_folder(self.ctx.runs_dir / str(name), self.ctx.queue.run_dirs()) / "run.toml"


def _http(err: Exception) -> HTTPException:
    """An HTTP error carrying the message as the CLI words it."""
    if isinstance(err, PathOutsideRoots):
        return HTTPException(403, str(err))
    if isinstance(err, FileExists):
        return HTTPException(409, str(err))
    if isinstance(err, TooLarge):
        return HTTPException(413, str(err))
    if isinstance(err, (FileNotFoundError, KeyError)):
        return HTTPException(404, str(err.args[0]) if err.args else "not found")
    return HTTPException(422, str(err))


def router(ctx: UiContext) -> APIRouter:
    """The /config routes."""
    api = APIRouter(prefix="/config", tags=["config"])
    service = Service(ctx)

    @api.get("/schema", response_model=SchemaOut, summary="The run form's sections and fields")
    def get_schema(family: str = Query(presets.DEFAULT_FAMILY), variant: str | None = None,
                   adapter: str = Query("lora")) -> SchemaOut:
        """Every section and field (kind, default, choices, bounds, help) from the config
        models, and the fields that do not apply to this family, variant and adapter type."""
        values = {"model.family": family, "adapter.type": adapter}
        if variant:
            values["model.variant"] = variant
        return SchemaOut(sections=schema.sections(), hidden=applies.hidden(values),
                         choices=applies.choices(values))

    @api.get("/presets", response_model=PresetsOut, summary="Presets per example and GPU size")
    def list_presets() -> PresetsOut:
        """The presets (24/16/12 GiB per example, the tiny CPU demo) and the sizes refused."""
        made, refused = presets.build()
        return PresetsOut(
            presets=[PresetInfo(**{k: v for k, v in asdict(p).items() if k != "toml"})
                     for p in made],
            refused=[RefusalInfo(**asdict(r)) for r in refused])

    @api.get("/presets/{name}", response_model=PresetOut, summary="One preset's run file")
    def get_preset(name: str) -> PresetOut:
        """The preset's TOML text (404 for an unknown name)."""
        try:
            preset = presets.get(name)
        except KeyError:
            raise HTTPException(404, f"no preset {name!r}; GET /api/config/presets lists them") \
                from None
        return PresetOut(name=preset.name, title=preset.title, toml=preset.toml)

    @api.get("/models", response_model=list[models.Found],
             summary="Model folders and files under the roots, each's family")
    def get_models() -> list[models.Found]:
        """Diffusers folders and .safetensors files under the roots (bounded scan), each
        recognised from its model_index.json or its tensors' names, never its file name."""
        return models.scan(ctx.roots)

    @api.post("/validate", response_model=ValidationOut, summary="Validate a run file")
    def post_validate(body: TomlIn) -> ValidationOut:
        """ok, or the message `difftune check` prints for the same file."""
        try:
            return service.validate(body.toml, body.path)
        except PathOutsideRoots as err:
            raise _http(err) from None

    @api.post("/form", response_model=FormOut, summary="A run file as the form holds it")
    def post_form(body: TomlIn) -> FormOut:
        """Values by field path, the fields that do not apply, and family-dependent choices."""
        try:
            return service.form(body.toml)
        except ConfigError as err:
            raise _http(err) from None

    @api.post("/save", response_model=SaveOut, summary="Save a run file under the roots")
    def post_save(body: SaveIn) -> SaveOut:
        """Write the text as is (byte for byte); 409 when a different file is there and
        `overwrite` is false; 403 outside the roots; 413 for text over 1 MiB; 422 for text
        with no UTF-8 form, a target that is not a run file, or a folder that cannot hold it."""
        try:
            return service.save(body.toml, body.path or str(service.default_path(body.toml)),
                                body.overwrite)
        except (PathOutsideRoots, FileExists, ConfigError, OSError) as err:
            raise _http(err) from None

    @api.get("/load", response_model=FormOut, summary="Read a run file under the roots")
    def get_load(path: str) -> FormOut:
        """The file's text and its form values (404 missing, 403 outside the roots, 413 over
        1 MiB, 422 not UTF-8 text)."""
        try:
            return service.load(path)
        except (PathOutsideRoots, ConfigError, OSError) as err:
            raise _http(err) from None

    return api
