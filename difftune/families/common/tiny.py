"""What the tiny flavors share: the shipped offline tokenizers and autoencoder, tiny text
encoders, and the assets folder.

Every tiny flavor builds real diffusers/transformers classes with tiny configs; the pieces used
by more than one family live here. The tokenizers and a small pretrained autoencoder ship as
files in `difftune/assets/tiny/` (made by `difftune/assets/make_tiny_assets.py`).
"""

from __future__ import annotations

import json
import re
from importlib import resources
from pathlib import Path
from typing import Any

# Text-encoder sizes. FLUX.1's T5 d_model feeds its transformer's context embedder and CLIP's
# pooled output its vector embedder, so those widths must agree with the transformer.
TEXT_WIDTH = 32
CLIP_MAX_LENGTH = 77
# SDXL and SD3 widths. "CLIP-L" and "CLIP-G" differ in width (and activation) as in the real
# models, so a mix-up of the two encoders shows up as a shape error, not a silent success.
CLIP_L_WIDTH = 32
CLIP_G_WIDTH = 64

# The autoencoder's architecture; scaling/shift factors are measured on its latents by
# make_tiny_assets.py and stored with the weights (vae_config.json).
TINY_VAE_ARCH: dict[str, Any] = {
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ["DownEncoderBlock2D"] * 4,  # 4 blocks: downscale 8, like FLUX.1
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "block_out_channels": [32, 32, 32, 32],
    "layers_per_block": 1,
    "latent_channels": 16,
    "norm_num_groups": 8,  # 4 channels a group: 1-channel groups would erase flat colors
    "sample_size": 64,
    "use_quant_conv": False,  # the FLUX.1 autoencoder has neither quant conv
    "use_post_quant_conv": False,
}


# The Stable Diffusion (SD 1.5, SDXL) autoencoder's shape: 4 latent channels, 4 blocks
# (downscale 8), quant convs; each family adds its scaling factor.
TINY_LDM_VAE: dict[str, Any] = {
    "latent_channels": 4,
    "block_out_channels": [16, 16, 16, 16],
    "use_quant_conv": True,
    "use_post_quant_conv": True,
}


def assets_dir() -> Path:
    """Folder of the shipped tiny assets (works from a checkout and from an installed wheel)."""
    return Path(str(resources.files("difftune") / "assets" / "tiny"))


def load_tiny_tokenizers() -> tuple[Any, Any]:
    """The offline CLIP-style and T5-style tokenizers shipped in the assets folder."""
    from transformers import CLIPTokenizer, T5TokenizerFast

    base = assets_dir()
    clip = CLIPTokenizer.from_pretrained(str(base / "tokenizer"), local_files_only=True)
    t5 = T5TokenizerFast.from_pretrained(str(base / "tokenizer_2"), local_files_only=True)
    return clip, t5


def tiny_clip_config(vocab_size: int, bos_id: int, eos_id: int) -> Any:
    """CLIP text-encoder config: CLIP-L's shape (quick_gelu, 77 positions), tiny widths.

    eos_token_id must be the tokenizer's real id: CLIPTextModel pools at the first eos token
    (it only falls back to argmax(input_ids) for the legacy id 2).
    """
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=vocab_size,
        hidden_size=TEXT_WIDTH,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=CLIP_MAX_LENGTH,
        projection_dim=TEXT_WIDTH,
        hidden_act="quick_gelu",
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )


def tiny_t5_config(vocab_size: int, pad_id: int, eos_id: int) -> Any:
    """T5 v1.1 encoder config (gated-gelu, untied), tiny widths."""
    from transformers import T5Config

    return T5Config(
        vocab_size=vocab_size,
        d_model=TEXT_WIDTH,
        d_kv=16,
        d_ff=64,
        num_layers=2,
        num_heads=2,
        feed_forward_proj="gated-gelu",
        tie_word_embeddings=False,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        decoder_start_token_id=pad_id,
    )


def new_tiny_vae(extra: dict[str, Any] | None = None) -> Any:
    """An AutoencoderKL with the tiny architecture (random weights; global RNG is used)."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(**{**TINY_VAE_ARCH, **(extra or {})})


def load_tiny_vae() -> Any:
    """The pretrained tiny autoencoder from the assets folder, in eval mode.

    Building the module would draw its (then overwritten) initial weights from the global RNG,
    so it is built inside a forked RNG: callers' random streams are left as they were.
    """
    import torch
    from safetensors.torch import load_file

    base = assets_dir()
    cfg = json.loads((base / "vae_config.json").read_text(encoding="utf-8"))
    with torch.random.fork_rng(devices=[]):
        vae = new_tiny_vae({k: cfg[k] for k in ("scaling_factor", "shift_factor")})
    state = {k: v.float() for k, v in load_file(str(base / "vae.safetensors")).items()}
    vae.load_state_dict(state, strict=True)
    return vae.eval()



def clip_encoder(tok: Any, width: int, projection: bool, act: str) -> Any:
    """A tiny CLIP text encoder of the given width; with a projection head if asked.

    Starts from `tiny_clip_config` so the token ids (and so CLIP's eos pooling) match the
    tokenizer; the projection width equals the hidden width, as for CLIP-G (and harmless for
    CLIP-L, whose real projection is also 768).
    """
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    cfg = tiny_clip_config(len(tok), tok.bos_token_id, tok.eos_token_id)
    cfg.update({"hidden_size": width, "intermediate_size": 2 * width, "projection_dim": width,
                "num_attention_heads": max(2, width // 16), "hidden_act": act})
    cls = CLIPTextModelWithProjection if projection else CLIPTextModel
    return cls(cfg).eval()


def t5_encoder(tok: Any, width: int) -> Any:
    """A tiny T5 v1.1 encoder of the given width (ids taken from the tokenizer)."""
    from transformers import T5EncoderModel

    cfg = tiny_t5_config(len(tok), tok.pad_token_id, tok.eos_token_id)
    cfg.update({"d_model": width, "d_ff": width})
    return T5EncoderModel(cfg).eval()



# Qwen's special tokens (the added tokens of Qwen3-VL's tokenizer that text prompts can hold).
QWEN_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
                       "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")


def _qwen_words(pre_tokenizer: Any, text: str) -> list[str]:
    """The byte-level pre-tokenized pieces of `text`, Qwen's special tokens left out."""
    pattern = "|".join(re.escape(t) for t in QWEN_SPECIAL_TOKENS)
    return [piece for part in re.split(pattern, text) if part
            for piece, _ in pre_tokenizer.pre_tokenize_str(part)]


def qwen_bpe_tokenizer(text: str, chat_template: str,
                       splits: dict[str, tuple[str, ...]] | None = None) -> Any:
    """A Qwen2 byte-level BPE tokenizer (the one Qwen2.5 and Qwen3 models share): the 256 byte
    symbols, a merge chain making each word of `text` one token, as the real vocabulary has
    them (a word in `splits` becomes the byte-level pieces listed there instead, where the real
    vocabulary splits it), Qwen's special tokens (<|endoftext|> pads on the right, <|im_end|>
    ends) and `chat_template`."""
    from transformers import AddedToken, Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    symbols = sorted(bytes_to_unicode().values())

    def build(vocab: list[str], merges: list[tuple[str, str]]) -> Any:
        tok = Qwen2Tokenizer(vocab={s: i for i, s in enumerate(vocab)}, merges=merges,
                             unk_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>")
        tok.add_tokens([AddedToken(t, special=True) for t in QWEN_SPECIAL_TOKENS],
                       special_tokens=True)
        tok.padding_side = "right"
        tok.chat_template = chat_template
        return tok

    pre = build(symbols, []).backend_tokenizer.pre_tokenizer
    merges: list[tuple[str, str]] = []
    vocab = list(symbols)
    words = _qwen_words(pre, text)
    split = splits or {}
    # The split words' pieces last: their merges then rank below every whole word's, which
    # they would otherwise break apart (" provided" after the piece "preh" merged "pr").
    pieces = [w for w in words if w not in split] + [p for w in words for p in split.get(w, ())]
    for piece in pieces:
        for end in range(2, len(piece) + 1):
            if piece[:end] not in vocab:
                merges.append((piece[: end - 1], piece[end - 1]))
                vocab.append(piece[:end])
    return build(vocab, merges)
