"""Update rules: what an optimizer's state is and how one update runs, one entry per rule.

A rule is a small frozen object: the elementwise state keys it keeps per param, whether it
keeps a ``step`` counter, its hyperparameters with their defaults, the group flags torch's own
optimizer writes into its groups (so a checkpoint cross-loads into torch and keeps torch's fused
kernel), validation of those values, a snapshot of a group's values frozen once per step, and the
functional update over lists of same-device tensors. The update calls torch's own fused kernel;
it never re-derives the algorithm. The optimizer, the placement policy and the checkpoint code
ask the rule instead of spelling out a state schema.

:data:`ADAMW` is ``torch.optim.AdamW(fused=True)`` (``torch._fused_adamw_``, Loshchilov & Hutter,
"Decoupled Weight Decay Regularization", arXiv 1711.05101).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

# BLOCK: elements per block of the int8 moments (one fp32 scale per block), the formats' own
from offloadopt.kernels.formats import BLOCK

MOMENT_KEYS = ("exp_avg", "exp_avg_sq")  # Adam's state keys, as torch names them
# Adam's state keys under state_dtype="int8", in the kernel's order: codes shaped like the param
# (uint8) and their blocks' scales (fp32, ceil(numel / BLOCK))
INT8_KEYS = ("exp_avg_q", "exp_avg_scale", "exp_avg_sq_q", "exp_avg_sq_scale")

__all__ = [
    "BLOCK",
    "MOMENTS",
    "MOMENT_KEYS",
    "INT8_KEYS",
    "Hyper",
    "Rule",
    "AdamWRule",
    "AdamRule",
    "SGDRule",
    "ADAMW",
    "ADAM",
    "SGD",
    "check_number",
    "tensor_betas",
    "tensor_hyper_flags",
]


def _real(value: Any) -> bool:
    """A real number as torch's optimizers take one: a Python or numpy scalar (numpy registers
    its scalars as :class:`numbers.Real`; ``np.float32`` is not a ``float``), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_number(name: str, value: Any, lo: float, hi: float | None = None, hi_open=False) -> None:
    """Raise ``ValueError`` naming ``value`` unless it is a real number (not a bool) in range."""
    ok = _real(value) and value >= lo
    if ok and hi is not None:
        ok = value < hi if hi_open else value <= hi
    if not ok:
        raise ValueError(f"Invalid {name}: {value!r}")


@dataclass(frozen=True)
class Hyper:
    """A group's hyperparameters frozen for one step: nothing reads the live group dict after
    the step began (a scheduler's change takes effect at the next step; a worker thread never
    races the training thread over the dict).

    ``values`` maps each of the rule's hyperparameter names to its value at freeze time;
    ``lr_host`` is the learning rate as the host kernel takes it (a float, or a CPU tensor
    copied synchronously from a CUDA one).
    """

    values: MappingProxyType
    lr_host: float | torch.Tensor

    def __getitem__(self, key: str) -> Any:
        return self.values[key]


@dataclass(frozen=True)
class Rule:
    """One update rule. Subclasses set the fields and implement :meth:`validate` and
    :meth:`update`."""

    name: str
    state_keys: tuple[str, ...]  # elementwise state, shaped like the param, in kernel order
    has_step: bool  # keeps a per-param ``step`` counter (a 0-dim fp32 tensor)
    hyper_defaults: dict[str, Any] = field(default_factory=dict)  # the rule's hyperparameters
    torch_flags: dict[str, Any] = field(default_factory=dict)  # restored on every group
    refused_flags: tuple[str, ...] = ()  # torch options that change the state schema: refused
    # State keys that appear in ``opt.state`` only after a param's first update, as torch's SGD
    # adds ``momentum_buffer`` (the kernel's ``is_first_step`` initialises them).
    lazy_state: bool = False
    # How the state is stored (``state_dtype=``, ``master_weights="bf16-sr"``; the default is
    # torch's own representation and kernel): the moments in "fp32" (the update dtype), "bf16"
    # (stochastic rounding) or "int8" (block-wise codes and scales, offloadopt/kernels/formats.py);
    # ``master_sr``: bf16 params keep no fp32 master and are rounded stochastically.
    moments: str = "fp32"
    master_sr: bool = False
    flush_denormal: bool = True  # the compressed CPU kernel sets flush-to-zero in its threads

    @property
    def compressed(self) -> bool:
        """Whether the update is offloadopt's own kernel (a compressed representation) rather
        than torch's fused one."""
        return self.moments != "fp32" or self.master_sr

    def dtype_refusal(self, dtype: torch.dtype, label: str) -> str | None:
        """Why a param of ``dtype`` (``label`` names it) cannot be updated in this
        representation (offloadopt's kernel takes fp32, bf16 and fp16 weights, bf16-sr only
        bf16 ones), or None where it can: checked at construction and where a cast param is
        placed again, before anything changes."""
        if not self.compressed:
            return None
        if self.master_sr and dtype == torch.float16:
            return (f"master_weights='bf16-sr' rounds bf16 weights stochastically: {label} is "
                    "torch.float16 (give fp16 params fp32 masters, master_weights=True, or cast "
                    "the model to bf16)")  # fmt: skip
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return (f"compressed optimizer state (state_dtype={self.moments!r}, master_weights="
                    f"{'bf16-sr' if self.master_sr else True!r}) updates fp32, bf16 and fp16 "
                    f"params: {label} is {dtype} (torch's kernel, the default state_dtype='fp32' "
                    "and master_weights=True, updates it)")  # fmt: skip
        return None

    def state_keys_for(self, values: dict[str, Any]) -> tuple[str, ...]:
        """The state keys a group with these values keeps (SGD without momentum: none)."""
        return self.state_keys

    def key_dtype(self, key: str, update_dtype: torch.dtype) -> torch.dtype:
        """The dtype state ``key`` is stored in for params updated in ``update_dtype``."""
        return update_dtype

    def blockwise(self, key: str) -> bool:
        """Whether state ``key`` holds one value per block of :data:`BLOCK` elements of the
        param (a 1-D tensor of ``ceil(numel / BLOCK)``) rather than one per element (shaped
        like the param)."""
        return False

    def elem_bytes(self, values: dict[str, Any], update_dtype: torch.dtype) -> float:
        """Bytes of state per param element (the master aside), for the placement's sizes."""
        keys = self.state_keys_for(values)
        return sum(
            self.key_dtype(k, update_dtype).itemsize / (BLOCK if self.blockwise(k) else 1)
            for k in keys
        )

    def validate(self, values: dict[str, Any]) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def check_flags(self, group: dict[str, Any]) -> None:
        """Refuse torch's flags that would change the algorithm, as a group carries them (at
        construction, ``add_param_group`` and every step: torch's optimizer reads them at each
        step, so one set on a live group must not be ignored).

        Raises:
            NotImplementedError: a refused flag (``amsgrad``) set.
            ValueError: ``decoupled_weight_decay`` other than the rule's (AdamW's is decoupled,
                Adam's L2).
        """
        for flag in self.refused_flags:
            if group.get(flag):
                raise NotImplementedError(f"Hybrid{self.name} does not support {flag}=True yet")
        want = self.torch_flags.get("decoupled_weight_decay")
        have = group.get("decoupled_weight_decay", want)
        if want is not None and bool(have) != want:
            mine, other = (
                ("decoupled (AdamW's)", "Adam's L2")
                if want
                else ("L2 (Adam's)", "AdamW's decoupled")
            )
            raise ValueError(
                f"decoupled_weight_decay={have!r}: Hybrid{self.name}'s weight decay is always "
                f"{mine}; for {other} weight decay use offloadopt.Hybrid{'Adam' if want else 'AdamW'}"
            )

    def freeze(self, group: dict[str, Any]) -> Hyper:
        """Validate a group's current values and snapshot them (a tensor ``lr`` is cloned, so
        an in-place scheduler edit cannot reach an update in flight).

        Raises:
            ValueError, TypeError: a bad value, named in the message.
            NotImplementedError: a refused flag set on the group (:meth:`check_flags`).
        """
        self.check_flags(group)
        values = {k: group[k] for k in self.hyper_defaults}
        self.validate(values)
        lr = values.get("lr")
        lr_host = lr
        if isinstance(lr, torch.Tensor):
            values["lr"] = lr = lr.detach().clone()
            lr_host = lr if lr.device.type == "cpu" else lr.to("cpu")  # synchronous copy
        return Hyper(MappingProxyType(values), lr_host)

    def update(
        self, hyper: Hyper, weights, grads, states, steps, host: bool, first=False, amp=None
    ) -> None:
        """One update over lists of same-device tensors (``states`` in :meth:`state_keys_for`
        order, ``steps`` already advanced); ``host`` selects :attr:`Hyper.lr_host`; ``first``:
        these params' first update (for :attr:`lazy_state` rules); ``amp``: a GradScaler's
        ``grad_scale`` and ``found_inf`` for the kernel, on the tensors' device
        (offloadopt/step/amp.py), or None."""
        raise NotImplementedError  # pragma: no cover - abstract


MOMENTS = ("fp32", "bf16", "int8")  # the values of state_dtype=


def tensor_hyper_flags(hyper: dict[str, Any], *, foreach: bool | None, capturable: bool) -> None:
    """torch's refusal of Tensor hyperparameters with ``foreach=True`` (torch/optim/adam.py's
    constructor, in its order and words): a Tensor ``lr`` or ``betas[i]`` with ``foreach=True``
    and ``capturable=False``. Checked before the values, as torch does.

    Raises:
        ValueError: with torch's message.
    """
    if not foreach or capturable or "betas" not in hyper:  # torch's SGD has no such check
        return
    named = [("lr", hyper.get("lr"))]
    named += [(f"betas[{i}]", b) for i, b in enumerate(hyper.get("betas") or ())]
    for name, value in named:
        if isinstance(value, torch.Tensor):
            raise ValueError(
                f"{name} as a Tensor is not supported for capturable=False and foreach=True"
            )


def tensor_betas(hyper: dict[str, Any]) -> None:
    """torch's rule for ``betas`` of Adam and AdamW, after their ranges (the rule's check, which
    refuses a Tensor beta of more than one element): both numbers or both Tensors.

    Raises:
        ValueError: with torch/optim/adam.py's message.
    """
    betas = hyper.get("betas")
    if isinstance(betas, (tuple, list)):
        tensors = [isinstance(b, torch.Tensor) for b in betas]
        if any(tensors) and not all(tensors):
            raise ValueError("betas must be either both floats or both Tensors")


def _validate_adam_values(values: dict[str, Any]) -> None:
    lr = values["lr"]
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1:
            raise ValueError(f"Tensor lr must be 1-element, got shape {tuple(lr.shape)}")
        lr_value = float(lr.detach().cpu())
    elif _real(lr):
        lr_value = float(lr)
    else:
        raise TypeError(f"Invalid learning rate: {lr!r} (expected a float or a 1-element Tensor)")
    if not lr_value >= 0.0:
        raise ValueError(f"Invalid learning rate: {lr}")
    check_number("epsilon value", values["eps"], 0.0)
    wd = values["weight_decay"]
    if not _real(wd):
        raise TypeError(f"Invalid weight_decay value: {wd!r}")
    check_number("weight_decay value", wd, 0.0)
    betas = values["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"Invalid betas: {betas!r} (expected a pair)")
    for i, b in enumerate(betas):
        b = float(b) if isinstance(b, torch.Tensor) and b.numel() == 1 else b
        if not _real(b) or not 0.0 <= b < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {betas[i]!r}")
    if not isinstance(values["maximize"], bool):
        raise ValueError(f"Invalid maximize: {values['maximize']!r} (expected a bool)")


@dataclass(frozen=True)
class AdamWRule(Rule):
    """AdamW with decoupled weight decay: ``torch._fused_adamw_``, as ``torch.optim.AdamW(
    fused=True)`` calls it (torch/optim/adam.py, ``_fused_adam``)."""

    def validate(self, values: dict[str, Any]) -> None:
        """Raise ``ValueError``/``TypeError`` naming the bad value, as ``torch.optim.AdamW``."""
        _validate_adam_values(values)

    kernel = staticmethod(torch._fused_adamw_)
    decoupled = True  # weight decay applied to the weights (AdamW), not added to the grad

    def state_keys_for(self, values: dict[str, Any]) -> tuple[str, ...]:
        if self.moments == "int8":  # codes and their blocks' scales, in the kernel's order
            return INT8_KEYS
        return self.state_keys

    def key_dtype(self, key: str, update_dtype: torch.dtype) -> torch.dtype:
        if key.endswith("_q"):
            return torch.uint8
        if key.endswith("_scale"):
            return torch.float32
        if self.moments == "bf16":
            return torch.bfloat16
        # fp32 moments beside a bf16 master rounded stochastically; torch's: the update dtype
        return torch.float32 if self.compressed else update_dtype

    def blockwise(self, key: str) -> bool:
        return key.endswith("_scale")

    def update(
        self, hyper: Hyper, weights, grads, states, steps, host: bool, first=False, amp=None
    ) -> None:
        """torch's fused kernel (a compressed representation's update is offloadopt's own:
        :func:`offloadopt.kernels.adam.adam_update`, which the optimizer calls instead)."""
        if not weights:
            return
        exp_avgs, exp_avg_sqs = states
        beta1, beta2 = hyper["betas"]
        self.kernel(
            weights,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [],  # max_exp_avg_sqs: amsgrad is refused
            steps,
            amsgrad=False,
            lr=hyper.lr_host if host else hyper["lr"],
            beta1=float(beta1),
            beta2=float(beta2),
            weight_decay=hyper["weight_decay"],
            eps=hyper["eps"],
            maximize=hyper["maximize"],
            **(amp or {}),
        )


@dataclass(frozen=True)
class AdamRule(AdamWRule):
    """Adam with L2 weight decay added to the grad (never decoupled): ``torch._fused_adam_``,
    as ``torch.optim.Adam(fused=True)`` calls it (Kingma & Ba, arXiv 1412.6980)."""

    kernel = staticmethod(torch._fused_adam_)
    decoupled = False


def _validate_sgd_values(values: dict[str, Any]) -> None:
    lr = values["lr"]
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1:
            raise ValueError(f"Tensor lr must be 1-element, got shape {tuple(lr.shape)}")
        lr = float(lr.detach().cpu())
    check_number("learning rate", lr, 0.0)
    check_number("momentum value", values["momentum"], 0.0)
    check_number("dampening value", values["dampening"], float("-inf"))
    check_number("weight_decay value", values["weight_decay"], 0.0)
    for flag in ("nesterov", "maximize"):
        if not isinstance(values[flag], bool):
            raise ValueError(f"Invalid {flag}: {values[flag]!r} (expected a bool)")
    if values["nesterov"] and (values["momentum"] <= 0 or values["dampening"] != 0):
        raise ValueError("Nesterov momentum requires a momentum and zero dampening")


@dataclass(frozen=True)
class SGDRule(Rule):
    """SGD with momentum, dampening, Nesterov, weight decay and maximize: ``torch._fused_sgd_``,
    as ``torch.optim.SGD(fused=True)`` calls it (torch/optim/sgd.py, ``_fused_sgd``). No
    ``step``; ``momentum_buffer`` only with momentum, created by a param's first update."""

    def state_keys_for(self, values: dict[str, Any]) -> tuple[str, ...]:
        return self.state_keys if values.get("momentum", 0) != 0 else ()

    def validate(self, values: dict[str, Any]) -> None:
        """Raise ``ValueError`` naming the bad value, as ``torch.optim.SGD``."""
        _validate_sgd_values(values)

    def update(
        self, hyper: Hyper, weights, grads, states, steps, host: bool, first=False, amp=None
    ) -> None:
        if not weights:
            return
        torch._fused_sgd_(
            weights,
            grads,
            states[0] if states else [],  # momentum_buffer_list; none without momentum
            weight_decay=hyper["weight_decay"],
            momentum=hyper["momentum"],
            lr=hyper.lr_host if host else hyper["lr"],
            dampening=hyper["dampening"],
            nesterov=hyper["nesterov"],
            maximize=hyper["maximize"],
            is_first_step=bool(first and states),
            **(amp or {}),
        )


# torch's Adam and AdamW group flags but decoupled_weight_decay (restored on every group).
_ADAM_FLAGS = dict(amsgrad=False, foreach=None, capturable=False, differentiable=False, fused=True)

ADAMW = AdamWRule(
    name="AdamW",
    state_keys=MOMENT_KEYS,
    has_step=True,
    hyper_defaults=dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, maximize=False),
    torch_flags=dict(_ADAM_FLAGS, decoupled_weight_decay=True),
    refused_flags=("amsgrad",),
)

ADAM = AdamRule(
    name="Adam",
    state_keys=MOMENT_KEYS,
    has_step=True,
    hyper_defaults=dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, maximize=False),
    torch_flags=dict(_ADAM_FLAGS, decoupled_weight_decay=False),
    refused_flags=("amsgrad", "decoupled_weight_decay"),
)

SGD = SGDRule(
    name="SGD",
    state_keys=("momentum_buffer",),
    has_step=False,
    hyper_defaults=dict(
        lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False
    ),  # fmt: skip
    torch_flags=dict(foreach=None, differentiable=False, fused=True),
    lazy_state=True,
)
