"""Datasets in the UI: browse a folder's images and captions, edit a caption, and report what
training would make of a folder or a run file (buckets, skipped images, caption statistics).

Everything goes through difftune's own data code (`difftune.data.discover`): the images listed
are the ones `list_images` finds, captions are read by `read_caption`, and the report's buckets
and skip reasons are those `data.build` gives, which are what `difftune check` prints.
"""

from __future__ import annotations

import io
import logging
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from difftune.files.atomic import write_atomically
from difftune.ui.dataset_media import is_video, media, video_facts
from difftune.ui.runs import searched
from difftune.ui.security import PathOutsideRoots, Roots

DEFAULT_CAPTION_EXT = ".txt"
# The extensions of a caption the app writes or reads: text files training takes as captions.
# Any other (an image's, a run file's) could name a file that is not a caption: `.png` would
# replace the image itself.
CAPTION_EXTENSIONS = (".txt", ".caption", ".cap", ".tags", ".text")
# The side granularity of most families' buckets; a report of a bare folder uses it unless a
# family is named (a run file always uses its own family's).
DEFAULT_BUCKET_STEP = 16
# The tag-style rule: a caption is a list of tags when every piece between separators is a
# short phrase (at most TAG_WORDS words) that ends no sentence; otherwise it is prose, and its
# commas are punctuation, not tag boundaries.
TAG_WORDS = 4


def _ext(caption_ext: str) -> str:
    """A caption extension with its dot; ValueError naming `caption_ext` for one that is not
    a caption's (CAPTION_EXTENSIONS, any case)."""
    ext = caption_ext if caption_ext.startswith(".") else f".{caption_ext}"
    if ext.lower() not in CAPTION_EXTENSIONS:
        shown = caption_ext if len(caption_ext) <= 20 else caption_ext[:20] + "..."
        raise ValueError(f"caption_ext {shown!r} is not a caption extension; use one of "
                         f"{', '.join(CAPTION_EXTENSIONS)} (captions in other files are "
                         "edited outside the app)")
    return ext


def caption_path(image: Path, caption_ext: str = DEFAULT_CAPTION_EXT) -> Path:
    """The same-stem caption file of `image` (what training reads)."""
    return Path(image).with_suffix(_ext(caption_ext))


# --- browsing ------------------------------------------------------------------------------------

@dataclass
class DatasetImage:
    """One image of a browsed folder: its caption (None when it has no caption file), the
    caption file's path, its header size and its file size; `error` when the caption cannot be
    read or the path lies outside what the app serves."""

    image: str
    caption: str | None
    caption_file: str
    width: int | None = None
    height: int | None = None
    bytes: int = 0
    error: str | None = None
    # A video (shown as its first frame): its frame count and rate; None for an image.
    frames: int | None = None
    fps: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)


@dataclass
class BrowsePage:
    """A page of a folder's images (`offset`, `limit`) and how many there are in all."""

    folder: str
    total: int
    offset: int
    limit: int
    items: list[DatasetImage] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)


def _header_size(path: Path) -> tuple[int | None, int | None]:
    """(width, height) from the image header alone (cheap: no decode); Nones if unreadable."""
    from PIL import Image

    try:
        with Image.open(path) as img:
            return img.size
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError):
        # an unreadable file shows without a size; the report says why
        return None, None


def _entry(image: Path, caption_ext: str, inside: Callable[[Path], bool] | None
           ) -> DatasetImage:
    """The browse entry of one image."""
    from difftune.data.discover import read_caption
    from difftune.errors import DataError

    cap = caption_path(image, caption_ext)
    entry = DatasetImage(str(image), None, str(cap))
    if inside is not None and not (inside(image) and inside(cap)):
        entry.error = "the image or its caption file links outside the folders this app serves"
        return entry
    entry.bytes = image.stat().st_size
    if is_video(image):
        video_facts(entry, image)
    else:
        entry.width, entry.height = _header_size(image)
    try:
        entry.caption = read_caption(image, caption_ext)
    except DataError as err:
        entry.error = str(err)
    return entry


def browse(folder: Path, offset: int = 0, limit: int = 48,
           caption_ext: str = DEFAULT_CAPTION_EXT, recursive: bool = True,
           inside: Callable[[Path], bool] | None = None) -> BrowsePage:
    """A page of the images training would find in `folder`, with their captions.

    `inside(path)` says whether a path (symbolic links followed) is one the caller may read;
    an entry failing it is listed without its caption or size.
    """
    from difftune.data.discover import list_images

    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"{folder} is not a folder; pick a folder of images")
    images = list_images(folder, recursive, media())
    offset, limit = max(0, offset), max(1, limit)
    page = images[offset:offset + limit]
    return BrowsePage(str(folder), len(images), offset, limit,
                      [_entry(p, caption_ext, inside) for p in page])


def image_folders(roots: list[Path], depth: int = 4, limit: int = 200) -> list[dict[str, Any]]:
    """Folders under `roots` (down to `depth` levels) that directly hold images, with their
    image count: the choices of the dataset page's folder picker. Hidden and linked folders,
    caches and run insides (samples, checkpoints) are left out."""
    from difftune.data.discover import list_images

    found: list[dict[str, Any]] = []

    def walk(folder: Path, left: int) -> None:
        if len(found) >= limit:
            return
        try:
            children = sorted(folder.iterdir())
        except OSError:
            return
        count = len(list_images(folder, False, media()))
        if count:
            found.append({"path": str(folder), "images": count})
        if left <= 0:
            return
        for child in children:
            if searched(child):
                walk(child, left - 1)

    for root in roots:
        walk(Path(root), depth)
    return found


# --- editing ---------------------------------------------------------------------------------------

def write_caption(image: Path, text: str, caption_ext: str = DEFAULT_CAPTION_EXT) -> Path:
    """Write `text` (stripped, UTF-8) as `image`'s caption file and return that file.

    Only the caption file changes: it is written to a temporary file beside it and renamed
    over it, so a reader (a training run) sees the old caption or the new one, never half.
    Its permission bits are kept when it existed. Raises ValueError when `image` is not an
    image file training would read.
    """
    from difftune.data.discover import IMAGE_EXTENSIONS

    image = Path(image)
    if image.suffix.lower() not in IMAGE_EXTENSIONS or not image.is_file():
        raise ValueError(f"{image} is not an image file ({'/'.join(sorted(IMAGE_EXTENSIONS))}); "
                         "captions belong to images")
    target = caption_path(image, caption_ext)
    try:
        mode = target.stat().st_mode & 0o777
    except FileNotFoundError:
        mode = 0o644
    write_atomic(target, text.strip().encode("utf-8"), mode)
    return target


def write_atomic(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Replace `path` by `data` with permission bits `mode`: a reader sees the old bytes or the
    new, never half (files/atomic.py)."""
    write_atomically(path, data, mode)


def under(roots: Roots) -> Callable[[Path], bool]:
    """A predicate: whether a path (symbolic links followed) lies under `roots`."""
    return roots.holds


def edit_caption(roots: Roots, image: str | Path, text: str,
                 caption_ext: str = DEFAULT_CAPTION_EXT) -> Path:
    """`write_caption` for a request: the image and the caption file it would replace must
    both lie under `roots`, outside the app's own folder (PathOutsideRoots otherwise: a
    caption file that is a link leading outside is refused, not followed); `caption_ext`
    must be a caption's (ValueError)."""
    resolved = roots.resolve(image, write=True)
    roots.resolve(caption_path(resolved, caption_ext), write=True)
    return write_caption(resolved, text, caption_ext)


# --- thumbnails ------------------------------------------------------------------------------------

def thumbnail(image: Path, side: int = 256) -> bytes:
    """A JPEG of `image` (a video's first frame) at most `side` pixels on its longer side
    (EXIF orientation applied, transparency over white, as training decodes it). Raises ValueError for an unreadable
    image, with the reason `check` would give."""
    from difftune.data.images import load_rgb, probe_image
    from difftune.data.video import first_frame

    if is_video(Path(image)):
        img = first_frame(Path(image))  # a video shows as its first frame
    else:
        probe_image(Path(image))  # the reason, worded as check words it
        img = load_rgb(Path(image))
    img.thumbnail((side, side))
    out = io.BytesIO()
    img.save(out, "JPEG", quality=85)
    return out.getvalue()


# --- report ----------------------------------------------------------------------------------------

@dataclass
class DatasetReport:
    """What training would make of a dataset.

    `buckets`: one row per (resolution, bucket "WxH") with its image count; `skipped`: the
    images left out and the reason `check` prints; `missing_captions`: images trained with the
    default caption; `tags`: (tag, count) most frequent first, split on each subset's
    `caption_separator`, counted over tag-style captions only (`is_tag_style`);
    `caption_styles`: how many captions are tag-style and how many prose; `lengths`: caption
    length in words -> images; `summary`: the counts
    `DataSet.summary()` gives; `error`: the message `check` would stop with (then the rest
    is empty).
    """

    source: str
    buckets: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[dict[str, str]] = field(default_factory=list)
    missing_captions: list[str] = field(default_factory=list)
    tags: list[dict[str, Any]] = field(default_factory=list)
    lengths: list[dict[str, int]] = field(default_factory=list)
    caption_styles: dict[str, int] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)


def folder_datasets(folder: Path, resolution: int) -> list[Any]:
    """The `[[datasets]]` config of a bare folder at `resolution` (otherwise the defaults a
    run file gets, with the side limits widened to hold `resolution`)."""
    from difftune.config import DatasetConfig

    return [DatasetConfig(path=Path(folder), resolution=resolution,
                          min_side=min(256, resolution), max_side=max(2048, resolution))]


def config_datasets(path: Path, roots: Roots | None = None) -> tuple[list[Any], Any]:
    """The datasets of a run file and its family's spec (`load_checked`)."""
    from difftune.families.registry import spec
    from difftune.ui.jobs.paths import load_checked

    cfg = load_checked(path, roots)
    return cfg.datasets, spec(cfg.model.family, cfg.model.variant)


def report(source: Path, resolution: int = 1024, family: str | None = None,
           roots: Roots | None = None) -> DatasetReport:
    """The report of a folder of images (bucketed at `resolution` with `family`'s bucket
    step) or of a run file (.toml: its datasets as configured). Raises ValueError for a
    resolution the config refuses, ConfigError for a run file `train` would refuse, and
    PathOutsideRoots for a dataset folder or file (links followed) outside `roots`."""
    from pydantic import ValidationError

    from difftune.data.clips import clip_rule
    from difftune.data.discover import build
    from difftune.errors import DataError
    from difftune.families.registry import spec

    source = Path(source)
    if source.is_file():
        datasets, facts = config_datasets(source, roots)
    else:
        try:
            datasets = folder_datasets(source, resolution)
        except ValidationError as err:
            raise ValueError("; ".join(e["msg"] for e in err.errors())) from None
        facts = spec(family) if family else None
    step = facts.bucket_step if facts is not None else DEFAULT_BUCKET_STEP
    if roots is not None:
        check_sources(datasets, roots)
    out = DatasetReport(str(source))
    quiet = logging.getLogger("difftune.data")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # each skip is in the report; not a log line per request
    try:
        data = build(datasets, step, clips=clip_rule(facts) if facts is not None else None)
    except DataError as err:
        out.error = str(err)
        return out
    finally:
        quiet.setLevel(level)
    _fill(out, data)
    return out


def check_sources(datasets: list[Any], roots: Roots) -> None:
    """Refuse (PathOutsideRoots naming it) a dataset folder, or a file in one that training
    would read (image, caption, control, mask), that lies outside `roots` (and the demo data
    shipped with difftune), links followed: the report reads them all, and would show what
    an outside caption file holds."""
    from difftune.data.discover import list_images
    from difftune.ui.jobs.paths import config_paths, reading

    MEDIA = media()

    roots = reading(roots)
    for name, folder in config_paths(datasets, "datasets"):
        try:
            roots.resolve(folder)
        except PathOutsideRoots as err:
            raise PathOutsideRoots(f"{name}: {err}") from None
    for dataset in datasets:
        for sub in dataset.subsets:
            ext = sub.caption_ext if sub.caption_ext.startswith(".") else f".{sub.caption_ext}"
            masks = [sub.mask_path] if sub.mask_path is not None else []
            for folder in (sub.path, *sub.control_path, *masks):
                images = list_images(folder, sub.recursive, MEDIA) if folder.is_dir() else []
                for path in (p for image in images for p in (image, image.with_suffix(ext))):
                    roots.resolve(path)


def is_tag_style(caption: str, separator: str = ",") -> bool:
    """Whether `caption` is a list of tags ("1girl, red hair, smiling"), not prose ("A woman
    with red hair, smiling at the camera."): every non-empty piece between separators is at
    most `TAG_WORDS` words and ends no sentence (no '.', '!' or '?' at its end or followed by
    a space inside it). An empty caption is neither."""
    pieces = [p.strip() for p in caption.split(separator) if p.strip()]
    return bool(pieces) and all(
        len(p.split()) <= TAG_WORDS and p[-1] not in ".!?" and not re.search(r"[.!?]\s", p)
        for p in pieces)


def _fill(out: DatasetReport, data: Any) -> None:
    """The report's tables from a built `DataSet`."""
    per_side = Counter((it.resolution, it.bucket_name) for it in data.items)
    out.buckets = [{"resolution": r, "bucket": b, "images": n}
                   for (r, b), n in sorted(per_side.items())]
    out.skipped = [{"path": str(p), "reason": why} for p, why in data.skipped]
    out.missing_captions = [str(p) for p in data.missing_captions]
    out.summary = data.summary()
    missing = set(data.missing_captions)
    seen: dict[Path, Any] = {}
    for it in data.items:
        if it.path not in missing:
            seen.setdefault(it.path, it)
    tags: Counter[str] = Counter()
    lengths: Counter[int] = Counter()
    styles: Counter[str] = Counter({"tags": 0, "prose": 0})
    for it in seen.values():
        if is_tag_style(it.caption, it.augment.separator):
            styles["tags"] += 1
            tags.update(t.strip() for t in it.caption.split(it.augment.separator) if t.strip())
        elif it.caption.strip():
            styles["prose"] += 1
        lengths[len(it.caption.split())] += 1
    out.caption_styles = dict(styles)
    ranked = sorted(tags.items(), key=lambda kv: (-kv[1], kv[0]))
    out.tags = [{"tag": t, "count": n} for t, n in ranked]
    out.lengths = [{"words": w, "images": n} for w, n in sorted(lengths.items())]
