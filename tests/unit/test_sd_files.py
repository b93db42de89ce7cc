"""Single original-layout SDXL and SD3/3.5 checkpoints (difftune.families.sdxl.files, difftune.families.sd3.files).

The tiny models are written in the original layouts by test-only inverse mappings (written
independently of diffusers' converters), read back by our loaders, and must compute what the
originals compute; the denoisers are also compared with diffusers' own `from_single_file` given
the tiny config, so the shape-derived configs are checked against an independent reader.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from difftune.config import ModelConfig
from difftune.errors import ModelFileError
from difftune.families.sd3.files import load_sd3_file
from difftune.families.sd3.tiny import TINY_SD3_TRANSFORMER_CONFIG, build_tiny_sd3
from difftune.families.sdxl.files import load_sdxl_file
from difftune.families.sdxl.tiny import TINY_SDXL_UNET_CONFIG, build_tiny_sdxl

from .layouts import to_ldm_vae

F32 = {"unet": torch.float32, "transformer": torch.float32, "vae": torch.float32,
       "text_encoders": torch.float32}

# --- test-only inverse mappings: diffusers names -> original names -----------------------------

_RESNET = (("norm1", "in_layers.0"), ("conv1", "in_layers.2"), ("time_emb_proj", "emb_layers.1"),
           ("norm2", "out_layers.0"), ("conv2", "out_layers.3"), ("conv_shortcut", "skip_connection"))
_UNET_TOP = {"conv_in": "input_blocks.0.0", "time_embedding.linear_1": "time_embed.0",
             "time_embedding.linear_2": "time_embed.2", "add_embedding.linear_1": "label_emb.0.0",
             "add_embedding.linear_2": "label_emb.0.2", "conv_norm_out": "out.0", "conv_out": "out.2"}


def _sgm_unet_name(key: str, lpb: int, up_attn: list[bool]) -> str:
    """One diffusers UNet tensor name in SGM's input/middle/output block numbering."""
    for d, s in _UNET_TOP.items():
        if key.startswith(d + "."):
            return s + key[len(d):]
    p = key.split(".")
    if p[0] == "mid_block":
        place = {"resnets.0": "0", "attentions.0": "1", "resnets.1": "2"}[f"{p[1]}.{p[2]}"]
        head, rest = f"middle_block.{place}", p[3:]
    else:
        b, kind, j, rest = int(p[1]), p[2], int(p[3]), p[4:]
        if p[0] == "down_blocks":
            idx = 1 + b * (lpb + 1) + (lpb if kind == "downsamplers" else j)
            sub = {"resnets": "0", "attentions": "1", "downsamplers": "0"}[kind]
        else:
            idx = b * (lpb + 1) + (lpb if kind == "upsamplers" else j)
            sub = {"resnets": "0", "attentions": "1"}.get(kind, "2" if up_attn[b] else "1")
        head = f"{'input_blocks' if p[0] == 'down_blocks' else 'output_blocks'}.{idx}.{sub}"
        if kind in ("downsamplers", "upsamplers"):
            rest = ["op" if kind == "downsamplers" else "conv", rest[-1]]
    inner = ".".join(rest)
    if "resnets" in key:
        for d, s in _RESNET:
            inner = inner.replace(d + ".", s + ".")
    return f"{head}.{inner}"


def to_sgm_unet(unet: torch.nn.Module) -> dict[str, torch.Tensor]:
    cfg = unet.config
    up_attn = ["CrossAttn" in t for t in cfg.up_block_types]
    return {"model.diffusion_model." + _sgm_unet_name(k, cfg.layers_per_block, up_attn): v.clone()
            for k, v in unet.state_dict().items()}


def to_open_clip(te: torch.nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    """A CLIPTextModelWithProjection in OpenCLIP's layout (fused in_proj, transposed projection)."""
    sd, out = te.state_dict(), {}
    out["token_embedding.weight"] = sd["text_model.embeddings.token_embedding.weight"]
    out["positional_embedding"] = sd["text_model.embeddings.position_embedding.weight"]
    out["text_projection"] = sd["text_projection.weight"].T.contiguous()
    for kind in ("weight", "bias"):
        out[f"ln_final.{kind}"] = sd[f"text_model.final_layer_norm.{kind}"]
        for i in range(te.config.num_hidden_layers):
            src, dst = f"text_model.encoder.layers.{i}.", f"transformer.resblocks.{i}."
            out[dst + f"attn.in_proj_{kind}"] = torch.cat(
                [sd[f"{src}self_attn.{x}_proj.{kind}"] for x in "qkv"])
            for a, b in (("self_attn.out_proj", "attn.out_proj"), ("layer_norm1", "ln_1"),
                         ("layer_norm2", "ln_2"), ("mlp.fc1", "mlp.c_fc"), ("mlp.fc2", "mlp.c_proj")):
                out[f"{dst}{b}.{kind}"] = sd[f"{src}{a}.{kind}"]
    return {prefix + k: v.clone() for k, v in out.items()}


def _hf_clip(te: torch.nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    """transformers-layout CLIP tensors under `prefix`, always with the `text_model.` root."""
    out = {}
    for k, v in te.state_dict().items():
        if k.endswith("position_ids"):
            continue
        k = k if k.startswith(("text_model.", "text_projection")) else "text_model." + k
        out[prefix + k] = v.clone()
    return out


def _swap(t: torch.Tensor) -> torch.Tensor:
    a, b = t.chunk(2, dim=0)
    return torch.cat([b, a])


_SD3_TOP = {"pos_embed.proj": "x_embedder.proj", "time_text_embed.timestep_embedder.linear_1":
            "t_embedder.mlp.0", "time_text_embed.timestep_embedder.linear_2": "t_embedder.mlp.2",
            "time_text_embed.text_embedder.linear_1": "y_embedder.mlp.0",
            "time_text_embed.text_embedder.linear_2": "y_embedder.mlp.2",
            "context_embedder": "context_embedder", "proj_out": "final_layer.linear"}
_SD3_BLOCK = {"attn.to_out.0": "x_block.attn.proj", "attn.to_add_out": "context_block.attn.proj",
              "attn2.to_out.0": "x_block.attn2.proj", "attn.norm_q": "x_block.attn.ln_q",
              "attn.norm_k": "x_block.attn.ln_k", "attn.norm_added_q": "context_block.attn.ln_q",
              "attn.norm_added_k": "context_block.attn.ln_k", "attn2.norm_q": "x_block.attn2.ln_q",
              "attn2.norm_k": "x_block.attn2.ln_k", "norm1.linear": "x_block.adaLN_modulation.1",
              "norm1_context.linear": "context_block.adaLN_modulation.1",
              "ff.net.0.proj": "x_block.mlp.fc1", "ff.net.2": "x_block.mlp.fc2",
              "ff_context.net.0.proj": "context_block.mlp.fc1",
              "ff_context.net.2": "context_block.mlp.fc2"}
_SD3_QKV = {"attn": ("to_", "x_block.attn.qkv"), "attn_ctx": ("add_", "context_block.attn.qkv"),
            "attn2": ("to_", "x_block.attn2.qkv")}


def to_mmdit(tr: torch.nn.Module) -> dict[str, torch.Tensor]:
    """An SD3Transformer2DModel in Stability's MMDiT layout (fused qkv, swapped final scales)."""
    sd, out, last = tr.state_dict(), {}, tr.config.num_layers - 1
    out["pos_embed"] = sd["pos_embed.pos_embed"]
    out["final_layer.adaLN_modulation.1.weight"] = _swap(sd["norm_out.linear.weight"])
    out["final_layer.adaLN_modulation.1.bias"] = _swap(sd["norm_out.linear.bias"])
    for d, s in _SD3_TOP.items():
        for kind in ("weight", "bias"):
            out[f"{s}.{kind}"] = sd[f"{d}.{kind}"]
    for i in range(tr.config.num_layers):
        b = f"transformer_blocks.{i}."
        for key, value in sd.items():
            if not key.startswith(b):
                continue
            name, kind = key[len(b):].rsplit(".", 1)
            if name in _SD3_BLOCK:
                if name == "norm1_context.linear" and i == last:
                    value = _swap(value)
                out[f"joint_blocks.{i}.{_SD3_BLOCK[name]}.{kind}"] = value
        for attn, (pre, dst) in _SD3_QKV.items():
            mod = "attn" if attn == "attn_ctx" else attn
            for kind in ("weight", "bias"):
                parts = [sd.get(f"{b}{mod}.{pre}{x}{'_proj' if pre == 'add_' else ''}.{kind}")
                         for x in "qkv"]
                if parts[0] is not None:
                    out[f"joint_blocks.{i}.{dst}.{kind}"] = torch.cat(parts)
    return {"model.diffusion_model." + k: v.clone() for k, v in out.items()}


# --- fixtures ------------------------------------------------------------------------------------


def _tokenizer_folder(root: Path, parts: dict, subs: tuple[str, ...]) -> Path:
    folder = root / "tokenizers"
    for sub in subs:
        parts[sub].save_pretrained(folder / sub)
    return folder


@pytest.fixture(scope="module")
def sdxl(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path, Path]:
    root = tmp_path_factory.mktemp("sdxl")
    parts = build_tiny_sdxl()
    state = {**to_sgm_unet(parts["unet"]),
             **{f"first_stage_model.{k}": v for k, v in to_ldm_vae(
                 parts["vae"].state_dict(), len(parts["vae"].config.block_out_channels)).items()},
             **_hf_clip(parts["text_encoder"], "conditioner.embedders.0.transformer."),
             **to_open_clip(parts["text_encoder_2"], "conditioner.embedders.1.model.")}
    path = root / "sd_xl_tiny.safetensors"
    save_file(state, str(path))
    return parts, path, _tokenizer_folder(root, parts, ("tokenizer", "tokenizer_2"))


@pytest.fixture(scope="module")
def sd3(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path, Path]:
    root = tmp_path_factory.mktemp("sd3")
    parts = build_tiny_sd3()
    state = {**to_mmdit(parts["transformer"]),
             **{f"first_stage_model.{k}": v for k, v in to_ldm_vae(
                 parts["vae"].state_dict(), len(parts["vae"].config.block_out_channels)).items()},
             **_hf_clip(parts["text_encoder"], "text_encoders.clip_l.transformer."),
             **_hf_clip(parts["text_encoder_2"], "text_encoders.clip_g.transformer."),
             **{f"text_encoders.t5xxl.transformer.{k}": v.clone()
                for k, v in parts["text_encoder_3"].state_dict().items()}}
    state.pop("text_encoders.clip_l.transformer.text_projection.weight")  # SD3 files lack it
    path = root / "sd3.5_tiny.safetensors"
    save_file(state, str(path))
    return parts, path, _tokenizer_folder(root, parts, ("tokenizer", "tokenizer_2", "tokenizer_3"))


def _cfg(path: Path, folder: Path | None, family: str, **files: Path) -> ModelConfig:
    return ModelConfig.model_construct(family=family, flavor=None, path=folder, transformer=path,
                                       vae=files.get("vae"), clip_l=files.get("clip_l"),
                                       t5=files.get("t5"), name=None)


def _same_text(a: torch.nn.Module, b: torch.nn.Module, tok: object) -> None:
    ids = tok(["a photo of a cat"], padding="max_length", max_length=77, return_tensors="pt")
    with torch.no_grad():
        x = a(ids.input_ids, output_hidden_states=True)
        y = b(ids.input_ids, output_hidden_states=True)
    torch.testing.assert_close(x.hidden_states[-2], y.hidden_states[-2])
    for field in ("text_embeds", "pooler_output"):
        if field in x:
            torch.testing.assert_close(x[field], y[field])


# --- SDXL ----------------------------------------------------------------------------------------


def _unet_out(unet: torch.nn.Module) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    cfg = unet.config
    x = torch.randn(1, 4, 16, 16, generator=gen)
    ctx = torch.randn(1, 5, cfg.cross_attention_dim, generator=gen)
    pooled = torch.randn(1, cfg.projection_class_embeddings_input_dim
                         - 6 * cfg.addition_time_embed_dim, generator=gen)
    ids = torch.tensor([[64.0, 64, 0, 0, 64, 64]])
    with torch.no_grad():
        return unet(x, 500, ctx, added_cond_kwargs={"text_embeds": pooled, "time_ids": ids}).sample


def test_sdxl_file_computes_like_the_original(sdxl: tuple) -> None:
    parts, path, folder = sdxl
    got = load_sdxl_file(_cfg(path, folder, "sdxl"), F32)
    torch.testing.assert_close(_unet_out(got["unet"]), _unet_out(parts["unet"]))
    pix = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(1)) * 2 - 1
    with torch.no_grad():
        torch.testing.assert_close(got["vae"].encode(pix).latent_dist.mean,
                                   parts["vae"].encode(pix).latent_dist.mean)
    assert got["vae"].config.scaling_factor == 0.13025
    _same_text(got["text_encoder"], parts["text_encoder"], parts["tokenizer"])
    _same_text(got["text_encoder_2"], parts["text_encoder_2"], parts["tokenizer"])
    assert got["unet"].config.addition_time_embed_dim == 8


def test_sdxl_unet_matches_diffusers_from_single_file(sdxl: tuple, tmp_path: Path) -> None:
    from diffusers import UNet2DConditionModel

    _parts, path, folder = sdxl
    (tmp_path / "config.json").write_text(json.dumps(
        {"_class_name": "UNet2DConditionModel", **TINY_SDXL_UNET_CONFIG}))
    theirs = UNet2DConditionModel.from_single_file(str(path), config=str(tmp_path),
                                                   local_files_only=True)
    ours = load_sdxl_file(_cfg(path, folder, "sdxl"), F32)["unet"]
    torch.testing.assert_close(_unet_out(ours), _unet_out(theirs))


def test_sdxl_vae_override(sdxl: tuple, tmp_path: Path) -> None:
    parts, path, folder = sdxl
    vae_file = tmp_path / "vae.safetensors"
    state = to_ldm_vae(parts["vae"].state_dict(), 4)
    state["decoder.conv_out.bias"] = state["decoder.conv_out.bias"] + 1.0
    save_file(state, str(vae_file))
    got = load_sdxl_file(_cfg(path, folder, "sdxl", vae=vae_file), F32)
    torch.testing.assert_close(got["vae"].decoder.conv_out.bias,
                               parts["vae"].decoder.conv_out.bias + 1.0)


# --- SD3 -----------------------------------------------------------------------------------------


def _mmdit_out(tr: torch.nn.Module) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    c = tr.config
    x = torch.randn(1, c.in_channels, 16, 16, generator=gen)
    ctx = torch.randn(1, 7, c.joint_attention_dim, generator=gen)
    pooled = torch.randn(1, c.pooled_projection_dim, generator=gen)
    with torch.no_grad():
        return tr(x, ctx, pooled, torch.tensor([500.0])).sample


def test_sd3_file_computes_like_the_original(sd3: tuple) -> None:
    parts, path, folder = sd3
    got = load_sd3_file(_cfg(path, folder, "sd3"), F32)
    torch.testing.assert_close(_mmdit_out(got["transformer"]), _mmdit_out(parts["transformer"]))
    assert got["vae"].config.shift_factor == pytest.approx(0.0609)
    _same_text(got["text_encoder_2"], parts["text_encoder_2"], parts["tokenizer"])
    ids = parts["tokenizer_3"](["a cat"], return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(got["text_encoder_3"](ids).last_hidden_state,
                                   parts["text_encoder_3"](ids).last_hidden_state)
    # SD3's CLIP-L pooled output is used unprojected: identity projection, as diffusers does.
    assert torch.equal(got["text_encoder"].text_projection.weight, torch.eye(32))
    assert got["scheduler"].config.shift == 3.0


@pytest.mark.parametrize("dual", [(), (0,)])
def test_sd3_transformer_matches_diffusers_from_single_file(tmp_path: Path, dual: tuple) -> None:
    from diffusers import SD3Transformer2DModel

    config = {**TINY_SD3_TRANSFORMER_CONFIG, "dual_attention_layers": dual}
    torch.manual_seed(0)
    original = SD3Transformer2DModel(**config).eval()
    path = tmp_path / "mmdit.safetensors"
    save_file(to_mmdit(original), str(path))
    (tmp_path / "config.json").write_text(json.dumps(
        {"_class_name": "SD3Transformer2DModel", **config}))
    theirs = SD3Transformer2DModel.from_single_file(str(path), config=str(tmp_path),
                                                    local_files_only=True)
    from difftune.families.common.single_file import read_safetensors
    from difftune.families.sd3.files import load_sd3_transformer

    ours = load_sd3_transformer(read_safetensors(path, "x"), path, torch.float32)
    assert ours.config.dual_attention_layers == dual
    torch.testing.assert_close(_mmdit_out(ours), _mmdit_out(original))
    torch.testing.assert_close(_mmdit_out(ours), _mmdit_out(theirs))


def test_sd3_without_clip_g_is_refused_clearly(sd3: tuple, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    _, path, folder = sd3
    state = {k: v for k, v in load_file(str(path)).items() if "clip_g" not in k}
    bare = tmp_path / "no_clip_g.safetensors"
    save_file(state, str(bare))
    with pytest.raises(ModelFileError, match="no model.clip_g setting"):
        load_sd3_file(_cfg(bare, folder, "sd3"), F32)


# --- errors --------------------------------------------------------------------------------------


def test_missing_pickle_and_wrong_layout(sdxl: tuple, sd3: tuple, tmp_path: Path) -> None:
    _, xl_path, xl_folder = sdxl
    _, sd3_path, sd3_folder = sd3
    with pytest.raises(ModelFileError, match="does not exist"):
        load_sdxl_file(_cfg(tmp_path / "nope.safetensors", xl_folder, "sdxl"), F32)
    ckpt = tmp_path / "model.ckpt"
    ckpt.write_bytes(b"x")
    with pytest.raises(ModelFileError, match="pickle"):
        load_sdxl_file(_cfg(ckpt, xl_folder, "sdxl"), F32)
    with pytest.raises(ModelFileError, match="does not look like an SDXL checkpoint"):
        load_sdxl_file(_cfg(sd3_path, xl_folder, "sdxl"), F32)
    with pytest.raises(ModelFileError, match="does not look like an SD3"):
        load_sd3_file(_cfg(xl_path, sd3_folder, "sd3"), F32)


def test_missing_tokenizers(sdxl: tuple, tmp_path: Path) -> None:
    _, path, _ = sdxl
    with pytest.raises(ModelFileError, match="tokenizers"):
        load_sdxl_file(_cfg(path, None, "sdxl"), F32)
    with pytest.raises(ModelFileError, match="tokenizer_2"):
        load_sdxl_file(_cfg(path, tmp_path, "sdxl"), F32)


def test_family_load_uses_the_single_file(sdxl: tuple) -> None:
    from difftune.families.sdxl.family import SDXLFamily
    from difftune.precision.policy import PrecisionPolicy

    _, path, folder = sdxl
    cfg = ModelConfig(family="sdxl", path=folder, transformer=path)
    policy = PrecisionPolicy(torch.device("cpu"), None, torch.float32, torch.float32,
                             torch.float32)
    comps = SDXLFamily().load(cfg, policy)
    assert comps.name == "sd_xl_tiny"


def test_text_only_reload_of_single_files(sdxl: tuple, sd3: tuple) -> None:
    """`text_only` (reloading unloaded encoders) reads the same encoders, and nothing else."""
    for (parts, path, folder), family, load, names in (
            (sdxl, "sdxl", load_sdxl_file, ("text_encoder", "text_encoder_2")),
            (sd3, "sd3", load_sd3_file, ("text_encoder", "text_encoder_2", "text_encoder_3"))):
        cfg = _cfg(path, folder, family)
        full, alone = load(cfg, F32), load(cfg, {"text_encoders": torch.float32}, text_only=True)
        assert set(alone) == set(names)
        for name in names:
            a, b = alone[name].state_dict(), full[name].state_dict()
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
