"""Make the files of the built-in tiny FLUX.1 flavor and the demo dataset.

Run `python -m difftune.assets.make_tiny_assets [--vae-steps N] [--retrain-tokenizers]`
(about four minutes on two CPU cores). It writes, next to
this script:
- tiny/tokenizer/    a CLIP-style byte-level BPE (`</w>` end of word): vocab.json, merges.txt
- tiny/tokenizer_2/  a T5-style Unigram tokenizer: tokenizer.json
- tiny/vae.safetensors + tiny/vae_config.json   a tiny AutoencoderKL trained on shape images,
  with scaling/shift factors measured on its latents (as FLUX.1's were)
- demo/              six 64x64 shape images, same-stem captions and prompts.txt

Both tokenizers are trained on a small built-in English caption corpus, so nothing is
downloaded. Seeds are fixed; the tokenizers are only retrained on request (see `main`).
"""

from __future__ import annotations

import os

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # deterministic tokenizer training
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import itertools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image, ImageDraw  # noqa: E402

HERE = Path(__file__).resolve().parent

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30), "green": (30, 160, 60), "blue": (30, 60, 220),
    "yellow": (240, 220, 30), "orange": (245, 140, 20), "purple": (130, 40, 170),
    "pink": (245, 130, 190), "cyan": (40, 210, 220), "white": (245, 245, 245),
    "black": (15, 15, 15), "gray": (128, 128, 128), "brown": (120, 70, 30),
}
SHAPES = ["circle", "square", "triangle", "stripes", "ring", "cross"]
OBJECTS = ["cat", "dog", "house", "tree", "car", "flower", "bird", "boat", "mountain", "cup",
           "chair", "apple", "moon", "sun", "star", "person", "woman", "man", "child", "horse",
           "bicycle", "lamp", "book", "river", "forest", "city", "street", "window", "door"]
STYLES = ["a photo of", "a painting of", "a drawing of", "a sketch of", "an illustration of",
          "a watercolor of", "an oil painting of", "a pixel art of", "a poster of",
          "a close-up photo of", "a minimalist render of", "a cartoon of", "a 3d render of"]
EXTRAS = ["in the style of impressionism", "flat colors", "high contrast", "soft lighting",
          "highly detailed", "at sunset", "at night", "in the morning", "on a white table",
          "centered", "simple background", "geometric art", "bauhaus style", "vector art",
          "studio lighting", "sharp focus", "low poly", "pastel colors", "vintage film"]
WORDS = """
above across after against along among around at before behind below beneath beside between
beyond by during from inside into near off onto outside over through toward under upon with
within without big small tiny huge large little tall short long wide narrow round flat thin
thick bright dark light pale deep vivid dull shiny glossy matte smooth rough soft hard warm
cold old young new ancient modern futuristic rustic cozy empty crowded quiet busy calm stormy
sunny cloudy rainy snowy foggy misty windy beautiful ugly elegant simple complex detailed
realistic abstract surreal dreamy dramatic cinematic epic colorful monochrome black-and-white
golden silver wooden metal glass stone paper plastic fabric leather marble concrete brick
ocean sea lake beach island desert valley hill field meadow garden park village town castle
bridge tower church temple market kitchen bedroom library office classroom museum station
airport harbor road path fence wall roof floor ceiling stairs table desk sofa bed mirror
clock vase bottle plate bowl spoon fork knife basket box bag hat shoe shirt dress coat scarf
glove ring necklace crown sword shield robot dragon unicorn monster ghost wizard knight
princess king queen soldier farmer doctor teacher student artist musician dancer chef
sailor pilot astronaut girl boy baby family friends crowd face eyes hair hand smile portrait
landscape cityscape seascape skyline sky cloud rain snow ice fire smoke water wave storm
lightning rainbow sunrise sunset twilight midnight spring summer autumn winter leaf leaves
grass rose tulip lily daisy oak pine palm cactus mushroom fruit banana orange lemon cherry
grape strawberry bread cake cookie pizza coffee tea wine cheese egg fish chicken rabbit fox
wolf bear lion tiger elephant giraffe monkey deer cow sheep pig duck owl eagle butterfly bee
spider snake turtle frog whale dolphin shark octopus train bus truck plane ship rocket
camera phone computer guitar piano violin drum painting drawing sketch photo photograph
render illustration poster logo icon pattern texture gradient shadow reflection silhouette
outline symmetric centered corner edge middle left right top bottom front back side view
closeup wide-angle macro aerial portrait-mode bokeh grain noise sharp blurry focus exposure
""".split()

HANDWRITTEN = [
    "a red circle on a blue background",
    "a yellow square on a green background",
    "a white triangle on a black background",
    "orange and purple stripes",
    "a small pink ring in the corner of the image",
    "a large cyan cross in the middle",
    "two circles side by side, one red and one blue",
    "the quick brown fox jumps over the lazy dog",
    "a portrait of an old man with a beard, oil on canvas",
    "a bowl of fruit on a wooden table, still life",
    "an empty street in the rain with neon lights",
    "a lighthouse on a rocky coast under a cloudy sky",
    "sks person wearing a hat, photo, 35mm",
    "a cute corgi sitting in the grass",
    "abstract composition of shapes and lines",
    "the letter a written in bold black ink",
    "a map of an imaginary island with mountains and rivers",
    "top view of a chess board with pieces",
    "a glass of water, reflection, macro photography",
    "a field of sunflowers under a bright blue sky",
]


def caption_corpus() -> list[str]:
    """A few hundred English caption lines (shapes, colors, objects, art styles)."""
    lines = list(HANDWRITTEN)
    for shape, fg, bg in itertools.product(SHAPES, COLORS, COLORS):
        if fg != bg and (len(lines) % 3 == 0 or shape == "circle"):
            lines.append(f"a {fg} {shape} on a {bg} background")
    for i, (style, obj) in enumerate(itertools.product(STYLES, OBJECTS)):
        color = list(COLORS)[i % len(COLORS)]
        lines.append(f"{style} a {color} {obj}, {EXTRAS[i % len(EXTRAS)]}")
    lines += [f"{n} {c} {s}s" for n, c, s in zip(
        ["one", "two", "three", "four", "five", "many", "several", "some"] * 9,
        itertools.cycle(COLORS), itertools.cycle(SHAPES))]
    # Each vocabulary word in a few short phrases, so both tokenizers learn whole words.
    for i, word in enumerate(WORDS):
        color, obj = list(COLORS)[i % len(COLORS)], OBJECTS[i % len(OBJECTS)]
        lines.append(f"a {word} {obj}, {word} and {color}")
        lines.append(f"{STYLES[i % len(STYLES)]} a {word}, {EXTRAS[i % len(EXTRAS)]}")
    return lines


def train_clip_tokenizer(corpus: list[str], out: Path, vocab_size: int = 1600) -> None:
    """CLIP-style byte-level BPE with `</w>` word ends, pre-processed like CLIPTokenizer."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(end_of_word_suffix="</w>", unk_token="<|endoftext|>"))
    tok.normalizer = normalizers.Sequence(
        [normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Lowercase()])
    split = r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="removed", invert=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False)])
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=1, end_of_word_suffix="</w>",
        special_tokens=["<|startoftext|>", "<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer=trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.model.save(str(out))
    _write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "CLIPTokenizer", "model_max_length": 77,
        "bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>", "pad_token": "<|endoftext|>"})


def train_t5_tokenizer(corpus: list[str], out: Path, vocab_size: int = 1200) -> None:
    """T5-style Unigram (Metaspace, `</s>` appended) saved as one tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(),
        pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)])
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    trainer = trainers.UnigramTrainer(
        vocab_size=vocab_size, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>",
        show_progress=False)
    tok.train_from_iterator([line.lower() for line in corpus] + corpus, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=["$A", "</s>"], pair=["$A", "</s>", "$B", "</s>"],
        special_tokens=[("</s>", tok.token_to_id("</s>"))])
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "T5Tokenizer", "model_max_length": 512, "extra_ids": 0,
        "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"})


def _write_json(path: Path, data: dict) -> None:
    """Write JSON with sorted keys so re-runs give byte-identical files."""
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def draw_shape(shape: str, fg: tuple[int, int, int], bg: tuple[int, int, int],
               cx: float, cy: float, r: float, size: int = 64) -> Image.Image:
    """A solid-color shape (centre cx, cy and half-size r, in pixels) on a solid background."""
    img = Image.new("RGB", (size, size), bg)
    d = ImageDraw.Draw(img)
    box = (cx - r, cy - r, cx + r, cy + r)
    if shape == "circle":
        d.ellipse(box, fill=fg)
    elif shape == "square":
        d.rectangle(box, fill=fg)
    elif shape == "triangle":
        d.polygon([(cx, cy - r), (cx + r, cy + r), (cx - r, cy + r)], fill=fg)
    elif shape == "ring":
        d.ellipse(box, outline=fg, width=max(2, int(r / 3)))
    elif shape == "cross":
        w = max(2, r / 3)
        d.rectangle((cx - r, cy - w, cx + r, cy + w), fill=fg)
        d.rectangle((cx - w, cy - r, cx + w, cy + r), fill=fg)
    elif shape == "stripes":
        period = max(4, int(r / 2))
        for x in range(0, size, 2 * period):
            d.rectangle((x, 0, x + period - 1, size), fill=fg)
    else:
        raise ValueError(f"unknown shape {shape}")
    return img


def random_shape_image(rng: random.Random, size: int = 64) -> Image.Image:
    """A random shape with random colors, position and size (the VAE's training data)."""
    def color() -> tuple[int, int, int]:
        if rng.random() < 0.5:
            return COLORS[rng.choice(list(COLORS))]
        return (rng.randrange(256), rng.randrange(256), rng.randrange(256))

    r = rng.uniform(6, 26)
    img = draw_shape(rng.choice(SHAPES), color(), color(), rng.uniform(r, size - r),
                     rng.uniform(r, size - r), r, size)
    if rng.random() < 0.3:  # sometimes a second shape, so images are not all alike
        r2 = rng.uniform(4, 14)
        extra = draw_shape(rng.choice(SHAPES[:3] + SHAPES[4:]), color(), (0, 0, 0),
                           rng.uniform(r2, size - r2), rng.uniform(r2, size - r2), r2, size)
        mask = Image.fromarray((np.asarray(extra).sum(-1) > 0).astype(np.uint8) * 255)
        img.paste(extra, (0, 0), mask)
    return img


def to_tensor(images: list[Image.Image]) -> torch.Tensor:
    """PIL images -> (B, 3, H, W) float tensor in [-1, 1]."""
    arr = np.stack([np.asarray(im, dtype=np.float32) for im in images]) / 127.5 - 1.0
    return torch.from_numpy(arr).permute(0, 3, 1, 2).contiguous()


def shape_batch(rng: random.Random, n: int) -> torch.Tensor:
    """A batch of n random shape images as a tensor in [-1, 1]."""
    return to_tensor([random_shape_image(rng) for _ in range(n)])


def random_crops(x: torch.Tensor, size: int, gen: torch.Generator) -> torch.Tensor:
    """One random size x size crop per image (grid-aligned to 8, the VAE's downscale)."""
    steps = (x.shape[-1] - size) // 8 + 1
    offs = torch.randint(0, steps, (x.shape[0], 2), generator=gen) * 8
    return torch.stack([im[:, i:i + size, j:j + size] for im, (i, j) in zip(x, offs.tolist())])


def train_vae(steps: int, batch: int = 16, log: bool = True) -> torch.nn.Module:
    """Train the tiny AutoencoderKL: L1 + MSE reconstruction with a small KL term.

    It trains on 32x32 crops of 64x64 shape images: the same shapes at the same scale for a
    quarter of the compute (the network is convolutional, so it then works on whole images).
    """
    from difftune.families.common.tiny import new_tiny_vae

    torch.manual_seed(0)
    rng = random.Random(0)
    vae = new_tiny_vae().train()
    opt = torch.optim.AdamW(vae.parameters(), lr=2e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-3, total_steps=steps, pct_start=0.1)
    gen = torch.Generator().manual_seed(0)
    start = time.time()
    for step in range(steps):
        x = random_crops(shape_batch(rng, batch), 32, gen)
        post = vae.encode(x).latent_dist
        rec = vae.decode(post.sample(generator=gen)).sample
        # KL is kept tiny (as in latent-diffusion autoencoders): it only regularises the scale.
        loss = (rec - x).abs().mean() + ((rec - x) ** 2).mean() + 1e-6 * post.kl().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if log and (step % 100 == 0 or step == steps - 1):
            print(f"vae step {step:5d} loss {loss.item():.4f} ({time.time() - start:.0f}s)")
    return vae.eval()


@torch.no_grad()
def latent_stats(vae: torch.nn.Module, n: int = 256) -> tuple[float, float]:
    """Mean and std of the latents' means over shape images: FLUX.1's shift/scale recipe."""
    rng = random.Random(1)
    z = torch.cat([vae.encode(shape_batch(rng, 32)).latent_dist.mean for _ in range(n // 32)])
    return z.mean().item(), z.std().item()


@torch.no_grad()
def reconstruction_error(vae: torch.nn.Module, n: int = 256) -> dict[str, float]:
    """Held-out error (images from a seed never used in training), pixels in [0, 1]."""
    rng = random.Random(12345)
    x = shape_batch(rng, n)
    rec = vae.decode(vae.encode(x).latent_dist.mode()).sample.clamp(-1, 1)
    diff = (rec - x) / 2
    mse = (diff**2).mean().item()
    return {"l1": diff.abs().mean().item(), "mse": mse, "psnr": -10 * math.log10(mse)}


def save_vae(vae: torch.nn.Module, out: Path) -> dict[str, float]:
    """Write vae.safetensors (fp16, < 1 MB) and vae_config.json with measured factors."""
    from safetensors.torch import save_file

    from difftune.families.common.tiny import TINY_VAE_ARCH

    shift, std = latent_stats(vae)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.float16).contiguous() for k, v in vae.state_dict().items()}
    save_file(state, str(out / "vae.safetensors"))
    os.chmod(out / "vae.safetensors", 0o644)  # safetensors writes 0600; the file is shipped
    err = reconstruction_error(vae)
    _write_json(out / "vae_config.json", {
        **TINY_VAE_ARCH, "scaling_factor": round(1.0 / std, 6), "shift_factor": round(shift, 6),
        "_heldout_reconstruction": {k: round(v, 5) for k, v in err.items()}})
    return err


DEMO = [
    ("red_circle", "circle", "red", "blue"),
    ("yellow_square", "square", "yellow", "green"),
    ("white_triangle", "triangle", "white", "black"),
    ("orange_stripes", "stripes", "orange", "purple"),
    ("pink_ring", "ring", "pink", "gray"),
    ("cyan_cross", "cross", "cyan", "brown"),
]


def demo_caption(shape: str, fg: str, bg: str) -> str:
    """The demo caption of one image, e.g. 'a red circle on a blue background'."""
    if shape == "stripes":
        return f"{fg} stripes on a {bg} background"
    return f"a {fg} {shape} on a {bg} background"


def make_demo(out: Path) -> None:
    """Six 64x64 images with same-stem captions, and prompts.txt with kohya-style options."""
    out.mkdir(parents=True, exist_ok=True)
    prompts = []
    for i, (stem, shape, fg, bg) in enumerate(DEMO):
        draw_shape(shape, COLORS[fg], COLORS[bg], 32, 32, 18).save(out / f"{stem}.png")
        caption = demo_caption(shape, fg, bg)
        (out / f"{stem}.txt").write_text(caption + "\n", encoding="utf-8")
        prompts.append(f"{caption} --w 64 --h 64 --s 8 --d {i + 1}")
    (out / "prompts.txt").write_text("\n".join(prompts) + "\n", encoding="utf-8")


def main(argv: list[str]) -> None:
    """Write every asset; `--vae-steps N` sets the autoencoder's training length and
    `--retrain-tokenizers` replaces the shipped tokenizers."""
    steps = int(argv[argv.index("--vae-steps") + 1]) if "--vae-steps" in argv else 1500
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    tiny = HERE / "tiny"
    # The `tokenizers` trainers break ties between equally frequent merges in hash order,
    # which changes between processes; so the shipped tokenizers are kept unless retraining
    # is asked for (a retrained pair is equivalent but not byte-identical).
    if "--retrain-tokenizers" in argv or not (tiny / "tokenizer_2" / "tokenizer.json").is_file():
        corpus = caption_corpus()
        train_clip_tokenizer(corpus, tiny / "tokenizer")
        train_t5_tokenizer(corpus, tiny / "tokenizer_2")
        print(f"tokenizers trained on {len(corpus)} lines")
    make_demo(HERE / "demo")
    print("demo written")
    err = save_vae(train_vae(steps), HERE / "tiny")
    print("held-out reconstruction (pixels in [0,1]):", json.dumps(err))


if __name__ == "__main__":
    main(sys.argv[1:])
