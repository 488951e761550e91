"""HybridAdam: ``torch.optim.Adam(fused=True)``'s math (L2 weight decay added to the grad) with a
chosen fraction of its state on the host, on the machinery of :class:`HybridOptimizer`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from offloadopt.optim import HybridOptimizer
from offloadopt.rules import ADAM

if TYPE_CHECKING:  # the keywords of **options, for IDEs and type checkers
    from typing_extensions import Unpack

    from offloadopt.options import OffloadOptions

__all__ = ["HybridAdam"]


class HybridAdam(HybridOptimizer):
    """Adam with exactly the math of ``torch.optim.Adam(fused=True)`` (``torch._fused_adam_``):
    ``weight_decay`` is L2, added to the grad before the moments, never decoupled (that is
    :class:`~offloadopt.HybridAdamW`). The timeline, memory per parameter and caveats are
    :class:`~offloadopt.HybridAdamW`'s; checkpoints have ``torch.optim.Adam``'s layout (plus
    ``"master"``) and cross-load with it both ways.

    Args:
        params: tensors, ``named_parameters()`` or param-group dicts, as
            :class:`~offloadopt.HybridAdamW`'s.
        lr: the learning rate, as ``torch.optim.Adam``'s (a float or a 1-element Tensor).
        betas: the moments' coefficients (both floats or both 1-element Tensors).
        eps: added to the denominator.
        weight_decay: L2 weight decay, added to the grad.
        amsgrad: not supported (``NotImplementedError`` when True).
        foreach: accepted and ignored, checked as torch checks it.
        maximize: maximize the objective instead of minimizing it.
        capturable: not supported (``NotImplementedError`` when True).
        differentiable: not supported (``NotImplementedError`` when True).
        fused: accepted and ignored (torch's fused kernel always runs).
        decoupled_weight_decay: True is AdamW: ``ValueError`` (use HybridAdamW).

    The offloading options (``offload_fraction=``, ``overlap=``, ...) are
    :class:`~offloadopt.HybridAdamW`'s, with the same types and defaults (the signature above).

    Raises:
        ValueError, TypeError: a bad argument, named; ``decoupled_weight_decay=True`` (use
            HybridAdamW).
        NotImplementedError: ``amsgrad``, ``capturable`` or ``differentiable`` set.
    """

    rule = ADAM

    def __init__(
        self,
        params,
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float | torch.Tensor, float | torch.Tensor] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        foreach: bool | None = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        decoupled_weight_decay: bool = False,
        **options: Unpack[OffloadOptions],
    ):
        if decoupled_weight_decay:
            raise ValueError(
                "HybridAdam(decoupled_weight_decay=True) is AdamW: use offloadopt.HybridAdamW"
            )
        hyper = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, maximize=maximize)
        super().__init__(params, hyper, amsgrad=amsgrad, capturable=capturable,
                         differentiable=differentiable, foreach=foreach, fused=fused, **options)  # fmt: skip
