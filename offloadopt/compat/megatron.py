"""``HybridDeviceOptimizer`` with Megatron-Core's constructor and placement, standalone.

Megatron-Core's ``HybridDeviceOptimizer`` (megatron/core/optimizer/cpu_offloading/
hybrid_optimizer.py) takes a CPU and a GPU optimizer class and builds one sub-optimizer per
offloaded param. This class takes the same arguments and maps the classes onto one update
rule of offloadopt, so a Megatron user switches with one import. What stays Megatron's: the
placement (params in registration order, offloaded while the offloaded numel is below
``offload_fraction`` x the total, every size eligible), ``param_update_in_fp32`` (fp32
masters, off by default), extra group keys such as ``wd_mult`` and ``lr_mult`` (kept in the
groups, as Megatron's scheduler reads them). What differs: one optimizer owns all state
(``state_dict()`` has torch's layout, the fp32 master under ``"master"``, not
``"master_param"``), every crossing host buffer is pinned (Megatron's ``clone().float()`` fp32
master lost its pinning, so each copy back took the pageable path: README, "The transfer
audit"), and ``step()`` always overlaps D2H, CPU update and H2D and returns with the params
current (``overlap_cpu_optimizer_d2h_h2d`` is accepted for either value).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from offloadopt.optim import HybridOptimizer
from offloadopt.rules import ADAM, ADAMW, SGD, Rule

__all__ = ["HybridDeviceOptimizer", "rule_of"]

# Keyword arguments of torch's (and TE's/Apex's) classes that pick a kernel or, already
# read by _family, the rule: accepted.
_KERNEL_KWARGS = {
    "fused",
    "foreach",
    "capturable",
    "differentiable",
    "adam_w_mode",
    "set_grad_none",
    "decoupled_weight_decay",
}


def _family(cls: Any, call_kwargs: dict[str, Any]) -> tuple[Rule, dict[str, Any]]:
    """The rule a Megatron optimizer class stands for (given the keywords it will be called
    with: a partial's, then ``call_kwargs``, which win), and the partial's keywords."""
    keywords: dict[str, Any] = {}
    while isinstance(cls, functools.partial):
        if cls.args:
            raise TypeError(
                f"HybridDeviceOptimizer: functools.partial {cls!r} binds positional args"
            )
        keywords = {**cls.keywords, **keywords}
        cls = cls.func
    chosen = {**keywords, **call_kwargs}  # what the class would see
    name, module = getattr(cls, "__name__", ""), getattr(cls, "__module__", "") or ""
    if isinstance(cls, type) and issubclass(cls, torch.optim.AdamW):
        return ADAMW, keywords
    if isinstance(cls, type) and issubclass(cls, torch.optim.Adam):
        return (ADAMW if chosen.get("decoupled_weight_decay") else ADAM), keywords
    if isinstance(cls, type) and issubclass(cls, torch.optim.SGD):
        return SGD, keywords
    if module.split(".")[0] in ("transformer_engine", "apex"):
        if name == "FusedAdam":  # both default to adam_w_mode=True: decoupled weight decay
            return (ADAMW if chosen.get("adam_w_mode", True) else ADAM), keywords
        if name == "FusedSGD":
            return SGD, keywords
    raise TypeError(
        f"HybridDeviceOptimizer: {cls!r} is not an optimizer class offloadopt can map; use "
        "torch.optim.Adam, AdamW or SGD, a functools.partial of one, or Transformer Engine's "
        "or Apex's FusedAdam / FusedSGD"
    )


def rule_of(
    cpu_optimizer_cls: Any, gpu_optimizer_cls: Any, kwargs: dict[str, Any]
) -> tuple[Rule, dict]:
    """The rule for a (CPU class, GPU class) pair and the keyword arguments it takes.

    Raises:
        TypeError: no class, an unknown class, or two classes of different update rules.
    """
    if cpu_optimizer_cls is None and gpu_optimizer_cls is None:
        raise TypeError("HybridDeviceOptimizer needs cpu_optimizer_cls or gpu_optimizer_cls")
    found = [_family(c, kwargs) for c in (cpu_optimizer_cls, gpu_optimizer_cls) if c is not None]
    rules = {rule.name for rule, _ in found}
    merged = {**found[-1][1], **found[0][1], **kwargs}
    if len(rules) > 1:
        adam_pair = rules == {"Adam", "AdamW"} and not merged.get("weight_decay", 0)
        if not adam_pair:  # Adam and AdamW differ only in how weight decay applies
            raise TypeError(
                f"HybridDeviceOptimizer: cpu_optimizer_cls {cpu_optimizer_cls!r} and "
                f"gpu_optimizer_cls {gpu_optimizer_cls!r} are different update rules ({sorted(rules)})"
            )
    return found[0][0], merged


class HybridDeviceOptimizer(HybridOptimizer):
    """Megatron-Core's ``HybridDeviceOptimizer`` constructor on offloadopt.

    Args:
        params: tensors or param-group dicts (extra group keys such as ``wd_mult`` are kept).
        offload_fraction: share in [0, 1] of the params' numel to offload, in registration
            order (Megatron's rule; default 0.5, as Megatron's).
        cpu_optimizer_cls: ``torch.optim.Adam`` / ``AdamW`` / ``SGD``, a
            ``functools.partial`` of one, or Transformer Engine's / Apex's ``FusedAdam`` /
            ``FusedSGD``: one update rule for both classes (Adam and AdamW may pair when
            ``weight_decay`` is 0).
        gpu_optimizer_cls: the device-side class, as ``cpu_optimizer_cls``.
        param_update_in_fp32: fp32 masters for bf16/fp16 params (Megatron's default False).
        pin_cpu_grads: with ``pin_cpu_params`` True, pins the crossing host buffers (one False
            reproduces the pageable path, with a warning).
        pin_cpu_params: see ``pin_cpu_grads``.
        overlap_cpu_optimizer_d2h_h2d: accepted; the copies always overlap the CPU update and
            ``step()`` returns with the params current.
        **kwargs: the rule's hyperparameters (``lr``, ``betas``, ``eps``, ``weight_decay``,
            ``momentum``, ...); kernel-choice flags (``fused``, ``foreach``, ``adam_w_mode``,
            ...) are accepted; ``capturable`` and ``differentiable`` only as False.

    Raises:
        TypeError: an optimizer class that maps to no rule (named), or an unknown keyword.
        ValueError: a bad hyperparameter, named.
        NotImplementedError: ``capturable=True`` (CUDA graphs) or ``differentiable=True``.
    """

    # state_dict(): copies of device-resident state stay on the GPU, as Megatron's.
    _snapshot_on_device = True

    def __init__(
        self,
        params,
        offload_fraction: float = 0.5,
        cpu_optimizer_cls: Any = None,
        gpu_optimizer_cls: Any = None,
        param_update_in_fp32: bool = False,
        pin_cpu_grads: bool = True,
        pin_cpu_params: bool = True,
        overlap_cpu_optimizer_d2h_h2d: bool = True,
        **kwargs: Any,
    ):
        rule, merged = rule_of(cpu_optimizer_cls, gpu_optimizer_cls, kwargs)
        unknown = set(merged) - set(rule.hyper_defaults) - _KERNEL_KWARGS
        if unknown:
            raise TypeError(
                f"HybridDeviceOptimizer ({rule.name}) got unexpected keyword arguments "
                f"{sorted(unknown)}; it takes {sorted(rule.hyper_defaults)}"
            )
        self.rule = rule  # this instance's rule (the classes chose it)
        self.cpu_optimizer_cls, self.gpu_optimizer_cls = cpu_optimizer_cls, gpu_optimizer_cls
        self.overlap_cpu_optimizer_d2h_h2d = overlap_cpu_optimizer_d2h_h2d
        hyper = {k: merged.get(k, v) for k, v in rule.hyper_defaults.items()}
        super().__init__(
            params,
            hyper,
            capturable=bool(merged.get("capturable", False)),
            differentiable=bool(merged.get("differentiable", False)),
            offload_fraction=offload_fraction,
            min_offload_numel=0,
            master_weights=param_update_in_fp32,
            pin_memory=bool(pin_cpu_grads and pin_cpu_params),
            placement_policy="megatron",
        )
