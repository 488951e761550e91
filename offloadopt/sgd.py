"""HybridSGD: ``torch.optim.SGD(fused=True)``'s math with its momentum buffers (and fp32 masters)
on the host for a chosen fraction of the params, on the machinery of :class:`HybridOptimizer`."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch

from offloadopt.optim import HybridOptimizer
from offloadopt.rules import SGD

if TYPE_CHECKING:  # the keywords of **options, for IDEs and type checkers
    from typing_extensions import Unpack

    from offloadopt.options import OffloadOptions

__all__ = ["HybridSGD"]


@functools.cache
def low_precision_fused_sgd_is_right() -> bool:
    """Whether this torch's fused CPU SGD updates bf16 tensors correctly: torch 2.13's skips
    every full SIMD block and fills momentum from memory it never wrote
    (tests/test_conformance.py found it). Two steps whose every value is exact in bf16."""
    p = torch.nn.Parameter(torch.ones(64, dtype=torch.bfloat16))
    opt = torch.optim.SGD([p], lr=0.25, momentum=0.5, fused=True)
    for _ in range(2):
        p.grad = torch.ones_like(p)
        opt.step()
    buf = opt.state[p]["momentum_buffer"]
    return torch.equal(p.detach(), torch.full_like(p, 0.375)) and torch.equal(
        buf, torch.full_like(p, 1.5)
    )


class HybridSGD(HybridOptimizer):
    """SGD with exactly the math of ``torch.optim.SGD(fused=True)`` (``torch._fused_sgd_``):
    momentum, dampening, Nesterov, weight decay, maximize. Its state is ``momentum_buffer``
    (made by a param's first update, as torch does) and, for bf16/fp16 params, the fp32
    master; there is no ``step``. Without momentum an fp32 param has no state at all, so there
    is nothing to offload: the placement table says "no state" for it. Checkpoints have
    ``torch.optim.SGD``'s layout (plus ``"master"``) and cross-load with it both ways.

    Args:
        params: tensors, ``named_parameters()`` or param-group dicts, as
            :class:`~offloadopt.HybridAdamW`'s.
        lr: the learning rate, as ``torch.optim.SGD``'s (a float or a 1-element Tensor).
        momentum: the momentum factor.
        dampening: dampening for momentum.
        weight_decay: L2 weight decay, added to the grad.
        nesterov: Nesterov momentum (needs a momentum and zero dampening).
        maximize: maximize the objective instead of minimizing it.
        foreach: accepted and ignored.
        differentiable: not supported (``NotImplementedError`` when True).
        fused: accepted and ignored (torch's fused kernel always runs).

    The offloading options (``offload_fraction=``, ``overlap=``, ...) are
    :class:`~offloadopt.HybridAdamW`'s, with the same types and defaults (the signature above),
    but ``delay_after`` > 0 (``ValueError``: SGD keeps no ``step`` to count by).

    Raises:
        ValueError, TypeError: a bad argument, named (Nesterov needs momentum and zero
            dampening); a group whose momentum is turned on or off after construction, at
            its next step.
        NotImplementedError: ``differentiable`` set; ``master_weights=False`` with bf16/fp16
            params on a torch whose fused CPU SGD gets them wrong (torch 2.13: the update
            would be silently wrong; the default fp32 masters are right).
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
        **options: Unpack[OffloadOptions],
    ):
        hyper = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                     nesterov=nesterov, maximize=maximize)  # fmt: skip
        super().__init__(
            params, hyper, differentiable=differentiable, foreach=foreach, fused=fused, **options
        )

    def _check_group(self, group: dict[str, Any]) -> None:
        if self.options.master_weights:
            return
        low = [p for p in group["params"] if p.dtype in (torch.bfloat16, torch.float16)]
        if low and not low_precision_fused_sgd_is_right():
            raise NotImplementedError(
                f"HybridSGD(master_weights=False) with {low[0].dtype} params: torch "
                f"{torch.__version__}'s fused CPU SGD updates such tensors wrongly; keep the "
                "default master_weights=True (fp32 masters, exact)"
            )
