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

import ast
import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any, TypedDict

__all__ = ["OPTION_NAMES", "Options", "OffloadOptions", "describe"]


@dataclass(frozen=True)
class Options:
    """Every offloading option, with its default; the string under each field is its one-line
    doc (``HybridAdamW``'s ``Args:`` has the full text; :func:`describe` reads them, and
    docs/getting-started.md's table is generated from them)."""

    offload_fraction: float | str = 1.0
    """Share of the eligible params' optimizer-state bytes kept on the host, last-registered
    params first; "auto" chooses it from measurements."""
    min_offload_numel: int = 4096
    """Params with fewer elements keep their state on the device."""
    master_weights: bool | str = True
    """fp32 masters for bf16/fp16 params; False: none (the update in their dtype); "bf16-sr":
    none, the bf16 weights rounded stochastically (offloadopt's kernel)."""
    state_dtype: str = "fp32"
    """How exp_avg and exp_avg_sq are stored: "fp32" (torch's kernel, bitwise torch's AdamW),
    "bf16" or "int8" (compressed, offloadopt's kernel)."""
    pin_memory: bool = True
    """Pin the host buffers that cross the link; False reproduces the slow pageable path and,
    with CUDA, warns."""
    bucket_nbytes: int | None = None
    """fp32 state bytes per bucket, the pipelining unit; None: 64 MiB, 128 MiB with
    overlap="backward", 256 MiB with overlap="delayed"."""
    flush_denormal: bool = True
    """The CPU worker runs with flush-to-zero and denormals-are-zero: subnormal values (below
    1.2e-38) in the offloaded state become 0, where torch's kernel keeps them. False: bitwise
    torch's there too, at 4-9x torch's time on subnormal operands."""
    cpu_threads: int | None = None
    """The CPU worker's threads, at most 4 a CPU (64 at least); None: one per CPU of
    worker_cpus."""
    worker_cpus: Any = None
    """The CPUs the worker runs on: None (this process's CPUs, or its local rank's slice, less
    the training thread's core when updates overlap its work), "any" (no affinity) or CPU ids."""
    timeout_s: float = 600.0
    """The longest wait for the worker or a copy, in seconds (an error names what it waited
    for)."""
    overlap: str = "step"
    """When updates start: "step" (in step()), "backward" (during backward) or "delayed" (the
    delayed parameter update)."""
    wait: str = "step"
    """When new weights are waited for: "step" or "module" (each module watched with
    opt.watch(model) waits for its own)."""
    max_grad_norm: float | None = None
    """Clip the global grad norm inside the update (backward mode can then start updates at
    the end of backward)."""
    grads_final: bool = False
    """Declares that nothing edits grads between backward and step(), so backward mode starts
    each bucket's update as soon as its grads are complete."""
    speculate: bool = False
    """Backward mode with max_grad_norm or grad_scaler: start updates during backward as if
    nothing were clipped or skipped; redo them when the check at its end says otherwise. GPU
    memory: at most 8 bytes a step above the run without it (backups are pageable host memory)."""
    release_grads: bool = False
    """Free the device grads of offloaded params once their copy lands (backward mode)."""
    ddp: Any = None
    """The DistributedDataParallel model whose all-reduced buckets start backward mode's
    updates."""
    grad_scaler: Any = None
    """The torch.amp.GradScaler scaling this model's loss, attached so that backward mode checks
    infs and unscales in the update."""
    delay_after: int = 0
    """overlap="delayed": this many synchronous updates before the delay begins."""
    max_gpu_memory: int | str | None = None
    """A device budget ("120GB", "112GiB" or bytes): placement takes the smallest fraction that
    fits, at the first step."""
    max_host_memory: int | str | None = None
    """The host bytes the budget's choice may use; None: MemAvailable."""
    activation_bytes: int | str | None = None
    """Forward and backward's device bytes where they cannot be measured; None: measured (on
    CUDA)."""
    auto_tolerance: float = 0.05
    """offload_fraction="auto": how far above fraction 0's step the chosen fraction may go."""
    placement_policy: str = "state-bytes"
    """Internal: "megatron" is HybridDeviceOptimizer's placement (not an option of the others)."""

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


# the options' names: one value per optimizer, so a param group that carries one is refused
# when it differs (validation.validate_group) and a loaded group keeps the loader's
# (state/checkpoint.merge_group)
OPTION_NAMES = frozenset(f.name for f in dataclasses.fields(Options))


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


def describe() -> list[tuple[str, str, str, str]]:
    """The public options (:class:`OffloadOptions`' keys) in :class:`Options`' order, each as
    ``(name, type, default, doc)``: the annotation and the default as written in the source,
    and the string under the field, on one line."""
    tree = ast.parse(inspect.getsource(Options))
    docs, body = {}, tree.body[0].body
    for field, after in zip(body, body[1:], strict=False):
        if isinstance(field, ast.AnnAssign) and isinstance(after, ast.Expr):
            docs[field.target.id] = " ".join(after.value.value.split())
    public = OffloadOptions.__annotations__
    return [(f.name, str(f.type), f'"{f.default}"' if isinstance(f.default, str) else repr(f.default),
             docs[f.name]) for f in dataclasses.fields(Options) if f.name in public]  # fmt: skip
