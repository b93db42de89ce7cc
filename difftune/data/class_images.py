"""Prior preservation's class images: generated once by the base model, reused afterwards.

A regularization subset with `class_prompt` and `class_images = N` whose folder holds fewer
than N images gets the missing ones from the base model (through the family's pipeline, before
the adapter is attached), each seeded by its own index, written as `class_NNNNNN.png` with a
caption file holding the class prompt. `difftune_class_images.json` in the folder (the
manifest) records the model, prompt, size, steps, guidance and every file it wrote, so the next
run reuses them. Rules, so nothing a user made is lost:
  - a user's own images in the folder count towards N and are never touched;
  - a file is written only under a name no file has (existing names are skipped), whole or
    not at all (through a temporary file), except that an image the manifest names which
    cannot be read (a kill cut it short) is made again;
  - when the manifest's settings differ from the config's, the run is refused: the user
    deletes the files the manifest names (and the manifest) or points `path` elsewhere.
"""

from __future__ import annotations

import io
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from difftune.data.discover import IMAGE_EXTENSIONS
from difftune.errors import ConfigError, NonFiniteError
from difftune.files.atomic import leftovers, write_atomically

if TYPE_CHECKING:
    from difftune.config import RunConfig
    from difftune.families.base import Components, Family
    from difftune.precision.policy import PrecisionPolicy

log = logging.getLogger("difftune")

MANIFEST = "difftune_class_images.json"


@dataclass(frozen=True)
class Settings:
    """What a class image depends on (besides its index): recorded in the manifest."""

    model: str
    prompt: str
    size: int
    steps: int
    guidance: float


@dataclass(frozen=True)
class Need:
    """One subset's class images: where, how many exist, how many are missing."""

    where: str  # e.g. datasets[0].subsets[1]
    folder: Path
    settings: Settings
    wanted: int
    existing: int

    @property
    def missing(self) -> int:
        """How many images generation adds."""
        return max(0, self.wanted - self.existing)


def model_fingerprint(cfg: "RunConfig") -> str:
    """The base model as the config names it (family, variant, source)."""
    m = cfg.model
    return json.dumps({"family": m.family, "variant": m.variant, "flavor": m.flavor,
                       "path": str(m.path) if m.path else None}, sort_keys=True)


def needs(cfg: "RunConfig") -> list[Need]:
    """Every subset asking for class images, with what its folder holds (no model needed)."""
    out = []
    for d, ds in enumerate(cfg.datasets):
        for s, sub in enumerate(ds.subsets):
            if sub.class_images:
                settings = Settings(model_fingerprint(cfg), sub.class_prompt.strip(),
                                    max(ds.resolutions), sub.class_steps, sub.class_guidance)
                out.append(Need(f"datasets[{d}].subsets[{s}]", Path(sub.path), settings,
                                sub.class_images, _count_images(Path(sub.path))))
    return out


def describe(cfg: "RunConfig") -> list[str]:
    """`difftune check`'s lines: class images present and to be generated per subset."""
    return [f"class images of {n.where}: {n.existing} in {n.folder}, "
            f"{n.missing} would be generated (prompt \"{n.settings.prompt}\")"
            for n in needs(cfg)]


def make_folders(cfg: "RunConfig") -> None:
    """Create missing class-image folders, so discovery finds them (empty) before generation.
    Also refuses a manifest that disagrees with the config, before any model loads."""
    for need in needs(cfg):
        need.folder.mkdir(parents=True, exist_ok=True)
        _check_manifest(need, _read_manifest(need.folder))


def generate(cfg: "RunConfig", family: "Family", comps: "Components",
             policy: "PrecisionPolicy", show_progress: bool = True) -> int:
    """Generate every missing class image with the base model; returns how many were made."""
    todo = [n for n in needs(cfg) if n.missing]
    if not todo:
        return 0
    from difftune.cache import MemoryStore
    from difftune.cache.sources import TextSource
    from difftune.families.common.text import EncodeOptions
    from difftune.sample.runner import SampleRunner
    from difftune.train.rng import GlobalRngs

    options = EncodeOptions(t5_mask=cfg.model.t5_mask, clip_skip=cfg.model.clip_skip)
    texts = TextSource(family, comps, MemoryStore(), options)
    made = 0
    states = GlobalRngs.capture()  # generation must not move the run's random streams
    try:
        for need in todo:
            runner = SampleRunner(family, comps, texts, cfg.sample, need.folder,
                                  (need.settings.size, need.settings.size), policy)
            made += _fill(need, runner, show_progress)
    finally:
        states.restore()
    return made


def _fill(need: Need, runner: Any, show_progress: bool) -> int:
    """Write `need.missing` images into its folder, recording each in the manifest as soon as
    it is written (an interrupted run resumes where it stopped). Each file is written whole or
    not at all (`write_atomically`); an unreadable image the manifest names (left by a kill
    before files were written so) is made again under its own name and seed."""
    from difftune.sample.prompts import PromptSpec

    s = need.settings
    manifest = _read_manifest(need.folder) or {"settings": asdict(s), "files": {}}
    files: dict[str, int] = manifest["files"]
    for stale in leftovers(need.folder, "class_*"):
        stale.unlink(missing_ok=True)
    again = sorted(i for n, i in files.items() if _broken(need.folder / n))
    index = max(files.values(), default=-1) + 1
    log.info("generating %d class image(s) for %s: \"%s\"", need.missing, need.where, s.prompt)
    for _ in tqdm(range(need.missing), desc=f"class images {need.where}",
                  disable=not show_progress, leave=False):
        if again:
            number = again.pop(0)
        else:
            while (need.folder / f"class_{index:06d}.png").exists() or \
                    (need.folder / f"class_{index:06d}.txt").exists():
                index += 1  # a user's file of that name stays as it is
            number, index = index, index + 1
        spec = PromptSpec(s.prompt, "", s.size, s.size, s.steps, number, s.guidance,
                          runner.default.cfg)
        name = f"class_{number:06d}"
        write_atomically(need.folder / f"{name}.txt", (s.prompt + "\n").encode("utf-8"))
        png = io.BytesIO()
        _class_image(need, runner, spec).save(png, format="PNG")
        write_atomically(need.folder / f"{name}.png", png.getvalue())
        files[f"{name}.png"] = number
        _write_manifest(need.folder, manifest)
    return need.missing


# A whole PNG starts with its signature and ends with the IEND chunk (length 0, type, CRC).
_PNG_START = b"\x89PNG\r\n\x1a\n"
_PNG_END = b"\x00\x00\x00\x00IEND\xaeB`\x82"


def _class_image(need: Need, runner: Any, spec: Any) -> Any:
    """One class image; a NaN one stops the run (a regularization set cannot do without it)."""
    from difftune.sample.runner import NonFiniteSample

    try:
        return runner.generate(spec)
    except NonFiniteSample as err:
        raise NonFiniteError(f"{need.where}: class image {spec.seed} of {err}; the base model "
                             "gives no image at these settings: change class_steps or "
                             "class_guidance, or the precision settings") from None


def _broken(path: Path) -> bool:
    """Whether a generated PNG is there but cut short (a kill while it was written): checked
    by its first and last bytes, which costs two small reads where decoding every class
    image at every start would cost seconds."""
    if not path.is_file():
        return False
    try:
        with path.open("rb") as f:
            start = f.read(len(_PNG_START))
            f.seek(max(0, path.stat().st_size - len(_PNG_END)))
            return start != _PNG_START or f.read() != _PNG_END
    except OSError:
        return True


def _count_images(folder: Path) -> int:
    """Images directly in `folder` (0 when it does not exist), less the generated ones the
    manifest names that cannot be read: those are made again."""
    if not folder.is_dir():
        return 0
    manifest = _read_manifest(folder)
    ours = set(manifest["files"]) if manifest else set()
    return sum(1 for p in folder.iterdir() if p.suffix.lower() in IMAGE_EXTENSIONS
               and p.is_file() and not (p.name in ours and _broken(p)))


def _read_manifest(folder: Path) -> dict[str, Any] | None:
    path = folder / MANIFEST
    if not path.is_file():
        return None
    fix = "delete it and the class_*.png files it named, or point the subset's path elsewhere"
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ConfigError(f"{path} cannot be read ({err}); {fix}") from None
    problem = _manifest_problem(manifest)
    if problem:
        raise ConfigError(f"{path} is not a class-image manifest difftune wrote ({problem}); "
                          f"{fix}")
    return manifest


def _manifest_problem(manifest: Any) -> str | None:
    """What makes a parsed manifest unusable, or None: it must be an object whose `settings`
    is an object and whose `files` maps file names to seeds (whole numbers)."""
    if not isinstance(manifest, dict):
        return f"it holds a JSON {type(manifest).__name__}, not an object"
    for key in ("settings", "files"):
        if not isinstance(manifest.get(key), dict):
            return f"its \"{key}\" is {type(manifest.get(key)).__name__}, not an object"
    for name, seed in manifest["files"].items():
        if type(seed) is not int or Path(name).name != name:
            return f"its \"files\" entry {name!r}: {seed!r} is not a file name and a seed"
    return None


def _write_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    write_atomically(folder / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())


def _check_manifest(need: Need, manifest: dict[str, Any] | None) -> None:
    """Refuse class images made with other settings than the config's (never mixed, never
    deleted by difftune)."""
    if manifest is None:
        return
    old, new = manifest.get("settings", {}), asdict(need.settings)
    diff = [k for k in new if old.get(k) != new[k]]
    if diff:
        raise ConfigError(
            f"{need.where}: the class images in {need.folder} were generated with other "
            f"settings ({', '.join(f'{k}: {old.get(k)!r} now {new[k]!r}' for k in diff)}); "
            f"delete the files {need.folder / MANIFEST} names (and it), or set the subset's "
            "path to another folder, or change class_prompt/class_steps/class_guidance back")
