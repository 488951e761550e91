"""One optimizer step of the main job over its micro-batches (:func:`train_step`), and the same
forward and backward without the optimizer (:func:`fwd_bwd`), which ``--measure-fwd-bwd``
times so that a run reads its step against its forward+backward.

Gradient accumulation (``--grad-accum N``): a step's N micro-batches each run forward and
backward on their loss divided by N, so the grads that reach the optimizer are those of the mean
loss over the step's tokens (every micro-batch has the same shape). The first N - 1 run inside
``opt.accumulating()`` (HybridAdamW: their grads stay on the device and no update starts; the
last backward announces them, as one backward would) and, under DDP, ``model.no_sync()`` (one
all-reduce a step, after the last backward).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from offloadopt.harness.delayed import DelayedSchedule

__all__ = ["train_step", "fwd_bwd"]

Batches = list[tuple[torch.Tensor, torch.Tensor]]  # a step's micro-batches: (x, y) each


def _micro_step(model: torch.nn.Module, opt, *, accumulating: bool, sync: bool):
    """The context of one micro-batch's forward and backward: ``opt.accumulating()`` where the
    optimizer has it (torch's optimizers need no marker), and DDP's ``no_sync()`` (it must hold
    the forward too: DDP reads it there) unless ``sync``."""
    stack = contextlib.ExitStack()
    if accumulating and hasattr(opt, "accumulating"):
        stack.enter_context(opt.accumulating())
    if not sync and hasattr(model, "no_sync"):
        stack.enter_context(model.no_sync())
    return stack


def _forward_backward(model, opt, batches: Batches, last_is_final: bool) -> torch.Tensor:
    """Forward and backward of every micro-batch, the loss divided by their number; the last
    outside ``opt.accumulating()`` when ``last_is_final``. Returns the step's loss (the sum of
    the divided losses, in order: the mean), detached, 0-dim fp32 on the device."""
    n = len(batches)
    total = None
    for i, (x, y) in enumerate(batches):
        last = i == n - 1
        with _micro_step(model, opt, accumulating=not (last and last_is_final), sync=last):
            _, loss = model(x, y)
            if n > 1:
                loss = loss / n  # the mean over the step's micro-batches (N = 1: unchanged)
            loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
    return total


def train_step(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    batches: Batches,
    grad_clip: float = 1.0,
    before_step: DelayedSchedule | None = None,
) -> torch.Tensor:
    """One optimizer step: forward and backward of each of ``batches`` (accumulated, see the
    module docstring), optional grad clipping (torch's, unless the optimizer clips:
    ``max_grad_norm``), ``opt.step()`` and ``zero_grad``. ``before_step``: its ``publish()``
    runs just before ``opt.step()`` (:class:`~offloadopt.harness.delayed.DelayedSchedule`).

    ``batches``: the step's micro-batches, each ``(x, y)`` of (batch, seq) int64 on the model's
    device. Returns the detached 0-dim fp32 loss of the step (the mean over its micro-batches)
    on the device: this function adds no host sync and no device-to-host copy of its own
    (``.item()`` would show as a pageable D2H copy in a profile); the optimizer may sync.
    """
    loss = _forward_backward(model, opt, batches, last_is_final=True)
    if grad_clip > 0 and getattr(opt, "max_grad_norm", None) is None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)  # stays on the device
    if before_step is not None:
        before_step.publish()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def fwd_bwd(model: torch.nn.Module, opt: torch.optim.Optimizer, batches: Batches) -> None:
    """:func:`train_step`'s forward and backward alone: every micro-batch inside
    ``opt.accumulating()`` (HybridAdamW starts no update and frees no grad), the grads kept
    until the end, then dropped (``model.zero_grad``); no clipping, no ``opt.step()``: the
    model's weights and the optimizer's state do not change."""
    _forward_backward(model, opt, batches, last_is_final=False)
    model.zero_grad(set_to_none=True)
