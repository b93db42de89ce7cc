"""A model of two denoisers its pipeline switches by timestep (Wan 2.2 A14B's experts), as one
module that core code trains, saves and places like any denoiser.

WanPipeline runs `transformer` (the high-noise expert) at the timesteps t >= boundary_ratio x
num_train_timesteps and `transformer_2` below. `Experts` holds both under those names (so
LoRA keys, optimizer state and checkpoints name each expert's weights apart) and routes each
row of a batch the same way: a training batch, whose times the run drew on one side of the
boundary (`train/experts.py`), runs one expert; a validation batch of mixed times runs each
row on its own. Off the CPU, only the expert that runs stays on the accelerator: the other
waits in host memory (a forward pre-hook on each expert moves them, so sampling through the
pipeline, which calls the experts directly, moves them too).
"""

from __future__ import annotations

from typing import Any

import torch

from difftune.families.specs import ExpertSpec


class Experts(torch.nn.Module):
    """The experts by pipeline part (`high`: the noisy one, then `low`), switched at `ratio`
    (the pipeline's boundary_ratio) of the scheduler's `timesteps` (num_train_timesteps)."""

    def __init__(self, high: str, low: str, modules: dict[str, torch.nn.Module],
                 ratio: float, timesteps: int) -> None:
        super().__init__()
        self.high, self.low = high, low
        self.ratio, self.timesteps = float(ratio), int(timesteps)
        for part in (high, low):
            self.add_module(part, modules[part])
            modules[part].register_forward_pre_hook(
                lambda _m, _a, _k, part=part: self.arrive(part), with_kwargs=True)
        self.device: torch.device | None = None  # None: the experts stay where they are
        self.resident: str | None = None

    @classmethod
    def of(cls, experts: tuple[ExpertSpec, ...], parts: dict[str, Any], ratio: float,
           timesteps: int) -> "Experts":
        """The experts a spec declares, from the loaded parts by pipeline name; `ratio` the
        pipeline's boundary_ratio, `timesteps` its scheduler's num_train_timesteps."""
        high = next(e.part for e in experts if e.noisy)
        low = next(e.part for e in experts if not e.noisy)
        return cls(high, low, {high: parts[high], low: parts[low]}, ratio, timesteps)

    @property
    def boundary(self) -> float:
        """The switch in the denoiser's timestep units, as the pipeline computes it."""
        return self.ratio * self.timesteps

    def expert(self, part: str) -> torch.nn.Module:
        """The expert in pipeline part `part`."""
        return self.get_submodule(part)

    @property
    def config(self) -> Any:
        """The high-noise expert's config (both share the architecture)."""
        return self.expert(self.high).config

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the experts' weights."""
        return self.expert(self.high).dtype

    def enable_gradient_checkpointing(self) -> None:
        """Gradient checkpointing in both experts."""
        for part in (self.high, self.low):
            self.expert(part).enable_gradient_checkpointing()

    def keep_one_on(self, device: torch.device) -> None:
        """From now on only the expert that runs keeps its weights on `device` (an
        accelerator): each arrives there as it is called, and the other's frozen weights
        leave for host memory. Both start in host memory."""
        self.device, self.resident = torch.device(device), None
        for part in (self.high, self.low):
            self.expert(part).to("cpu")

    def trained_to_device(self) -> None:
        """Put every trained parameter (both experts' LoRAs: a few MB) on the device for good,
        so their optimizer states live there too, whichever expert runs (called once the
        adapters are attached; a no-op on the CPU)."""
        if self.device is not None:
            _move(self, self.device, trained=True)

    def arrive(self, part: str) -> None:
        """Have expert `part` on the device and the other's frozen weights in host memory (a
        no-op on the CPU or when it is there already). Parameters keep their identity."""
        if self.device is None or self.resident == part:
            return
        other = self.low if part == self.high else self.high
        _move(self.expert(other), torch.device("cpu"), trained=False)
        self.expert(part).to(self.device)
        self.resident = part
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor,
                encoder_hidden_states: torch.Tensor, return_dict: bool = False,
                **kwargs: Any) -> tuple[torch.Tensor]:
        """Each row through the expert the pipeline would run at its timestep (one call per
        expert that has rows); returns the output as a one-tuple (`return_dict` False)."""
        noisy = timestep >= self.boundary
        if bool(noisy.all()) or not bool(noisy.any()):
            part = self.high if bool(noisy.all()) else self.low
            return (self.expert(part)(hidden_states=hidden_states, timestep=timestep,
                                      encoder_hidden_states=encoder_hidden_states,
                                      return_dict=False, **kwargs)[0],)
        outs, order = [], []
        for part, rows in ((self.high, noisy), (self.low, ~noisy)):
            at = rows.nonzero().flatten()
            outs.append(self.expert(part)(
                hidden_states=hidden_states[at], timestep=timestep[at],
                encoder_hidden_states=encoder_hidden_states[at], return_dict=False,
                **kwargs)[0])
            order.append(at)
        inverse = torch.argsort(torch.cat(order))
        return (torch.cat(outs)[inverse],)


def _move(module: torch.nn.Module, device: torch.device, trained: bool) -> None:
    """Move `module`'s trained parameters (`trained`), or its frozen parameters and buffers,
    to `device`, module by module as `Module.to` does (quantized tensor subclasses convert
    their own way); the others stay where they are."""
    for sub in module.modules():
        kept = {n: p for n, p in sub._parameters.items()
                if p is not None and p.requires_grad != trained}
        buffers = dict(sub._buffers) if trained else {}
        for name in kept:  # `_apply` skips None entries
            sub._parameters[name] = None
        for name in buffers:
            sub._buffers[name] = None
        try:
            sub._apply(lambda t: t.to(device), recurse=False)
        finally:
            sub._parameters.update(kept)
            sub._buffers.update(buffers)
