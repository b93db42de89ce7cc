"""What diffusers' CosmosTransformer3DModel needs from torchvision, when torchvision is absent.

The transformer's forward resizes its padding mask with `torchvision.transforms.functional.
resize(..., InterpolationMode.NEAREST)` whenever `concat_padding_mask` is set (Anima's and
every Cosmos-Predict2 model's case), but diffusers 0.42.1 imports torchvision only if it is
installed and declares no dependency on it: without it the forward fails with
"name 'transforms' is not defined". difftune does not depend on torchvision (a CPU torch
cannot load the PyPI torchvision wheels), so the module gets the one function it calls: a
tensor resized to nearest neighbours, which is what torchvision does for tensors (its
`InterpolationMode.NEAREST` is torch's "nearest" interpolation). Where torchvision is
installed nothing is changed.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch


def _resize(image: torch.Tensor, size: list[int], interpolation: str = "nearest",
            **_: object) -> torch.Tensor:
    """`image` (…, H, W) resized to `size` by nearest neighbours (torchvision's tensor path)."""
    shape = image.shape
    flat = image.reshape(-1, 1, *shape[-2:])
    out = torch.nn.functional.interpolate(flat, size=list(size), mode=interpolation)
    return out.reshape(*shape[:-2], *out.shape[-2:])


def ensure_padding_mask_resize() -> None:
    """Give diffusers' Cosmos transformer module its `transforms` name where torchvision did
    not (see the module docstring); idempotent."""
    from diffusers.models.transformers import transformer_cosmos

    if hasattr(transformer_cosmos, "transforms"):
        return
    transformer_cosmos.transforms = SimpleNamespace(  # type: ignore[attr-defined]
        functional=SimpleNamespace(resize=_resize),
        InterpolationMode=SimpleNamespace(NEAREST="nearest"))
