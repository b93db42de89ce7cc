"""Time and peak host memory of `difftune lora merge` and `extract` against the model's size.

    python bench/lora_tools.py [--blocks 2,4,8] [--width 1024] [--rank 16]

For each size it writes a FLUX.1-layout single file of N double blocks (BFL names, random bf16
weights; width W: the fused qkv is 3W x W, the MLP 4W x W), a rank-R diffusers-named LoRA on
every block's attention and MLP layers, and a "tuned" file (base plus a small change on every
matrix). Then, each in a fresh process (so its peak RSS is its own): the import and name
tables alone (the baseline; the verbs' seconds include it), `merge` of the LoRA into the base, and `extract` of the tuned
file's difference at rank R. It prints seconds and peak RSS above the baseline next to the
file size and the largest tensor: memory should stay near a few tensors whatever the size.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

MATRICES = {"img_attn.qkv": (3, 1), "img_attn.proj": (1, 1), "img_mlp.0": (4, 1),
            "img_mlp.2": (1, 4), "txt_attn.qkv": (3, 1), "txt_attn.proj": (1, 1),
            "txt_mlp.0": (4, 1), "txt_mlp.2": (1, 4)}
LORA = {"attn.to_q": (1, 1), "attn.to_k": (1, 1), "attn.to_v": (1, 1), "attn.to_out.0": (1, 1),
        "ff.net.0.proj": (4, 1), "ff.net.2": (1, 4)}
RUN = {"baseline": "from difftune.lora_tools.names import family_names; family_names('flux')",
       "merge": "from difftune.cli import main; assert 0 == main(['lora', 'merge', "
                "'{d}/base.safetensors', '--lora', '{d}/lora.safetensors', '--family', 'flux',"
                " '--out', '{d}/merged.safetensors', '--overwrite'])",
       "extract": "from difftune.cli import main; assert 0 == main(['lora', "
                  "'extract', '--base', '{d}/base.safetensors', '--tuned', "
                  "'{d}/tuned.safetensors', '--rank', '{r}', '--family', 'flux', '--out', "
                  "'{d}/extracted.safetensors', '--overwrite'])"}


def write_files(folder: Path, blocks: int, width: int, rank: int) -> tuple[int, int]:
    """Write base, tuned and LoRA files; return (base bytes, largest tensor bytes)."""
    gen = torch.Generator().manual_seed(0)
    base, tuned, lora = {}, {}, {}
    for i in range(blocks):
        for name, (rows, cols) in MATRICES.items():
            w = torch.randn(rows * width, cols * width, generator=gen).to(torch.bfloat16)
            base[f"double_blocks.{i}.{name}.weight"] = w
            tuned[f"double_blocks.{i}.{name}.weight"] = w + 0.01
        for name, (rows, cols) in LORA.items():
            stem = f"transformer.transformer_blocks.{i}.{name}"
            lora[f"{stem}.lora_A.weight"] = torch.randn(rank, cols * width, generator=gen)
            lora[f"{stem}.lora_B.weight"] = torch.randn(rows * width, rank, generator=gen) * .01
    save_file(base, str(folder / "base.safetensors"))
    save_file(tuned, str(folder / "tuned.safetensors"))
    save_file(lora, str(folder / "lora.safetensors"))
    return (folder / "base.safetensors").stat().st_size, max(
        t.numel() * t.element_size() for t in base.values())


# Run in the measured process: a thread samples the anonymous resident memory (what the
# process allocated; the file pages safetensors maps are page cache, counted apart) every 2 ms.
SAMPLER = """
import re, threading, time
peak = {"Anon": 0, "File": 0}
def sample():
    while True:
        text = open("/proc/self/status").read()
        for k in peak:
            peak[k] = max(peak[k], int(re.search("Rss" + k + r":\\s+(\\d+)", text).group(1)))
        time.sleep(0.002)
threading.Thread(target=sample, daemon=True).start()
start = time.perf_counter()
CODE
print("MEASURED", time.perf_counter() - start, peak["Anon"] / 1024, peak["File"] / 1024)
"""


def measure(code: str) -> tuple[float, float, float]:
    """(seconds, peak anonymous RSS MiB, peak file-backed RSS MiB) of `code` in a fresh
    Python (seconds from after the interpreter started)."""
    done = subprocess.run([sys.executable, "-c", SAMPLER.replace("CODE", code)],
                          capture_output=True, text=True)
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("MEASURED")]
    if not line:
        raise SystemExit(done.stderr[-2000:])
    seconds, anon, file = (float(x) for x in line[0].split()[1:])
    return seconds, anon, file


def main() -> None:
    """Measure every size and print one table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", default="2,4,8")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    print("| base file | largest tensor | import s | merge s | merge peak (anon, above import) "
          "| extract s | extract peak (anon, above import) | file pages mapped (merge, extract) |"
          "\n|---|---|---|---|---|---|---|---|")
    for blocks in [int(b) for b in args.blocks.split(",")]:
        with tempfile.TemporaryDirectory() as d:
            size, largest = write_files(Path(d), blocks, args.width, args.rank)
            (bs, ba, _), (ms, ma, mf), (es, ea, ef) = (
                measure(RUN[v].format(d=d, r=args.rank)) for v in ("baseline", "merge",
                                                                    "extract"))
            print(f"| {size / 2**20:.0f} MiB | {largest / 2**20:.0f} MiB | {bs:.1f} | {ms:.1f} | "
                  f"{ma - ba:.0f} MiB | {es:.1f} | {ea - ba:.0f} MiB | {mf:.0f}, {ef:.0f} MiB |",
                  flush=True)


if __name__ == "__main__":
    main()
