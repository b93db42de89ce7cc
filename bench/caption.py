"""Captioning throughput: `difftune caption`'s images/s against a bare generate loop, same run.

    OMP_NUM_THREADS=1 python bench/caption.py [--images 48] [--batch 8] [--tokens 16]
        [--rounds 3] [--model PATH] [--device cpu|cuda]

The sides caption the same images with the same model, processor, prompt and batch size.
The bare loop is what a script would write: the images decoded beforehand (not timed), then
processor + `model.generate` per batch, answers decoded and thrown away; "bare+io" adds
what any script does besides: each batch decoded from disk first, each answer written with a
plain (not atomic, not synced) write. difftune's side is the
whole verb minus the model load: decoding each image from disk (threads, a batch ahead),
batching, generation, cleaning, atomic (synced) caption writes (`caption.run.caption_images`).
Without --model the tiny Qwen2.5-VL of the tests is used (tests/captioners.py: random weights,
so the figure is the pipeline's overhead, not a real model's speed); with --model, any folder
`difftune caption` takes. The rounds alternate the two sides; the medians are reported.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _images(folder: Path, count: int) -> list[Path]:
    """`count` noise images of 256x256 (some wider), as PNG."""
    rng = np.random.default_rng(0)
    out = []
    for i in range(count):
        size = (256, 256) if i % 3 else (320, 240)
        pixels = (rng.random((size[1], size[0], 3)) * 255).astype("uint8")
        out.append(folder / f"im{i:04d}.png")
        Image.fromarray(pixels).save(out[-1])
    return out


def bare(cap: object, images: list[Image.Image] | list[Path], batch: int) -> float:
    """Seconds of processor + generate + decode over all images: given decoded, or given as
    paths (then each batch is decoded first and each answer written with a plain write)."""
    import torch

    start = time.perf_counter()
    for i in range(0, len(images), batch):
        chunk = images[i:i + batch]
        paths = chunk if isinstance(chunk[0], Path) else []
        if paths:
            chunk = [Image.open(p).convert("RGB") for p in paths]
        inputs = cap.processor(text=[cap.prompt] * len(chunk), images=chunk,
                               return_tensors="pt", padding=True).to(cap.device)
        with torch.inference_mode():
            out = cap.model.generate(**inputs, max_new_tokens=cap.max_tokens,
                                     do_sample=False, num_beams=1)
        texts = cap.processor.batch_decode(out[:, inputs["input_ids"].shape[1]:],
                                           skip_special_tokens=True)
        for path, text in zip(paths, texts):
            path.with_suffix(".txt").write_text(text, encoding="utf-8")
    return time.perf_counter() - start


def ours(cap: object, paths: list[Path], batch: int) -> float:
    """Seconds of `caption_images` over the folder (overwriting, so every image is done)."""
    from difftune.caption.run import WritePolicy, caption_images

    start = time.perf_counter()
    caption_images(cap, paths, ".txt", WritePolicy("overwrite"), batch, show_progress=False)
    return time.perf_counter() - start


def main() -> None:
    """Measure and print the table."""
    p = argparse.ArgumentParser()
    p.add_argument("--images", type=int, default=48)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model", type=Path)
    p.add_argument("--device", default="cpu")
    a = p.parse_args()
    from difftune.caption.detect import detect
    from difftune.caption.styles import instruction
    from difftune.caption.vlm import Hardware, VisionLanguageCaptioner

    with tempfile.TemporaryDirectory() as tmp:
        model = a.model
        if model is None:
            from tests.captioners import qwen25_vl_folder

            model = qwen25_vl_folder(Path(tmp) / "model")
        files = detect(model)
        cap = VisionLanguageCaptioner(files, Hardware(a.device), instruction(
            files.kind, "short", None), a.tokens)
        (Path(tmp) / "data").mkdir()
        paths = _images(Path(tmp) / "data", a.images)
        decoded = [Image.open(p).convert("RGB") for p in paths]
        bare(cap, decoded[:a.batch], a.batch)  # warm-up
        times: dict[str, list[float]] = {"bare": [], "bare+io": [], "difftune": []}
        for _ in range(a.rounds):
            times["bare"].append(bare(cap, decoded, a.batch))
            times["bare+io"].append(bare(cap, paths, a.batch))
            times["difftune"].append(ours(cap, paths, a.batch))
    print(f"{a.images} images, batch {a.batch}, {a.tokens} new tokens, {a.rounds} rounds, "
          f"model {a.model or 'tiny Qwen2.5-VL'}, device {a.device}")
    print("| loop | images/s (median) | rounds (s) |\n| --- | ---: | --- |")
    for name, ts in times.items():
        print(f"| {name} | {a.images / statistics.median(ts):.1f} | "
              f"{', '.join(f'{t:.2f}' for t in ts)} |")
    ratio = statistics.median(times["difftune"]) / statistics.median(times["bare"])
    print(f"difftune / bare time: {ratio:.3f}")


if __name__ == "__main__":
    main()
