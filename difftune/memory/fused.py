"""Fused backward pass: AdamW steps each parameter inside backward and frees its gradient.

A parameter's gradient is complete as soon as autograd has accumulated it; stepping the
parameter right then and dropping the gradient means the gradients of all trainable
parameters never exist at the same time, which saves their whole size at the peak.
"""

from __future__ import annotations

from typing import Any, Callable

import torch


class FusedAdamW(torch.optim.AdamW):
    """AdamW whose step runs per parameter during backward, once `attach()`ed.

    Each parameter's update is AdamW's own (its group narrowed to that one parameter for the
    call), so `state`, `state_dict()` / `load_state_dict()` and LR schedulers that change
    `group["lr"]` behave as with AdamW; a state dict moves freely between the two classes.

    Limits, which the caller must refuse: no gradient accumulation over several backward calls
    (every backward steps), no global gradient-norm clipping (no gradient outlives its own
    step), and no fp16 GradScaler (it unscales and skips steps after backward). Optimizer step
    hooks, if any are registered on AdamW, fire once per parameter.
    """

    def __init__(self, params: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(params, *args, **kwargs)
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._group_of: dict[torch.Tensor, dict[str, Any]] = {}
        # Clip each gradient to this norm before its step (no global norm exists yet: the
        # other gradients are not computed, or already freed); None: no clipping.
        self.clip: float | None = None

    def attach(self) -> None:
        """Step each trainable parameter from a hook once its gradient is accumulated."""
        if self._handles:
            return
        self._group_of = {p: g for g in self.param_groups for p in g["params"]}
        for p in self._group_of:
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._step_one))

    def detach(self) -> None:
        """Back to plain AdamW: gradients are kept and `step()` applies them."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    @property
    def attached(self) -> bool:
        """Whether the per-parameter hooks are in place."""
        return bool(self._handles)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """AdamW's step when detached; when attached the hooks already stepped: nothing to do
        but run the closure (whose backward steps) and return its loss."""
        if not self._handles:
            return super().step(closure)
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def _step_one(self, p: torch.Tensor) -> None:
        """AdamW's update of `p` alone, with its group's current settings; then free its grad."""
        if self.clip is not None:
            torch.nn.utils.clip_grad_norm_([p], self.clip)
        groups = self.param_groups
        self.param_groups = [{**self._group_of[p], "params": [p]}]
        try:
            super().step()
        finally:
            self.param_groups = groups
        p.grad = None
