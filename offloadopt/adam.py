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
        params, lr, betas, eps, weight_decay, maximize: as ``torch.optim.Adam``.
        **options: the offloading options of :class:`~offloadopt.HybridAdamW`
            (``offload_fraction``, ``min_offload_numel``, ``master_weights``, ``pin_memory``,
            ``bucket_nbytes``, ``flush_denormal``, ``cpu_threads``, ``timeout_s``, ``overlap``,
            ``wait``, ``max_grad_norm``, ``grads_final``, ``speculate``, ``release_grads``, ``grad_scaler``,
            ``delay_after``).

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
        betas: tuple[float, float] = (0.9, 0.999),
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
                         differentiable=differentiable, foreach=foreach, **options)  # fmt: skip
