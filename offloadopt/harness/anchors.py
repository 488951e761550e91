"""The anchors the benchmark measures beside HybridAdamW, each built when importable.

Each builder takes the model (on its device, initial weights loaded) and the learning rate and
returns ``{"opt", "fraction", "kind", "numerics"}`` (and optionally ``"step"``, a callable
doing the optimizer step and zero_grad). A missing package raises :class:`Unavailable`, which the
benchmark records as "skipped".
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from typing import Any

import torch

__all__ = ["Unavailable", "ANCHORS", "megatron_hybrid_optimizer_class"]


class Unavailable(RuntimeError):
    """The anchor's package is not importable here."""


def megatron_hybrid_optimizer_class():
    """Megatron-Core's ``HybridDeviceOptimizer``, loaded from its one file (it needs only torch;
    the package's ``__init__`` pulls in much more)."""
    spec = importlib.util.find_spec("megatron")
    if spec is None or not spec.submodule_search_locations:
        raise Unavailable("megatron-core is not installed")
    path = (
        Path(next(iter(spec.submodule_search_locations)))
        / "core/optimizer/cpu_offloading/hybrid_optimizer.py"
    )
    if not path.exists():
        raise Unavailable(f"no {path}")
    mod_spec = importlib.util.spec_from_file_location("_megatron_hybrid_optimizer", path)
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    return module.HybridDeviceOptimizer


def adamw_kwargs(lr: float) -> dict[str, Any]:
    """The AdamW hyperparameters every configuration shares (GPT-2 training's usual ones)."""
    return dict(lr=lr, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8)


def megatron(fraction: float, fix_pinning: bool, fused_cpu: bool):
    """Megatron's recommended configuration: fp32 masters, D2H/H2D overlap, torch AdamW on the
    CPU (its default for-loop kernel, or the fused one); ``fix_pinning`` re-pins the fp32
    masters that its ``clone().float()`` left pageable (the defect of DESIGN.md section 1)."""

    def build(model: torch.nn.Module, lr: float) -> dict[str, Any]:
        cls = megatron_hybrid_optimizer_class()
        cpu_cls = (
            functools.partial(torch.optim.AdamW, fused=True) if fused_cpu else torch.optim.AdamW
        )
        opt = cls(
            [{"params": list(model.parameters())}], offload_fraction=fraction,
            cpu_optimizer_cls=cpu_cls, gpu_optimizer_cls=functools.partial(torch.optim.AdamW, fused=True),
            param_update_in_fp32=True, pin_cpu_grads=True, pin_cpu_params=True,
            overlap_cpu_optimizer_d2h_h2d=True, **adamw_kwargs(lr),
        )  # fmt: skip
        if fix_pinning:
            for sub in opt.cpu_optimizers:
                for group in sub.param_groups:
                    for p in group["params"]:
                        if not p.data.is_pinned():
                            p.data = p.data.pin_memory()
        return {"opt": opt, "fraction": fraction, "kind": "anchor", "numerics": "same"}

    return build


def torchao_offload(model: torch.nn.Module, lr: float) -> dict[str, Any]:
    """torchao's CPUOffloadOptimizer: fused CPU AdamW on the bf16 weights, no fp32 master."""
    try:
        from torchao.optim import CPUOffloadOptimizer
    except Exception as e:  # noqa: BLE001 - any import failure means unavailable
        raise Unavailable(f"torchao: {e}") from e
    opt = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, fused=True, **adamw_kwargs(lr))
    low = next(model.parameters()).dtype != torch.float32
    numerics = "no fp32 master" if low else "same"
    return {"opt": opt, "fraction": 1.0, "kind": "anchor", "numerics": numerics}


def hybrid(fraction: float, **kwargs):
    """HybridAdamW at ``fraction`` (fraction 0 is the benchmark's baseline)."""

    def build(model: torch.nn.Module, lr: float) -> dict[str, Any]:
        from offloadopt import HybridAdamW

        opt = HybridAdamW(
            model.named_parameters(), offload_fraction=fraction, **adamw_kwargs(lr), **kwargs
        )
        return {"opt": opt, "fraction": fraction, "kind": "hybrid", "numerics": "same"}

    return build


def torch_adamw(model: torch.nn.Module, lr: float) -> dict[str, Any]:
    """torch.optim.AdamW(fused=True), everything on the device, in the params' own dtype."""
    opt = torch.optim.AdamW(model.parameters(), fused=True, **adamw_kwargs(lr))
    low = next(model.parameters()).dtype != torch.float32
    return {
        "opt": opt,
        "fraction": 0.0,
        "kind": "anchor",
        "numerics": "no fp32 master" if low else "same",
    }


# name -> (builder, slow): slow anchors get BenchConfig.slow_steps timed steps.
ANCHORS: dict[str, tuple[Any, bool]] = {
    "megatron:0": (megatron(0.0, fix_pinning=False, fused_cpu=False), False),
    "megatron:1": (megatron(1.0, fix_pinning=False, fused_cpu=False), True),
    "megatron-pinfix-fused:1": (megatron(1.0, fix_pinning=True, fused_cpu=True), False),
    "torchao": (torchao_offload, False),
}
