"""The anchors the benchmark measures beside HybridAdamW, each built when importable.

Each builder takes the bench's shared model (on its device, initial weights loaded) and the
learning rate, and returns a dict:

- ``opt``: the optimizer (read for ``stats``, ``pinned_nbytes``, ``host_nbytes`` if it has them).
- ``fraction``, ``kind`` ("anchor"), ``numerics``: "same", or a short name of different math
  (then the weights are compared with the baseline's but not judged).
- optionally ``model``: its own model to train instead (a deep copy, a wrapper, an engine);
  the shared model must stay usable, so an anchor that changes a module in place copies it.
- optionally ``step()`` (optimizer step and zero_grad), ``loss(model, x, y)``,
  ``backward(loss)``, ``weights(model) -> {name: CPU tensor}`` with the shared model's
  ``state_dict`` names and dtypes (for the drift check), and ``close()`` (run after the
  configuration, to free what garbage collection alone would not).

A builder that takes a ``batch_size`` keyword gets the bench's. A missing package (or a
device the anchor cannot use) raises :class:`Unavailable`, which the benchmark records as
"skipped".
"""

from __future__ import annotations

import atexit
import copy
import functools
import importlib.util
import logging
import os
import socket
from pathlib import Path
from typing import Any

import torch

from offloadopt.harness.models import transformer_blocks
from offloadopt.harness.presets import MODES

__all__ = ["Unavailable", "ANCHORS", "megatron_hybrid_optimizer_class"]


class Unavailable(RuntimeError):
    """The anchor's package is not importable here, or the anchor cannot use this device."""


def megatron_hybrid_optimizer_class():
    """Megatron-Core's ``HybridDeviceOptimizer``, loaded from its one file (it needs only torch;
    the package's ``__init__`` pulls in much more)."""
    spec = importlib.util.find_spec("megatron")
    if spec is None or not spec.submodule_search_locations:
        raise Unavailable("megatron-core is not installed (pip install megatron-core)")
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
    masters that its ``clone().float()`` left pageable (the defect this project started from: README, "The transfer audit")."""

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
        raise Unavailable(f"torchao is not installed (pip install torchao): {e}") from e
    opt = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, fused=True, **adamw_kwargs(lr))
    low = next(model.parameters()).dtype != torch.float32
    numerics = "no fp32 master" if low else "same"
    return {"opt": opt, "fraction": 1.0, "kind": "anchor", "numerics": numerics}


def representation(state_dtype: str = "fp32", master_weights: str = "fp32") -> dict[str, Any]:
    """HybridAdamW's keywords for the commands' ``--state-dtype`` and ``--master-weights``
    (none for torch's representation, so the default configurations are built as before)."""
    out: dict[str, Any] = {}
    if state_dtype != "fp32":
        out["state_dtype"] = state_dtype
    if master_weights != "fp32":
        out["master_weights"] = master_weights
    return out


def hybrid(fraction: float, mode: str = "step", **kwargs):
    """HybridAdamW at ``fraction`` in ``mode`` (a key of :data:`MODES`; fraction 0 in step
    mode is the benchmark's baseline). Modes other than step watch the model. A keyword in
    ``kwargs`` replaces the mode's own (profile_modes.py's ``backward:0.2:grads_final=False``
    raised "multiple values for keyword argument")."""
    options, numerics = MODES[mode]

    def build(model: torch.nn.Module, lr: float) -> dict[str, Any]:
        from offloadopt import HybridAdamW

        opt = HybridAdamW(model.named_parameters(), offload_fraction=fraction,
                          **adamw_kwargs(lr), **{**options, **kwargs})  # fmt: skip
        if mode != "step":
            opt.watch(model)  # per-module waits; delayed: model.state_dict() sees the masters
        stale = mode == "delayed" and fraction > 0  # at fraction 0 nothing is a step old
        built = {"opt": opt, "fraction": fraction, "kind": "hybrid", "mode": mode,
                 "numerics": numerics if stale or mode != "delayed" else "same",
                 "close": opt.close}  # fmt: skip
        if mode == "backward-torch-clip":

            def backward(loss: torch.Tensor) -> None:
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)

            built["backward"] = backward
        return built

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


def _single_rank_group(device: torch.device) -> None:
    """A torch.distributed process group of one rank, for the engines that need one: RANK=0,
    LOCAL_RANK=0, WORLD_SIZE=1, MASTER_ADDR=127.0.0.1 and a free MASTER_PORT where unset. nccl
    for CUDA tensors, gloo for any collective an engine runs on a CPU tensor. Kept for the
    process (later anchors reuse it), destroyed at exit."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                       ("MASTER_ADDR", "127.0.0.1")):  # fmt: skip
        os.environ.setdefault(key, value)
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))  # port 0: the OS picks a free one
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    dist.init_process_group("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo")
    atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())


def _float_dtypes(model: torch.nn.Module) -> dict[str, torch.dtype]:
    return {k: v.dtype for k, v in model.state_dict().items() if v.is_floating_point()}


def _host_weights(
    module: torch.nn.Module, dtypes: dict[str, torch.dtype]
) -> dict[str, torch.Tensor]:
    """``module``'s state as plain CPU tensors, for the entries of ``dtypes`` (the shared model's
    floating-point ``state_dict`` names): DTensors gathered whole on their mesh's device (as
    torch's own ``_gather_state_dict`` does with CPU-offloaded ones), each entry cast to that
    dtype, so fp32 masters compare as the bf16 weights they give the forward."""
    from torch.distributed.tensor import DTensor

    out = {}
    for k, v in module.state_dict().items():
        if k in dtypes:
            v = v.to(v.device_mesh.device_type).full_tensor() if isinstance(v, DTensor) else v
            out[k] = v.detach().to("cpu", dtypes[k], copy=True)
    return out


# ZenFlow's tutorial settings (deepspeed.ai/tutorials/zenflow): the top 5% of the grads by norm
# updated on the GPU every step, the rest accumulated and updated on the CPU every 4th step,
# that update overlapped with the next steps
ZENFLOW = {"topk_ratio": 0.05, "select_strategy": "auto", "select_interval": "auto",
           "update_interval": 4, "full_warm_up_rounds": 0, "overlap_step": True}  # fmt: skip


def deepspeed_zenflow(model: torch.nn.Module, lr: float, batch_size: int = 1) -> dict[str, Any]:
    """DeepSpeed ZenFlow: :func:`deepspeed_zero2` with a ``zenflow`` block (:data:`ZENFLOW`)
    under ``zero_optimization``. Its updates are stale by design (most params are updated
    every 4th step, from accumulated grads), so its weights differ from AdamW's."""
    out = deepspeed_zero2(model, lr, batch_size, zenflow=ZENFLOW)
    return {**out, "numerics": "DeepSpeed ZenFlow (stale, selective updates)"}


def deepspeed_zero2(
    model: torch.nn.Module, lr: float, batch_size: int = 1, zenflow: dict | None = None
) -> dict[str, Any]:
    """DeepSpeed ZeRO-2 with ``offload_optimizer: cpu`` (pinned), one rank, on a deep copy.

    Its engine casts the copy to bf16 and flattens its params in place. During backward the
    grads are reduced in buckets and copied D2H into fp32 host buffers; in ``step()`` its own
    AVX CPU Adam (``DeepSpeedCPUAdam``, which the config's AdamW type selects) updates the fp32
    masters on the host, which are cast to bf16 there, into a pinned buffer, and go back H2D as
    one flat copy. No clipping, one micro batch per step. The engine does the forward
    (``engine(x)``), ``engine.backward(loss)`` and ``engine.step()`` (which also zeroes the
    grads); ZeRO-2 keeps the full bf16 params on ``engine.module``.

    DeepSpeedCPUAdam compiles itself at first use (about a minute on the GPU host), inside
    ``deepspeed.initialize``: that time lands in the configuration's ``construct_s``, not in its
    steps. Raises :class:`Unavailable` without deepspeed or without a CUDA device.
    """
    if importlib.util.find_spec("deepspeed") is None:
        raise Unavailable("deepspeed is not installed (pip install deepspeed)")
    device = next(model.parameters()).device
    if device.type != "cuda":
        raise Unavailable(f"DeepSpeed ZeRO-Offload needs a CUDA device, not {device.type}")
    _single_rank_group(device)
    try:
        import deepspeed
    except Exception as e:  # noqa: BLE001 - any import failure means unavailable
        raise Unavailable(f"deepspeed: {e}") from e
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)  # its INFO lines bury the table
    dtypes = _float_dtypes(model)
    hp = adamw_kwargs(lr)
    config = {
        "train_micro_batch_size_per_gpu": batch_size, "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0, "steps_per_print": 2**31 - 1,
        "bf16": {"enabled": next(model.parameters()).dtype == torch.bfloat16},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                              **({"zenflow": zenflow} if zenflow else {})},
        "optimizer": {"type": "AdamW", "params": {"lr": hp["lr"], "betas": list(hp["betas"]),
                                                  "eps": hp["eps"], "weight_decay": hp["weight_decay"]}},
    }  # fmt: skip
    clone = copy.deepcopy(model)
    engine, opt, _, _ = deepspeed.initialize(
        model=clone, model_parameters=clone.parameters(), config=config
    )
    return {
        "model": engine, "opt": opt, "step": engine.step, "backward": engine.backward,
        "weights": lambda e: _host_weights(e.module, dtypes), "close": engine.destroy,
        "fraction": 1.0, "kind": "anchor", "numerics": "DeepSpeed CPU Adam",
    }  # fmt: skip


def _fsdp2_copy(model: torch.nn.Module, dtype: torch.dtype | None, **shard: Any):
    """A deep copy of ``model`` (cast to ``dtype`` if given) under FSDP2 (one rank, or the
    ranks of the process group that exists, as under ``offloadopt bench --fsdp``): one
    ``fully_shard`` per transformer block, then the root, with ``shard``'s options; and the
    shared model's float dtypes (for :func:`_host_weights`).

    Raises:
        Unavailable: a torch without FSDP2.
    """
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
    except ImportError as e:
        raise Unavailable(f"FSDP2: {e}") from e
    device = next(model.parameters()).device
    _single_rank_group(device)
    dtypes = _float_dtypes(model)
    clone = copy.deepcopy(model)  # fully_shard changes modules in place
    if dtype is not None:
        clone = clone.to(dtype)
    import torch.distributed as dist

    # One rank alone; under `offloadopt bench --fsdp` every rank of the torchrun job.
    shard = {"mesh": init_device_mesh(device.type, (dist.get_world_size(),)), **shard}
    for block in transformer_blocks(clone):
        fully_shard(block, **shard)
    fully_shard(clone, **shard)
    return clone, dtypes


def fsdp2_cpu_offload(model: torch.nn.Module, lr: float) -> dict[str, Any]:
    """PyTorch FSDP2 (``fully_shard``) with ``CPUOffloadPolicy(pin_memory=True)``, one rank, on
    an fp32 deep copy: one FSDP group per transformer block, then the root (embeddings, final
    norm, head).

    The fp32 params (the masters), their grads and torch's fused AdamW state live in pinned
    host memory. A group's fp32 params are copied H2D and cast to the model's dtype
    (``MixedPrecisionPolicy``) when the group is needed: for its forward, and again for its
    backward (blocks free theirs after forward); after backward its grads are reduced in fp32
    and copied D2H; ``opt.step()`` runs on the CPU. That is the baseline's math (fp32 masters
    and moments, bf16 compute, torch's fused AdamW), so it is judged as "same" (on the CPU it
    is bitwise the baseline: tests/test_bench.py).

    On a CPU device (the tests) the params live on the host already: no offload policy, gloo.
    """
    try:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
    except ImportError as e:
        raise Unavailable(f"FSDP2: {e}") from e
    dtype = next(model.parameters()).dtype
    shard: dict[str, Any] = {
        "mp_policy": MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    }
    if next(model.parameters()).device.type == "cuda":
        shard["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
    clone, dtypes = _fsdp2_copy(model, torch.float32, **shard)
    opt = torch.optim.AdamW(clone.parameters(), fused=True, **adamw_kwargs(lr))
    return {
        "model": clone, "opt": opt, "weights": lambda m: _host_weights(m, dtypes),
        "fraction": 1.0, "kind": "anchor", "numerics": "same",
    }  # fmt: skip


def hybrid_fsdp2(fraction: float, **kwargs):
    """HybridAdamW at ``fraction`` on FSDP2 of one rank (``fully_shard`` per transformer block,
    then the root; no offload policy, no mixed-precision policy), on a deep copy in the model's
    own dtype: the params are bf16 shards, the optimizer keeps their fp32 masters and moments
    on the host for ``fraction`` of the state bytes and updates each rank's shards. With one
    rank FSDP2's all-gather and reduce-scatter are copies, so the math is the single-GPU
    path's (tests/test_bench.py checks it bitwise on the CPU)."""

    def build(model: torch.nn.Module, lr: float) -> dict[str, Any]:
        from offloadopt import HybridAdamW

        clone, dtypes = _fsdp2_copy(model, None)
        opt = HybridAdamW(
            clone.named_parameters(), offload_fraction=fraction, **adamw_kwargs(lr), **kwargs
        )
        return {
            "model": clone, "opt": opt, "weights": lambda m: _host_weights(m, dtypes),
            "fraction": fraction, "kind": "hybrid", "close": opt.close,
            # the delayed update is another run (weights one step stale), not a drift
            "numerics": "delayed update" if opt.overlap == "delayed" else "same",
        }  # fmt: skip

    return build


# name -> (builder, slow): slow anchors get BenchConfig.slow_steps timed steps.
# its keys, in order, are presets.ANCHOR_NAMES (what --anchors offers without importing torch)
ANCHORS: dict[str, tuple[Any, bool]] = {
    "megatron:0": (megatron(0.0, fix_pinning=False, fused_cpu=False), False),
    "megatron:1": (megatron(1.0, fix_pinning=False, fused_cpu=False), True),
    "megatron-pinfix-fused:1": (megatron(1.0, fix_pinning=True, fused_cpu=True), False),
    "torchao": (torchao_offload, False),
    "fsdp2-cpuoffload": (fsdp2_cpu_offload, False),
    "hybrid-fsdp2:0.5": (hybrid_fsdp2(0.5), False),  # ours under FSDP2 (one rank), beside it
    "hybrid-fsdp2:1": (hybrid_fsdp2(1.0), False),
    "hybrid-fsdp2-delayed:1": (hybrid_fsdp2(1.0, overlap="delayed"), False),
    "hybrid-fsdp2-backward:1": (hybrid_fsdp2(1.0, overlap="backward", grads_final=True), False),
    "deepspeed-zero2": (
        deepspeed_zero2,
        False,
    ),  # after the others: its CPU Adam compiles itself first (~1 min)
    "deepspeed-zenflow": (deepspeed_zenflow, False),
}
