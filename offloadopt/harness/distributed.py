"""torch.distributed for the main job and the bench: the process group from torchrun's
environment, FSDP2 (``fully_shard`` per transformer block, then the root) and DDP wrapping,
and a teardown that cannot hang on a rank that failed.

torchrun sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` and
``MASTER_ADDR``/``MASTER_PORT``; tests/test_distributed.py sets ``OFFLOADOPT_INIT_FILE``
instead of a port (a file rendezvous: no fixed ports).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["Dist", "init_from_env", "shard_fsdp", "wrap_ddp", "teardown", "merge_ranks"]


@dataclass(frozen=True)
class Dist:
    """This process's place in the job (one process when ``world == 1`` and not initialized)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    local_world: int = 1
    initialized: bool = False

    @property
    def main(self) -> bool:
        return self.rank == 0


def init_from_env(device: str) -> Dist:
    """Join the job torchrun started (NCCL on CUDA, gloo on the CPU) and pick this rank's GPU;
    a plain process (no ``WORLD_SIZE``) stays alone and uninitialized.

    Raises:
        ValueError: ``WORLD_SIZE``/``RANK``/``LOCAL_RANK`` are not integers, or a CUDA rank
            has no GPU of its own (``LOCAL_RANK`` >= the GPUs torch sees).
    """
    import torch.distributed as dist

    if "WORLD_SIZE" not in os.environ:
        return Dist()
    try:
        world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ.get("RANK", "0"))
        local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    except ValueError as e:
        raise ValueError(f"torchrun's environment is not integers: {e}") from e
    if device.startswith("cuda"):
        n = torch.cuda.device_count()
        if local_rank >= n:
            raise ValueError(f"LOCAL_RANK={local_rank} but torch sees {n} GPUs on this host")
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        backend = "nccl" if device.startswith("cuda") else "gloo"
        init = os.environ.get("OFFLOADOPT_INIT_FILE")
        kwargs = {"init_method": f"file://{init}"} if init else {}
        if device.startswith("cuda"):
            kwargs["device_id"] = torch.device("cuda", local_rank)
        dist.init_process_group(backend, rank=rank, world_size=world, **kwargs)
    return Dist(rank, world, local_rank, local_world, True)


def shard_fsdp(model: nn.Module, *, param_dtype: torch.dtype | None = None,
               reshard_after_forward: bool = True) -> nn.Module:  # fmt: skip
    """FSDP2 over every rank: ``fully_shard`` on each transformer block (``model.transformer.h``
    when the model has one), then on the root. ``param_dtype`` turns on FSDP2's mixed precision
    (compute in that dtype, fp32 sharded params, fp32 grad reduction)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    device = next(model.parameters()).device
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    kwargs = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if param_dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=param_dtype, reduce_dtype=torch.float32
        )
    blocks = getattr(getattr(model, "transformer", None), "h", None)
    for block in blocks if blocks is not None else []:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def wrap_ddp(model: nn.Module, *, bucket_view: bool = False) -> nn.Module:
    """DDP over every rank, on this rank's device; ``bucket_view``: grads are views of DDP's
    buckets (``gradient_as_bucket_view=True``, which HybridAdamW's ``ddp=`` needs)."""
    from torch.nn.parallel import DistributedDataParallel

    device = next(model.parameters()).device
    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids, gradient_as_bucket_view=bucket_view)


def teardown() -> None:
    """Barrier, then destroy the process group (no-op when none)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()


# The figures of each rank kept in a merged row's ``ranks`` list.
PER_RANK = ("step_ms", "fwd_bwd_ms", "opt_ms", "peak_gpu_gb", "pinned_gb", "opt_host_gb",
            "host_rss_gb", "pageable_copies", "opt_stats_cpu_threads", "opt_stats_local_ranks")  # fmt: skip


def merge_ranks(results: list[dict[str, Any]], ranks: Dist, tokens_per_rank: int) -> list:
    """Every rank's rows, gathered: one row per configuration with rank 0's fields, the
    slowest rank's step (the job steps at it), the pageable copies of all ranks, each rank's
    figures under ``ranks`` and the job's ``tokens_per_s`` (every rank trains its own batch)."""
    import torch.distributed as dist

    everyone: list = [None] * ranks.world
    dist.all_gather_object(everyone, results)
    merged = []
    for rows in zip(*everyone, strict=True):
        row = dict(rows[0])
        if "step_ms" in row:
            row["ranks"] = [{k: r.get(k) for k in PER_RANK} for r in rows]
            for key in ("step_ms", "fwd_bwd_ms", "opt_ms", "peak_gpu_gb"):
                row[key] = max(r[key] for r in rows)
            if "pageable_copies" in row:
                row["pageable_copies"] = sum(r["pageable_copies"] for r in rows)
            row["tokens_per_s"] = tokens_per_rank * ranks.world / row["step_ms"] * 1e3
            for key in ("opt_host_gb", "pinned_gb"):  # the job's host memory: every rank's
                row[f"{key}_total"] = sum(r[key] for r in rows)
        merged.append(row)
    return merged
