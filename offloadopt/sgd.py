"""HybridSGD: ``torch.optim.SGD(fused=True)``'s math with its momentum buffers (and fp32 masters)
on the host for a chosen fraction of the params, on the machinery of :class:`HybridOptimizer`."""

from __future__ import annotations

from typing import Any

import torch

from offloadopt.optim import HybridOptimizer
from offloadopt.rules import SGD

__all__ = ["HybridSGD"]


class HybridSGD(HybridOptimizer):
    """SGD with exactly the math of ``torch.optim.SGD(fused=True)`` (``torch._fused_sgd_``):
    momentum, dampening, Nesterov, weight decay, maximize. Its state is ``momentum_buffer``
    (made by a param's first update, as torch does) and, for bf16/fp16 params, the fp32
    master; there is no ``step``. Without momentum an fp32 param has no state at all, so there
    is nothing to offload: the placement table says "no state" for it. Checkpoints have
    ``torch.optim.SGD``'s layout (plus ``"master"``) and cross-load with it both ways.

    Args:
        params, lr, momentum, dampening, weight_decay, nesterov, maximize: as
            ``torch.optim.SGD``.
        **options: the offloading options of :class:`~offloadopt.HybridAdamW`.

    Raises:
        ValueError, TypeError: a bad argument, named (Nesterov needs momentum and zero
            dampening); a group whose momentum is turned on or off after construction, at
            its next step.
        NotImplementedError: ``differentiable`` set.
    """

    rule = SGD

    def __init__(
        self,
        params,
        lr: float | torch.Tensor = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        differentiable: bool = False,
        fused: bool | None = None,
        **options: Any,
    ):
        hyper = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                     nesterov=nesterov, maximize=maximize)  # fmt: skip
        super().__init__(params, hyper, differentiable=differentiable, **options)
