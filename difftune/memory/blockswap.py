"""Block swap: only some transformer blocks' frozen weights live on the accelerator.

The last `count` blocks of the denoiser keep their frozen tensors (weights, buffers) on the host;
each is copied to the accelerator just before it runs, the following block is copied ahead on a
side stream while the current one computes, and the copies are dropped again after use. LoRA
weights (trainable) never move: they stay on the accelerator, same objects, so the optimizer
keeps working on them.

Swapping replaces the entries of `module._parameters` / `module._buffers` (the host tensor is the
canonical object, the device copy a fresh tensor) instead of assigning `.data`, so it works for
tensor subclasses (torchao quantized weights) and float8 storage alike, and a copy dropped by the
module stays alive exactly as long as autograd still needs it.

Why the block order matters: with (non-reentrant) gradient checkpointing, backward recomputes the
blocks in reverse order and their forward hooks fire again, so the swapper watches which block runs
and prefetches backwards during backward. Without checkpointing autograd keeps the copies it saved
for backward alive until the backward of their block, so results stay right but little memory is
saved: block swap is meant to go with gradient checkpointing (or with sampling under no_grad).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

log = logging.getLogger("difftune")


@dataclass
class _Slot:
    """One frozen tensor of a swapped block: where it lives and its canonical host copy."""

    module: torch.nn.Module
    table: str  # "_parameters" or "_buffers"
    name: str
    host: torch.Tensor


def _plain_tensors(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """The plain tensors holding the storage of `t` (the inner tensors of a wrapper subclass)."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        for name in names:
            yield from _plain_tensors(getattr(t, name))
    else:
        yield t


class BlockSwap:
    """Streams the frozen weights of the last `count` blocks to `device` as they are needed.

    `blocks` are the denoiser's transformer blocks in execution order (FLUX:
    `[*m.transformer_blocks, *m.single_transformer_blocks]`). At most two swapped blocks hold
    device copies at a time (the one running and the one being prefetched), plus whatever copies
    autograd still keeps for backward. When block 0 itself is swapped, blocks 0 and 1 stay
    loaded after a checkpointed backward (block 0's recompute counts as a new forward and
    prefetches block 1): the next forward starts with them. Not for torch.compile'd models;
    bitsandbytes Params4bit weights are not supported (the device copy is a plain Parameter).
    """

    def __init__(self, blocks: Sequence[torch.nn.Module], count: int, device: torch.device,
                 pin: bool = True) -> None:
        self.blocks = list(blocks)
        if not 0 <= count <= len(self.blocks):
            raise ValueError(f"block swap count must be between 0 and {len(self.blocks)} (the "
                             f"number of transformer blocks), got {count}")
        self.count = count
        self.first = len(self.blocks) - count  # index of the first swapped block
        self.device = torch.device(device)
        self.pin = pin and self.device.type == "cuda"
        self._slots: dict[int, list[_Slot]] = {}
        self._copies: dict[int, list[torch.Tensor]] = {}  # loaded block -> its device tensors
        self._events: dict[int, Any] = {}  # prefetched block -> CUDA event ending its copy
        self._stream: Any = None
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._prev: int | None = None
        self._pin_warned = False

    # ---- set-up -------------------------------------------------------------------------

    def install(self, model: torch.nn.Module) -> None:
        """Place `model` on the device except the swapped blocks' frozen tensors, and hook it.

        Works module by module, so the model (normally loaded on the CPU) never has to fit on
        the accelerator whole. Trainable parameters go to the device as `Module.to` moves them:
        the Parameter objects stay the same.
        """
        if self._handles:
            raise RuntimeError("BlockSwap is already installed; remove() it first")
        for i in range(self.first, len(self.blocks)):
            self._slots[i] = self._host_slots(self.blocks[i])
        self._move_rest(model)
        if self.count == 0:
            return
        if self.device.type == "cuda":
            self._stream = torch.cuda.Stream(device=self.device)
        for i, block in enumerate(self.blocks):
            self._handles.append(block.register_forward_pre_hook(
                lambda _m, _a, i=i: self._before(i)))
            if i >= self.first:
                self._handles.append(block.register_forward_hook(
                    lambda _m, _a, _o, i=i: self._release(i)))

    def remove(self) -> None:
        """Remove the hooks; swapped blocks are left with their host tensors (move the model
        to the device before running it there again)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for i in self.loaded():
            self._release(i)
        self._prev = None

    def loaded(self) -> list[int]:
        """Indices (into `blocks`) of the swapped blocks now holding device copies."""
        return sorted(self._copies)

    def _host_slots(self, block: torch.nn.Module) -> list[_Slot]:
        """Put the block's frozen tensors on the host (pinned if asked) and list them."""
        slots = []
        for module in block.modules():
            for table in ("_parameters", "_buffers"):
                entries = getattr(module, table)
                for name, t in list(entries.items()):
                    if t is None or (table == "_parameters" and t.requires_grad):
                        continue
                    host = self._to_host(t)
                    if host is not t and table == "_parameters":
                        host = torch.nn.Parameter(host, requires_grad=False)
                    entries[name] = host
                    slots.append(_Slot(module, table, name, host))
        return slots

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        """`t` on the CPU, in page-locked memory when pinning is on and possible."""
        host = t if t.device.type == "cpu" else t.detach().to("cpu")
        if not self.pin:
            return host
        try:
            return host if host.is_pinned() else host.detach().pin_memory()
        except Exception as exc:  # noqa: BLE001 - pinning is only a speed-up: any failure
            # (no page-locked memory left, a tensor subclass without pin_memory) falls back.
            if not self._pin_warned:
                log.warning("block swap: cannot pin host memory (%s); swapped weights stay in "
                            "pageable memory, so their copies are slower", exc)
                self._pin_warned = True
            return host

    def _move_rest(self, model: torch.nn.Module) -> None:
        """Move every tensor of `model` but the swapped frozen ones to the device, per module."""
        hidden: dict[int, list[_Slot]] = {}
        for slots in self._slots.values():
            for slot in slots:
                hidden.setdefault(id(slot.module), []).append(slot)
        for module in model.modules():
            mine = hidden.get(id(module), [])
            for slot in mine:  # `_apply` skips None entries
                getattr(module, slot.table)[slot.name] = None
            try:
                # The same per-module conversion as `Module.to` (trainable Parameters keep
                # their identity; quantized Parameter subclasses convert their own way).
                module._apply(lambda t: t.to(self.device), recurse=False)
            finally:
                for slot in mine:
                    getattr(module, slot.table)[slot.name] = slot.host

    # ---- hooks ----------------------------------------------------------------------------

    def _before(self, i: int) -> None:
        """Pre-hook of block i: have it loaded, prefetch the next swapped block, drop the rest."""
        forward = i == 0 or self._prev is None or i > self._prev
        self._prev = i
        nxt = i + 1 if forward else i - 1
        ahead = nxt if self.first <= nxt < len(self.blocks) else None
        for j in self.loaded():
            if j != i and j != ahead:
                self._release(j)
        if i >= self.first:
            self._ensure(i)
        if ahead is not None and ahead not in self._copies:
            self._prefetch(ahead)

    def _ensure(self, i: int) -> None:
        """Block i's device copies, ready for the current stream (waits for a prefetch)."""
        if i not in self._copies:
            self._load(i)
            return
        event = self._events.pop(i, None)
        if event is None:
            return
        current = torch.cuda.current_stream(self.device)
        current.wait_event(event)
        # The copies were allocated on the side stream: tell the caching allocator that the
        # compute stream uses them, so their memory is not handed out again too early.
        for t in self._copies[i]:
            for plain in _plain_tensors(t):
                plain.record_stream(current)

    def _prefetch(self, i: int) -> None:
        """Start copying block i to the device: on the side stream on CUDA, else right now."""
        if self._stream is None:
            self._load(i)
            return
        with torch.cuda.stream(self._stream):
            self._load(i)
            event = torch.cuda.Event()
            event.record(self._stream)
        self._events[i] = event

    def _load(self, i: int) -> None:
        """Put device copies of block i's frozen tensors into its modules (current stream)."""
        copies = []
        for slot in self._slots[i]:
            dev = slot.host.to(self.device, non_blocking=True, copy=True)
            if slot.table == "_parameters":
                dev = torch.nn.Parameter(dev, requires_grad=False)
            getattr(slot.module, slot.table)[slot.name] = dev
            copies.append(dev)
        self._copies[i] = copies

    def _release(self, i: int) -> None:
        """Give block i its host tensors back; autograd keeps any copy it saved alive."""
        if self._copies.pop(i, None) is None:
            return
        self._events.pop(i, None)
        for slot in self._slots[i]:
            getattr(slot.module, slot.table)[slot.name] = slot.host
