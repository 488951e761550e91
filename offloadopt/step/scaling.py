"""What multiplies the grads before the update: clipping through the optimizer
(``max_grad_norm``, ``clip_grad_norm_``) and a GradScaler's scale and found_inf (offloadopt/step/amp.py's
note). :class:`Scaling` owns the clip decision of each step and the GradScaler's inputs to it."""

from __future__ import annotations

import torch

from offloadopt.shards import is_dtensor
from offloadopt.step.amp import AmpInputs, inverse
from offloadopt.step.step import Step, Timeline

__all__ = ["Scaling"]


class Scaling:
    """The clip and the GradScaler of :class:`offloadopt.optim.HybridOptimizer`'s steps.

    Args:
        max_grad_norm: clip every step's grads to this global L2 norm inside the update (a
            finite float > 0), or None (no clip through the optimizer, unless
            ``clip_grad_norm_`` asks for one step).
        grad_scaler: the attached ``torch.amp.GradScaler`` (``grad_scaler=``), or None.
        timeline: the optimizer's :class:`offloadopt.step.step.Timeline`: its lock, the step
            being fed, and ``refuse(why)``; its ``name`` (the optimizer's class) for messages.
        optimizer_id: ``id()`` of the optimizer, the key of a GradScaler's per-optimizer
            records (``check_scaler``).

    Owns ``pending_clip`` (``(norm, coefficient)`` from ``clip_grad_norm_``, for the next step,
    0-dim fp32 tensors on the params' device) and ``last_grad_norm`` (``max_grad_norm``: the
    last step's norm, a 0-dim fp32 tensor on the device; None before the first clip).
    """

    def __init__(self, max_grad_norm: float | None, grad_scaler, timeline: Timeline,
                 optimizer_id: int):  # fmt: skip
        self.max_grad_norm = max_grad_norm
        self.grad_scaler = grad_scaler
        self.timeline = timeline
        self.optimizer_id = optimizer_id
        self.pending_clip: tuple[torch.Tensor, torch.Tensor] | None = None
        self.last_grad_norm: torch.Tensor | None = None

    def clip_grad_norm_(self, max_norm: float, params: list[torch.Tensor]) -> torch.Tensor:
        """``opt.clip_grad_norm_(max_norm)`` (its docstring has the contract) over ``params``,
        the params that have a grad, in group order: the norm and coefficient become
        ``pending_clip``, taken by the next step. Returns the norm (0-dim fp32, the params'
        device).

        Raises:
            ValueError: ``max_norm`` is not a finite number > 0.
            RuntimeError: ``max_grad_norm`` is set, a GradScaler is attached, or this step's
                updates already started.
        """
        if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not 0 < max_norm < float("inf"):  # fmt: skip
            raise ValueError(f"Invalid max_norm: {max_norm!r} (expected a finite number > 0)")
        if self.max_grad_norm is not None:
            raise RuntimeError(
                f"built with max_grad_norm={self.max_grad_norm}: it clips every step already"
            )
        if self.grad_scaler is not None:
            # A fresh user's finding: the norm was taken of the scaled grads (scaler.step()
            # unscales later), so the clip was the scale times too strong, silently.
            raise RuntimeError(
                "opt.clip_grad_norm_() with grad_scaler= attached: the grads are still scaled "
                "here (the attached scaler is never unscale_'d), so their norm would be the "
                "scale times too large; build the optimizer with max_grad_norm= instead, which "
                "clips the unscaled grads inside step()"
            )
        with self.timeline.lock:
            if self.timeline.current is not None and self.timeline.current.fed:
                raise RuntimeError(
                    "updates of this step already started from the unclipped grads "
                    "(grads_final=True): clip with max_grad_norm= instead"
                )
            norm, scale = self.norm_and_scale(params, float(max_norm))
            self.pending_clip = (norm, scale)
            return norm

    def check_scaler(self, st: Step, grad_scale, scaler_inf) -> None:
        """Updates begun before ``step()`` must have used the scale of the GradScaler that is
        stepping this optimizer now (amp.py's note); otherwise the step is refused.

        Raises:
            RuntimeError: an unattached scaler after updates started (grads_final or
                max_grad_norm in backward mode), or a scaler other than the attached one.
        """
        if not st.fed or (grad_scale is None and scaler_inf is None):
            return
        if st.amp is None and grad_scale is not None:
            self.timeline.refuse("its updates started from grads a GradScaler had scaled")
            why = (
                "max_grad_norm= clipped them"
                if self.max_grad_norm is not None
                else "grads_final=True"
            )
            other = ("or clip with torch after scaler.unscale_(opt) and leave max_grad_norm out"
                     if self.max_grad_norm is not None else "or leave grads_final=False")  # fmt: skip
            raise RuntimeError(
                f"updates of this step started during backward ({why}) from the scaled grads, "
                "and a GradScaler's step() came after them: attach the scaler, "
                f"{self.timeline.name}(..., grad_scaler=scaler), {other}"
            )
        records = getattr(self.grad_scaler, "_per_optimizer_states", None)
        if (
            st.amp is not None
            and hasattr(records, "get")
            and records.get(self.optimizer_id) is None
        ):
            # the attached scaler keeps a record of this optimizer while it steps it
            self.timeline.refuse("its updates started with the attached GradScaler's scale")
            raise RuntimeError(
                "a GradScaler other than the attached one (grad_scaler=) is stepping this "
                "optimizer, whose updates already started with the attached one's scale: "
                "attach the scaler that scales the loss and calls step()"
            )

    def attached_scale(self) -> torch.Tensor | None:
        """The scale of the attached GradScaler (``grad_scaler=``) while it scales losses."""
        scaler = self.grad_scaler
        if scaler is None or not scaler.is_enabled():
            return None
        return getattr(scaler, "_scale", None)  # None before its first scale()

    def starts_at_end(self) -> bool:
        """Backward mode's updates start at the end of backward, all at once: a clip or a
        GradScaler's found_inf needs every grad (start.py's note)."""
        return self.max_grad_norm is not None or self.attached_scale() is not None

    def norm_and_scale(self, params: list[torch.Tensor], max_norm: float, inv=None):
        """Global L2 norm of ``params``' grads (times ``inv``, a GradScaler's inverse scale,
        when given) and torch's clip coefficient, on the device."""
        if not params:
            zero = torch.zeros((), dtype=torch.float32)
            return zero, torch.ones((), dtype=torch.float32)
        device = params[0].grad.device
        sharded = [p.grad for p in params if is_dtensor(p.grad)]
        if sharded:
            # FSDP2: the same DTensor arithmetic as torch's clip_grad_norm_ (per-shard norms,
            # their norm, then one all-reduce over the mesh in full_tensor()): every rank gets
            # the global norm. Params outside FSDP2 (plain) join through one more norm.
            # torch 2.14's DTensor rule for _foreach_norm fails on a dtype= argument ("'>='
            # not supported between 'torch.dtype' and 'int'"), so fp32 grads go without it
            # (the same bits: the norm of fp32 is fp32) and others are upcast first. One
            # foreach norm, as the plain path below: one rank of FSDP2 stays bitwise the
            # single-GPU path on CUDA too (one vector_norm per grad was not:
            # tests/cuda/test_fsdp_cuda.py).
            fp32 = [g if g.dtype == torch.float32 else g.float() for g in sharded]
            norms = torch._foreach_norm(fp32, 2)
            norm = torch.linalg.vector_norm(torch.stack(list(norms))).full_tensor().to(device)
            plain = [p.grad for p in params if not is_dtensor(p.grad)]
            if plain:
                rest = torch._foreach_norm(plain, 2, dtype=torch.float32)
                rest = torch.linalg.vector_norm(torch.stack([n.to(device) for n in rest]))
                norm = torch.linalg.vector_norm(torch.stack([norm, rest]))
        else:
            norms = torch._foreach_norm([p.grad for p in params], 2, dtype=torch.float32)
            norm = torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]))
        if inv is not None:
            norm = norm * inv.to(norm.device)  # the unscaled grads' norm (amp.py's note)
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # torch's clip_grad_norm_
        return norm, scale

    def clip(self, st: Step, params: list[torch.Tensor], max_norm: float, inv=None) -> None:
        """Set ``st.norm`` (the global norm of ``params``' grads in group order, unscaled by
        ``inv`` when given) and ``st.scale`` (the clip factors); the norm becomes
        ``last_grad_norm``."""
        have = set(params)
        order = [p for p in st.group_of if p in have]  # group order: fixed
        st.norm, coef = self.norm_and_scale(order, max_norm, inv)
        st.scale = coef if inv is None else (inv, coef)  # unscale first, as torch's order
        self.last_grad_norm = st.norm

    def decide(self, st: Step, params: list[torch.Tensor], grad_scale, inf) -> None:
        """This step's clip factors (``st.scale``: ``max_grad_norm``'s coefficient, after the
        inverse scale with a GradScaler) and GradScaler inputs (``st.amp``); amp.py's note."""
        if self.max_grad_norm is not None:
            inv = None if grad_scale is None else inverse(grad_scale)
            self.clip(st, params, self.max_grad_norm, inv)
            grad_scale = None  # unscaled on the device, before the coefficient
        if grad_scale is not None or inf is not None:
            st.amp = AmpInputs(grad_scale, inf)

    def at_step(self, st: Step, params: list[torch.Tensor], grad_scale, inf) -> None:
        """Inside ``step()``, with ``params`` the params with a grad and ``grad_scale``,
        ``inf`` a GradScaler's values for this call (None each when none set them): this
        step's factors, unless the end of backward decided them; ``pending_clip`` is taken.
        First, updates begun in backward must have used this scaler's scale
        (:meth:`check_scaler`).

        Raises:
            RuntimeError: as :meth:`check_scaler`.
        """
        self.check_scaler(st, grad_scale, inf)
        scaled = grad_scale is not None or inf is not None
        # Nothing decided at the end of backward (or decided there without the scaler's
        # values, and nothing started): this step's clip factors and scaling, now.
        if st.amp is None and (st.scale is None or (scaled and not st.fed)):
            if self.max_grad_norm is None and self.pending_clip is not None:
                st.norm, st.scale = self.pending_clip
            self.decide(st, params, grad_scale, inf)
        self.pending_clip = None
