"""Video-clip figures on the tiny Wan flavor, each against a baseline measured in the same run.

    python bench/clips.py [--videos 6] [--frames 48] [--rounds 3] [--long 1800]

(a) fill: difftune's latent-cache fill of every clip (PyAV decode streamed and resampled
    from 24 to 16 fps, resize, VAE, disk entry) against a bare loop that decodes the same
    frames with PyAV, resizes them with Pillow and encodes them with the same VAE, no cache.
    The two alternate clip by clip (the machine's load falls on both alike). Clips per second
    for both, and each one's time a clip outside the VAE (timed inside both); goal: within
    10%.
(b) memory: how far the peak host memory (VmHWM, reset before the fill) rises above the memory
    before it while filling the cache with the clips of a short video and of a long one
    (`--long` frames; the second clip at its end), each in a fresh process, beside a loop that
    holds the long video's decoded frames. Streaming: difftune's rise must not grow with the
    video's length.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from PIL import Image

from difftune.config import RunConfig, parse_config
from difftune.data.items import Item
from difftune.data.buckets import cover_size
from difftune.data.images import crop_box
from difftune.train.setup import fill_caches, prepare

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.videos import write_video  # noqa: E402

from cache import _timed  # noqa: E402 (bench/cache.py, beside this script)


def config(data: Path, out: Path, clips: str = "chunks", count: int = 2) -> RunConfig:
    """A tiny Wan run over `data`: 9-frame clips at 16 fps, latents cached on disk."""
    return parse_config({
        "model": {"flavor": "tiny", "family": "wan"},
        "adapter": {"rank": 4},
        "datasets": [{"path": str(data), "resolution": 128, "min_side": 64, "max_side": 256,
                      "frames": [9], "clips": clips, "clip_count": count}],
        "cache": {"latents": "disk", "text": "memory", "dir": str(out / "cache")},
        "train": {"steps": 1, "batch_size": 1, "device": "cpu"},
        "sample": {"at_end": False},
        "save": {"dir": str(out), "overwrite": True},
    }, out)


def bare_clip(run: object, item: Item, encode: Callable) -> None:
    """Decode, resize and encode one clip with PyAV, Pillow and the VAE alone (no cache)."""
    import av

    clip = item.clip
    assert clip is not None
    wanted = clip.source_frames()
    box = crop_box(item.size, item.bucket, "center", None)  # type: ignore[arg-type]
    size = cover_size(item.size, item.bucket)
    frames = []
    with av.open(str(item.path)) as video:
        for n, frame in enumerate(video.decode(video=0)):
            while len(frames) < len(wanted) and wanted[len(frames)] == n:
                img = frame.to_image().resize(size, Image.Resampling.LANCZOS).crop(box)
                frames.append(torch.from_numpy(np.asarray(img).copy()))
            if len(frames) == len(wanted):
                break
    pixels = torch.stack(frames).permute(3, 0, 1, 2).contiguous().float() / 127.5 - 1.0
    with torch.no_grad():
        encode(run.comps, pixels[None])  # type: ignore[attr-defined]


def interleaved(ours_cfg: RunConfig, bare_cfg: RunConfig) -> tuple[float, ...]:
    """Seconds of difftune's fill (one clip at a time into an empty disk cache: keys, streamed
    decode, VAE, entry) and of the bare loop, alternating clip by clip so that the machine's
    load falls on both alike; then the seconds of each inside the VAE. Returns (ours, bare,
    ours in the VAE, bare in the VAE, clips)."""
    ours, bare = prepare(ours_cfg, show_progress=False), prepare(bare_cfg, show_progress=False)
    for run in (ours, bare):  # warm-up, not timed: each VAE's first call, PyAV's import
        bare_clip(run, run.data.items[0], run.family.encode_clips)
    vae = [[0.0], [0.0]]
    ours.family.encode_clips = _timed(ours.family.encode_clips, vae[0])  # type: ignore
    encode = _timed(bare.family.encode_clips, vae[1])
    spent = [0.0, 0.0]
    for i, item in enumerate(ours.data.items):
        start = time.perf_counter()
        ours.latents.fill(share=lambda wanted, i=i: [w for w in wanted if w[0] == i])
        spent[0] += time.perf_counter() - start
        start = time.perf_counter()
        bare_clip(bare, item, encode)
        spent[1] += time.perf_counter() - start
    return spent[0], spent[1], vae[0][0], vae[1][0], len(ours.data.items)


def throughput(folder: Path, videos: int, frames: int, rounds: int) -> dict[str, float]:
    """Clips per second of difftune's fill and of the bare loop, and each one's milliseconds
    a clip outside the VAE (decoding, resizing, and difftune's keys and disk entries);
    medians of `rounds`, the two alternating clip by clip."""
    data = folder / "data"
    data.mkdir()
    for i in range(videos):
        write_video(data / f"v{i}.mp4", frames, fps=24, width=160, height=120,
                    caption=f"clip {i}")
    runs = [interleaved(config(data, folder / f"run{r}"), config(data, folder / f"bare{r}"))
            for r in range(rounds)]
    ours, bare, ours_vae, bare_vae, count = (statistics.median(x) for x in zip(*runs))
    return {"clips": count, "difftune_clips_per_s": count / ours,
            "bare_clips_per_s": count / bare, "ratio": ours / bare,
            "ratio_per_round": [r[0] / r[1] for r in runs],  # type: ignore[dict-item]
            "difftune_ms_per_clip_outside_vae": 1000 * (ours - ours_vae) / count,
            "bare_ms_per_clip_outside_vae": 1000 * (bare - bare_vae) / count}


def _peak_child(data: str, out: str, whole: str) -> None:
    """In a fresh process: fill the cache (or, `whole`, decode every frame first), print how
    far the peak RSS (MiB) rose above the RSS before it (the high-water mark reset there)."""
    cfg = config(Path(data), Path(out), clips="uniform", count=2)  # the last clip: the end
    run = prepare(cfg, show_progress=False)
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    base = _status_kib("VmRSS")
    if whole == "1":
        import av

        with av.open(str(run.data.items[-1].path)) as video:
            held = [f.to_ndarray(format="rgb24") for f in video.decode(video=0)]
        del held
    else:
        fill_caches(run, [], show_progress=False)
    print(json.dumps({"growth_mib": (_status_kib("VmHWM") - base) / 1024}))


def _status_kib(field: str) -> int:
    """A memory figure of this process (KiB) from /proc/self/status."""
    status = Path("/proc/self/status").read_text()
    return next(int(line.split()[1]) for line in status.splitlines() if line.startswith(field))


def peak(folder: Path, length: int, whole: bool = False) -> float:
    """How far (MiB) a fresh process's peak host memory rises while caching the clips of one
    `length`-frame video (`whole`: while holding all its frames instead)."""
    data = folder / f"len{length}"
    if not data.exists():
        data.mkdir()
        write_video(data / "long.mp4", length, fps=24, width=320, height=240, caption="long")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    got = subprocess.run([sys.executable, __file__, "--child", str(data),
                          str(folder / f"out{length}{int(whole)}"), str(int(whole))],
                         capture_output=True, text=True, env=env, check=True)
    return json.loads(got.stdout.strip().splitlines()[-1])["growth_mib"]


def main() -> None:
    """Print both figures as JSON lines."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--videos", type=int, default=6)
    parser.add_argument("--frames", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--long", type=int, default=1800)
    parser.add_argument("--child", nargs=3)
    args = parser.parse_args()
    if args.child:
        _peak_child(*args.child)
        return
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        print(json.dumps({"fill": throughput(folder, args.videos, args.frames, args.rounds)}))
        short = max(args.long // 10, 30)  # a clip of 9 frames at 16 fps needs 14 at 24
        print(json.dumps({"peak_rise_mib": {
            f"difftune, {short} frames": peak(folder, short),
            f"difftune, {args.long} frames": peak(folder, args.long),
            f"whole video held, {args.long} frames": peak(folder, args.long, whole=True)}}))


if __name__ == "__main__":
    main()
