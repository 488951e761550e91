"""The offloading options of the hybrid optimizers, declared once.

:class:`Options` is one frozen dataclass, one field per option (its default, and a comment on
what it does; ``HybridAdamW``'s docstring has the full text of each). ``HybridAdamW``,
``HybridAdam`` and ``HybridSGD`` take torch's signatures plus ``**options``, which
:meth:`Options.parse` turns into an ``Options`` (an unknown keyword is a ``TypeError`` naming the
class the caller built); :func:`offloadopt.validation.validate_options` checks the values, before
anything is built. :class:`OffloadOptions` is the same fields as a ``TypedDict``, so that IDEs and
type checkers see the keywords of ``**options``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, TypedDict

__all__ = ["Options", "OffloadOptions"]


@dataclass(frozen=True)
class Options:
    """Every offloading option, with its default (see ``HybridAdamW``'s ``Args:``)."""

    offload_fraction: float | str = 1.0  # share of the eligible state bytes on the host, or "auto"
    min_offload_numel: int = 4096  # smaller params keep their state on the device
    master_weights: bool | str = True  # fp32 masters for bf16/fp16 params; "bf16-sr": none
    state_dtype: str = "fp32"  # the moments: "fp32" (torch's), "bf16" or "int8" (compressed)
    pin_memory: bool = True  # pin host buffers that cross the link (False: the pageable path)
    bucket_nbytes: int | None = None  # fp32 state bytes per bucket; None: by overlap (optim.py)
    flush_denormal: bool = True  # the CPU update with flush-to-zero
    cpu_threads: int | None = None  # the CPU worker's OpenMP threads; None: one per worker CPU
    worker_cpus: Any = None  # the worker's CPUs: None (chosen), "any" (unpinned), or CPU ids
    timeout_s: float = 600.0  # the longest wait for the worker or a copy, seconds
    overlap: str = "step"  # when updates start: "step", "backward" or "delayed"
    wait: str = "step"  # when new weights are waited for: "step" or "module" (per module)
    max_grad_norm: float | None = None  # clip the global grad norm inside the update
    grads_final: bool = False  # nothing edits grads between backward and step()
    speculate: bool = False  # backward mode: start clipped/scaled updates in backward, validate
    release_grads: bool = False  # free offloaded params' device grads once copied out
    ddp: Any = None  # the DistributedDataParallel model whose reduced buckets announce grads
    grad_scaler: Any = None  # the torch.amp.GradScaler attached (backward mode's found_inf)
    delay_after: int = 0  # overlap="delayed": synchronous steps first
    max_gpu_memory: int | str | None = None  # a device budget: it chooses the fraction
    max_host_memory: int | str | None = None  # the host bytes the budget's choice may use
    activation_bytes: int | str | None = None  # forward+backward's device bytes, if not measured
    auto_tolerance: float = 0.05  # offload_fraction="auto": the step's allowed growth
    placement_policy: str = "state-bytes"  # "megatron": HybridDeviceOptimizer's placement

    @classmethod
    def parse(cls, owner: str, options: dict[str, Any]) -> Options:
        """``options`` (keywords of ``owner``'s constructor) as an ``Options``.

        Raises:
            TypeError: a keyword that is no option, named with ``owner`` as Python names an
                unexpected keyword argument.
        """
        names = {f.name for f in dataclasses.fields(cls)}
        for key in options:
            if key not in names:
                raise TypeError(f"{owner}.__init__() got an unexpected keyword argument {key!r}")
        return cls(**options)


class OffloadOptions(TypedDict, total=False):
    """The keywords of ``**options`` (the fields of :class:`Options`), for IDEs and type
    checkers; tests/test_contract.py checks that the two list the same names."""

    offload_fraction: float | str
    min_offload_numel: int
    master_weights: bool | str
    state_dtype: str
    pin_memory: bool
    bucket_nbytes: int | None
    flush_denormal: bool
    cpu_threads: int | None
    worker_cpus: Any
    timeout_s: float
    overlap: str
    wait: str
    max_grad_norm: float | None
    grads_final: bool
    speculate: bool
    release_grads: bool
    ddp: Any
    grad_scaler: Any
    delay_after: int
    max_gpu_memory: int | str | None
    max_host_memory: int | str | None
    activation_bytes: int | str | None
    auto_tolerance: float
