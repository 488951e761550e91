"""A GPU memory budget (``max_gpu_memory=``): the smallest offload fraction whose device bytes
fit, checked against the host's memory. :func:`choose` is pure arithmetic over a placement
function; :func:`choose_for` measures what the device holds for a Placer (which applies the
choice), and :func:`check_added` checks a group added after it."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from offloadopt.kernels.adam import device_work_nbytes
from offloadopt.link.transfer import SLOTS
from offloadopt.place.costmodel import format_bytes, parse_bytes
from offloadopt.place.placement import ParamInfo, Placement, place
from offloadopt.shards import local

__all__ = ["sizes", "mem_available", "choose", "choose_for", "check_added", "IN_FLIGHT_BUCKETS"]

# release_grads: buckets whose grads may still be on the device at once: SLOTS fed and waiting
# for a slot (backpressure, start.FromBackward.on_grad), SLOTS in the staging slots, one filling.
IN_FLIGHT_BUCKETS = 2 * SLOTS + 1


def sizes(**named: int | str | None) -> dict[str, int | None]:
    """Byte sizes from ints or strings like "120GB" (None stays None; ``activation_bytes`` may
    be 0).

    Raises:
        ValueError: a bad size, named by its argument.
    """
    out = {}
    for name, value in named.items():
        try:
            zero = name == "activation_bytes"  # a model may need none beyond its weights
            out[name] = None if value is None else parse_bytes(value, allow_zero=zero)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
    return out


def mem_available() -> int | None:
    """The host's MemAvailable in bytes (/proc/meminfo), or None where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB in the file, meaning KiB
    except OSError:
        pass
    return None


def choose(
    infos: list[ParamInfo],
    measured: int,
    how: str,
    budget: int,
    host_budget: int | None,
    bucket_nbytes: int,
    delayed: bool,
    place_at: Callable[[float, list[ParamInfo]], list[Placement]],
    release_grads: bool = False,
    grads_in_flight: bool = False,
    work: Callable[[int], int] | None = None,
    backups: bool = False,
) -> dict[str, Any]:
    """The smallest fraction (0.01 steps) whose device bytes fit ``budget``: ``measured``
    (what the device holds without optimizer state, described by ``how``), plus the state that
    ``place_at(fraction, infos)`` leaves on the device, 4 staging slots as large as the largest
    bucket (at most ``bucket_nbytes`` of fp32) when anything is offloaded and, ``delayed``, a
    landing buffer per offloaded param. With ``release_grads`` (grads freed during backward
    as their copies land: ``grads_final`` without clipping) the offloaded params' grads leave
    ``measured`` (a peak of the first backward, which held every grad), but for those in
    flight: the largest offloaded param's and :data:`IN_FLIGHT_BUCKETS` buckets' worth. With
    ``grads_in_flight`` (``wait="module"``: ``step()`` returns while copies still read the
    offloaded grads, and ``zero_grad`` frees them to blocks the allocator reuses only once
    those copies are done, ``record_stream``) that many buckets' grads are added.
    ``work(numel)``: the device bytes of the update's temporaries over the device-resident
    params of a compressed representation (``ParamInfo.elem_bytes``), ``numel`` elements.
    Its host bytes (offloaded state with the host copy of the weights, ``Placement.host_nbytes``,
    twice with ``backups`` (``speculate=True`` keeps a pageable pre-step copy of them:
    offloadopt/step/speculate.py), and 2 pinned slots) must fit ``host_budget``, by default
    the host's MemAvailable.

    Returns:
        The choice: ``fraction``, ``max_gpu_memory``, ``measured_bytes``, ``measured``,
        ``predicted_gpu_bytes``, ``host_bytes``, ``host_available_bytes``,
        ``released_grad_bytes`` (what ``release_grads`` takes off ``measured``).

    Raises:
        ValueError: no fraction fits, or the host lacks the memory (both with figures).
    """
    chosen = least = None  # least: the fraction that needs the fewest device bytes, its parts
    for k in range(101):
        fraction = k / 100
        placements = place_at(fraction, infos)
        host_state = sum(pl.host_nbytes for pl in placements if pl.offloaded)
        device_state = sum(pl.state_nbytes for pl in placements
                           if not pl.offloaded and pl.reason != "frozen")  # fmt: skip
        landing = sum(i.numel * i.dtype.itemsize for i, pl in zip(infos, placements, strict=True)
                      if pl.offloaded) if delayed else 0  # fmt: skip
        # Staging slots are as large as the largest bucket: at most bucket_nbytes of fp32,
        # at most the offloaded fp32 bytes (a small model's one bucket).
        fp32 = sum(i.numel * 4 for i, pl in zip(infos, placements, strict=True) if pl.offloaded)
        slot = min(bucket_nbytes, fp32)
        staging = 4 * slot
        released = pending = 0
        if fp32:
            offloaded = [i for i, pl in zip(infos, placements, strict=True) if pl.offloaded]
            grads = [i.numel * i.dtype.itemsize for i in offloaded]
            # a bucket's grads: its fp32 bytes in the params' dtype
            buckets = IN_FLIGHT_BUCKETS * slot * max(i.dtype.itemsize for i in offloaded) // 4
            if release_grads:
                released = max(0, sum(grads) - max(grads) - buckets)
            if grads_in_flight:
                pending = min(buckets, sum(grads))
        compressed = sum(i.numel for i, pl in zip(infos, placements, strict=True)
                         if not pl.offloaded and pl.reason != "frozen" and i.elem_bytes is not None)  # fmt: skip
        workspace = work(compressed) if work is not None and compressed else 0
        need = measured - released + pending + device_state + staging + landing + workspace
        if least is None or need < least[1]:
            least = (fraction, need, dict(staging=staging, device_state=device_state,
                                          landing=landing, released=released, pending=pending,
                                          workspace=workspace))  # fmt: skip
        if need <= budget:
            chosen = (fraction, need, host_state * (2 if backups else 1) + 2 * slot, released)
            break
    if chosen is None:
        fraction, need, parts = least
        named = {"staging": "staging", "device_state": "state left on the device",
                 "landing": "+ delayed landing buffers", "pending": "+ grads the copies still read",
                 "released": "- grads freed in backward",
                 "workspace": "+ the device update's temporaries"}  # fmt: skip
        shown = "; ".join(f"{named[k]} {format_bytes(v)}" for k, v in parts.items()
                          if v or k in ("staging", "device_state"))  # fmt: skip
        raise ValueError(
            f"max_gpu_memory={format_bytes(budget)} cannot be met: the fewest device bytes, at "
            f"offload fraction {fraction:g}, are {format_bytes(need)} ({how}: "
            f"{format_bytes(measured)}; {shown})"
        )
    fraction, need, host, released = chosen
    available = host_budget or mem_available()
    if available is not None and host > available:
        where = "(max_host_memory)" if host_budget else "available (MemAvailable)"
        spec = (
            " (with speculate=True's pre-step backups, a second copy of the state)"
            if backups
            else ""
        )
        raise ValueError(
            f"max_gpu_memory={format_bytes(budget)} needs offload fraction {fraction:g}, whose "
            f"host state is {format_bytes(host)}{spec}; the host has {format_bytes(available)} "
            f"{where}"
        )
    logging.getLogger("offloadopt").info(
        "offloadopt: max_gpu_memory %s: offload fraction %g, the smallest that fits (%s on the "
        "device; %s measured as %s; %s on the host)", format_bytes(budget), fraction,
        format_bytes(need), format_bytes(measured), how, format_bytes(host),
    )  # fmt: skip
    return {
        "fraction": fraction, "max_gpu_memory": budget, "measured_bytes": measured,
        "measured": how, "predicted_gpu_bytes": need, "host_bytes": host,
        "host_available_bytes": available, "released_grad_bytes": released,
    }  # fmt: skip


def choose_for(placer: Any, group_indices: list[int], micro_steps: int = 1) -> dict[str, Any]:
    """The budget's choice for ``placer``'s groups ``group_indices``: what the device holds
    (its peak so far, or weights, grads and ``activation_bytes``), then :func:`choose`'s
    smallest fraction that fits. With gradient accumulation (``micro_steps`` > 1, the step
    that chooses) ``release_grads`` frees nothing off the peak: every grad stays on the device
    through the non-final micro-steps, whose backward holds them all beside its activations,
    as the measured first step did.

    Raises:
        ValueError: no fraction fits, the host lacks the memory (both with figures), or the
            budget is more than a GPU of the params holds.
    """
    tensors = [p for gi in group_indices for p in placer.param_groups[gi]["params"]]
    cuda = {local(p).device for p in tensors if local(p).device.type == "cuda"}
    for d in cuda:  # a budget the GPU cannot hold is never met: the allocator fails first
        total = torch.cuda.get_device_properties(d).total_memory
        if placer.sizes["max_gpu_memory"] > total:
            raise ValueError(f"max_gpu_memory={format_bytes(placer.sizes['max_gpu_memory'])} "
                             f"is more than {d} holds ({format_bytes(total)})")  # fmt: skip
    given = placer.sizes["activation_bytes"]
    if given is None and cuda:
        measured = sum(torch.cuda.max_memory_allocated(d) for d in cuda)
        how = "the device's peak so far (weights, grads, forward and backward)"
        if not any(p.grad is not None for p in tensors):
            placer.warn_once("budget-before-backward",
                             "max_gpu_memory: placing before any backward ran, so the "
                             "activations are not in the measured peak; pass "
                             "activation_bytes= or call step() first")  # fmt: skip
    else:
        if given is None and not any(p.grad is not None for p in tensors):
            placer.warn_once("budget-before-backward",
                             "max_gpu_memory: placing before any backward ran and without "
                             "activation_bytes=, so activations count as 0")  # fmt: skip
        counted = weights_and_grads_nbytes(tensors)
        measured = counted + (given or 0)
        how = (f"weights and grads {format_bytes(counted)} + activations "
               f"{format_bytes(given or 0)}")  # fmt: skip
    choice = choose(
        placer.infos(group_indices), measured, how, placer.sizes["max_gpu_memory"],
        placer.sizes["max_host_memory"], placer.bucket_nbytes, placer.overlap == "delayed",
        lambda f, infos: place(infos, f, placer.min_offload_numel, placer.master_weights,
                               placer.policy),
        release_grads=placer.releases_early and micro_steps == 1,
        grads_in_flight=placer.wait == "module" and placer.overlap != "delayed",
        work=(lambda n: device_work_nbytes(n, "cuda")) if cuda else None,
        backups=placer.speculate,
    )  # fmt: skip
    if micro_steps > 1:
        choice["micro_steps"] = micro_steps  # what released_grad_bytes 0 follows from
    return choice


def check_added(placer: Any, group_indices: list[int]) -> int:
    """After the budget's choice, a group added later is placed at the chosen fraction: the
    device bytes it adds (weights, grads, the state left on the device) must still fit.
    Returns the predicted device bytes with it.

    Raises:
        ValueError: the budget would be exceeded (with figures); the group is not added.
    """
    infos = placer.infos(group_indices)
    tensors = [p for gi in group_indices for p in placer.param_groups[gi]["params"]]
    pls = place(infos, placer.fraction, placer.min_offload_numel, placer.master_weights,
                placer.policy)  # fmt: skip
    added = weights_and_grads_nbytes(tensors)
    added += sum(pl.state_nbytes for pl in pls if not pl.offloaded and pl.reason != "frozen")
    need = placer.choice["predicted_gpu_bytes"] + added
    if need > placer.choice["max_gpu_memory"]:
        raise ValueError(
            f"add_param_group: at the chosen offload fraction {placer.fraction:g} the "
            f"new group adds {format_bytes(added)} on the device, {format_bytes(need)} in "
            f"all, over max_gpu_memory={format_bytes(placer.choice['max_gpu_memory'])}; call "
            "opt.set_offload_fraction(...) for more offload first"
        )
    return need


def weights_and_grads_nbytes(tensors: list[torch.Tensor]) -> int:
    """Device bytes of these params (this rank's shards) and of the grads of trainable ones."""
    return sum(local(p).nbytes * (2 if p.requires_grad else 1) for p in tensors)
