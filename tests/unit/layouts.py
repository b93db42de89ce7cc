"""Test-only inverse mappings: diffusers state-dict names -> the BFL (FLUX.1) and LDM (VAE)
layouts that single files use, so the loaders can be tested against files in those layouts."""

from __future__ import annotations

import torch


def _swap_halves(w: torch.Tensor) -> torch.Tensor:
    """diffusers' final norm is (scale, shift); BFL's is (shift, scale)."""
    a, b = w.chunk(2, dim=0)
    return torch.cat([b, a])


def to_bfl(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A diffusers FluxTransformer2DModel state dict in the original BFL layout."""
    out: dict[str, torch.Tensor] = {}
    emb = {"timestep_embedder": "time_in", "text_embedder": "vector_in",
           "guidance_embedder": "guidance_in"}
    for k, v in sd.items():
        if k.startswith("time_text_embed."):
            _, part, lin, kind = k.split(".")
            out[f"{emb[part]}.{'in_layer' if lin == 'linear_1' else 'out_layer'}.{kind}"] = v
    simple = {"context_embedder": "txt_in", "x_embedder": "img_in", "proj_out": "final_layer.linear"}
    for kind in ("weight", "bias"):
        for src, dst in simple.items():
            out[f"{dst}.{kind}"] = sd[f"{src}.{kind}"]
        out[f"final_layer.adaLN_modulation.1.{kind}"] = _swap_halves(sd[f"norm_out.linear.{kind}"])
    n_double = len({k.split(".")[1] for k in sd if k.startswith("transformer_blocks.")})
    n_single = len({k.split(".")[1] for k in sd if k.startswith("single_transformer_blocks.")})
    for i in range(n_double):
        p, b = f"transformer_blocks.{i}.", f"double_blocks.{i}."
        for kind in ("weight", "bias"):
            pairs = {"norm1.linear": "img_mod.lin", "norm1_context.linear": "txt_mod.lin",
                     "ff.net.0.proj": "img_mlp.0", "ff.net.2": "img_mlp.2",
                     "ff_context.net.0.proj": "txt_mlp.0", "ff_context.net.2": "txt_mlp.2",
                     "attn.to_out.0": "img_attn.proj", "attn.to_add_out": "txt_attn.proj"}
            for src, dst in pairs.items():
                out[f"{b}{dst}.{kind}"] = sd[f"{p}{src}.{kind}"]
            out[f"{b}img_attn.qkv.{kind}"] = torch.cat(
                [sd[f"{p}attn.to_{x}.{kind}"] for x in "qkv"])
            out[f"{b}txt_attn.qkv.{kind}"] = torch.cat(
                [sd[f"{p}attn.add_{x}_proj.{kind}"] for x in "qkv"])
        for src, dst in {"norm_q": "img_attn.norm.query_norm", "norm_k": "img_attn.norm.key_norm",
                         "norm_added_q": "txt_attn.norm.query_norm",
                         "norm_added_k": "txt_attn.norm.key_norm"}.items():
            out[f"{b}{dst}.scale"] = sd[f"{p}attn.{src}.weight"]
    for i in range(n_single):
        p, b = f"single_transformer_blocks.{i}.", f"single_blocks.{i}."
        for kind in ("weight", "bias"):
            out[f"{b}modulation.lin.{kind}"] = sd[f"{p}norm.linear.{kind}"]
            out[f"{b}linear2.{kind}"] = sd[f"{p}proj_out.{kind}"]
            out[f"{b}linear1.{kind}"] = torch.cat(
                [sd[f"{p}{x}.{kind}"] for x in ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")])
        out[f"{b}norm.query_norm.scale"] = sd[f"{p}attn.norm_q.weight"]
        out[f"{b}norm.key_norm.scale"] = sd[f"{p}attn.norm_k.weight"]
    return {k: v.clone().contiguous() for k, v in out.items()}


def to_ldm_vae(sd: dict[str, torch.Tensor], n_blocks: int) -> dict[str, torch.Tensor]:
    """A diffusers AutoencoderKL state dict in the LDM/BFL `ae.safetensors` layout."""
    out = {}
    for k, v in sd.items():
        k2 = k.replace("conv_norm_out", "norm_out").replace("conv_shortcut", "nin_shortcut")
        k2 = k2.replace("mid_block.resnets.0", "mid.block_1").replace("mid_block.resnets.1",
                                                                       "mid.block_2")
        if "mid_block.attentions.0." in k2:
            k2 = k2.replace("mid_block.attentions.0.", "mid.attn_1.")
            for src, dst in (("group_norm", "norm"), ("to_q", "q"), ("to_k", "k"), ("to_v", "v"),
                             ("to_out.0", "proj_out")):
                k2 = k2.replace(f".{src}.", f".{dst}.")
            v = v[:, :, None, None] if v.ndim == 2 else v  # LDM uses 1x1 convs here
        if k2.startswith("encoder.down_blocks."):
            i = k2.split(".")[2]
            k2 = k2.replace(f"down_blocks.{i}.resnets.", f"down.{i}.block.").replace(
                f"down_blocks.{i}.downsamplers.0.", f"down.{i}.downsample.")
        if k2.startswith("decoder.up_blocks."):
            i = int(k2.split(".")[2])
            j = n_blocks - 1 - i
            k2 = k2.replace(f"up_blocks.{i}.resnets.", f"up.{j}.block.").replace(
                f"up_blocks.{i}.upsamplers.0.", f"up.{j}.upsample.")
        out[k2] = v.clone().contiguous()
    return out
