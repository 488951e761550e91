"""HybridAdamW: torch's fused AdamW with a chosen fraction of its state on the host."""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.optim import Optimizer

from offloadopt import checkpoint
from offloadopt.host import Arena, Bucket, build_arenas
from offloadopt.pipeline import Pipeline, fused_adamw
from offloadopt.placement import ParamInfo, Placement, format_placement, place, update_dtype
from offloadopt.validation import validate_group, validate_options

__all__ = ["HybridAdamW"]


def _matching(grad: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``grad`` in ``like``'s dtype and strides. torch's fused kernels walk param, grad and
    moments as flat memory, so a grad with other strides (a transposed grad set by hand) would
    be paired with the wrong elements; autograd's grads already match and pass through."""
    if grad.dtype == like.dtype and grad.stride() == like.stride():
        return grad
    return torch.empty_like(like).copy_(grad)


class HybridAdamW(Optimizer):
    r"""AdamW with exactly the math of ``torch.optim.AdamW(fused=True)``, whose optimizer state
    and fp32 master weights live on the host for a chosen fraction of the parameters.

    Timeline of one training step:

    1. *Backward* (unchanged): grads appear on the device as usual.
    2. *step()*: device-resident params are updated by torch's fused AdamW on the compute
       stream. For the offloaded params, bucket by bucket (last-registered params first), a D2H
       side stream upcasts the grads into a device staging slot and copies them to a pinned host
       staging slot, then records an event; the host waits for that event only, runs
       ``torch._fused_adamw_`` on the bucket's fp32 master, ``exp_avg`` and ``exp_avg_sq``
       (per-param views, per-param ``step``), and queues the fp32 master H2D on a second side
       stream into a device slot, from which it is cast into the params. The D2H of bucket k+1
       and the H2D of bucket k-1 run while the CPU updates bucket k.
    3. *Before the next forward*: ``step()`` makes the compute stream wait (a GPU-side event
       wait, no host sync) for the last H2D, so the next forward reads the new weights.

    Casts run on the GPU in both directions: that leaves the CPU only the fused kernel, which
    is the bottleneck (bf16 over the link is cheap and the link is otherwise idle); see
    benchmarks/RESULTS.md for the figures behind this choice.

    Memory per parameter, bf16 params with masters: device-resident 2 (weight) + 2 (grad) +
    12 (fp32 master, ``exp_avg``, ``exp_avg_sq``) bytes on the GPU; offloaded 2 + 2 on the GPU and
    12 on the host (master 4 pinned, moments 8 pageable), plus staging of 4 x ``bucket_nbytes``
    on the GPU and 2 x ``bucket_nbytes`` pinned on the host. fp32 params: 4 + 4 + 8 on the GPU,
    or 4 + 4 on the GPU and 12 on the host (host weight copy pinned, moments).

    Without CUDA every param is a CPU tensor and the same path runs with the CPU standing in
    for the device: separate host state, plain copies, no pinning, no streams.

    Caveats: a param's placement is fixed when it is added (construction or
    ``add_param_group``); grads are copied out inside ``step()`` (not during backward); weights
    changed outside the optimizer are detected through ``param._version`` (edits through
    ``param.data`` are not seen); ``amsgrad``, ``capturable`` and ``differentiable`` are not
    supported; ``fused`` and ``foreach`` are accepted and ignored (torch's fused kernel always runs).

    Args:
        params: tensors, ``named_parameters()`` or param-group dicts; a group may carry
            ``"offload": True`` (all its trainable params go to the host) or ``False`` (none do).
        lr, betas, eps, weight_decay, maximize: as ``torch.optim.AdamW``; ``lr`` may be a Tensor.
        offload_fraction: share in [0, 1] of the eligible params' optimizer-state bytes kept
            on the host (see :mod:`offloadopt.placement`).
        min_offload_numel: params with fewer elements keep their state on the device.
        master_weights: keep an fp32 master for bf16/fp16 params (on the host for offloaded
            params, on the device otherwise); with False they update in their own dtype.
        pin_memory: pin crossing host buffers (checked); False reproduces the slow pageable path
            and warns once.
        bucket_nbytes: target bytes of fp32 state per bucket (pipelining unit).

    Raises:
        ValueError, TypeError: a bad argument, named in the message, before anything is built.
        NotImplementedError: ``amsgrad``, ``capturable`` or ``differentiable`` set.
        PinnedAllocationError: pinned host memory could not be had (the bytes asked for).

    Example::

        model = GPT(cfg).cuda().bfloat16()
        opt = HybridAdamW(model.named_parameters(), lr=3e-4, offload_fraction=1.0)
        loss = model(x, y)[1]; loss.backward(); opt.step(); opt.zero_grad()
    """

    def __init__(
        self,
        params,
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        offload_fraction: float = 1.0,
        min_offload_numel: int = 4096,
        master_weights: bool = True,
        pin_memory: bool = True,
        bucket_nbytes: int = 64 * 2**20,
    ):
        validate_options(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
            maximize=maximize, capturable=capturable, differentiable=differentiable,
            offload_fraction=offload_fraction, min_offload_numel=min_offload_numel,
            master_weights=master_weights, pin_memory=pin_memory, bucket_nbytes=bucket_nbytes,
        )  # fmt: skip
        if isinstance(params, torch.Tensor):
            raise TypeError(
                "params argument given to the optimizer should be an iterable of Tensors or dicts, "
                f"but got {torch.typename(params)}"
            )
        params = list(params)
        if not params:
            raise ValueError("optimizer got an empty parameter list")
        self.offload_fraction = float(offload_fraction)
        self.min_offload_numel = min_offload_numel
        self.master_weights = master_weights
        self.pin_memory = pin_memory
        self.bucket_nbytes = bucket_nbytes
        self._ready = False
        # torch's group flags, so a cross-load into torch.optim.AdamW keeps its fused kernel.
        defaults = dict(
            lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=False,
            maximize=maximize, foreach=None, capturable=False, differentiable=False, fused=True,
            decoupled_weight_decay=True, offload=None,
        )  # fmt: skip
        self.placement: list[Placement] = []
        self.arenas: list[Arena] = []
        self.buckets: list[Bucket] = []
        self._home: dict[torch.Tensor, tuple[Arena, int]] = {}  # offloaded param -> its place
        self._written: dict[torch.Tensor, tuple[int, int]] = {}  # param -> (_version, data_ptr)
        self._pipelines: dict[torch.device, Pipeline] = {}  # staging and side streams per device
        self._stats: dict[str, float] = {}
        self._warned: set[str] = set()
        super().__init__(params, defaults)
        self._place(list(range(len(self.param_groups))))
        self._ready = True

    # ------------------------------------------------------------------ construction
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (``torch.optim`` contract); its params are placed by the same rule,
        with the fraction applied to the new group's eligible state bytes."""
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, but got {torch.typename(param_group)}")
        param_group = validate_group(param_group, self.defaults)
        super().add_param_group(param_group)
        if self._ready:
            try:
                self._place([len(self.param_groups) - 1])
            except BaseException:
                self.param_groups.pop()  # nothing half built: the group goes with its failure
                raise

    def _param_name(self, group: dict[str, Any], gi: int, i: int) -> str:
        names = group.get("param_names")
        return names[i] if names else f"group{gi}.param{i}"

    def _place(self, group_indices: list[int]) -> None:
        """Place the params of these groups and allocate their host buffers (all or nothing)."""
        start = sum(len(g["params"]) for g in self.param_groups[: group_indices[0]])
        infos, tensors = [], []
        for gi in group_indices:
            g = self.param_groups[gi]
            for i, p in enumerate(g["params"]):
                name = self._param_name(g, gi, i)
                infos.append(
                    ParamInfo(start + len(infos), name, gi, tuple(p.shape), p.dtype,
                              p.requires_grad, g["offload"], p.is_contiguous())
                )  # fmt: skip
                tensors.append(p)
        placements = place(
            infos, self.offload_fraction, self.min_offload_numel, self.master_weights
        )
        order = [(tensors[k], pl.name, pl.group, update_dtype(pl.dtype, self.master_weights))
                 for k, pl in reversed(list(enumerate(placements))) if pl.offloaded]  # fmt: skip
        arenas, buckets = build_arenas(order, self.bucket_nbytes)
        devices = {a.device for a in arenas}
        if self.pin_memory is False and any(d.type == "cuda" for d in devices):
            self._warn_once(
                "pageable",
                "HybridAdamW(pin_memory=False): host buffers are pageable, so every copy over the "
                "link takes the slow pageable path; this setting exists to reproduce and measure it",
            )
        for arena in arenas:
            arena.allocate(pin=self.pin_memory and arena.device.type == "cuda", owner=self)
        # Slots as large as the largest bucket (at most bucket_nbytes); a later add_param_group
        # that needs larger ones replaces them, before any step can have a copy in flight.
        need = {d: max(b.nbytes for b in buckets if b.arena.device == d) for d in devices}
        pin = {d: self.pin_memory and d.type == "cuda" for d in devices}
        new_pipelines = {d: Pipeline(d, n, pin[d], self) for d, n in need.items()
                         if d not in self._pipelines or self._pipelines[d].nbytes < n}  # fmt: skip
        # Everything allocated: commit.
        for d, pipeline in new_pipelines.items():
            old = self._pipelines.get(d)
            if old is not None:
                if old.cuda:
                    torch.cuda.synchronize(d)  # no copy of the last step still uses the old slots
                pipeline.h2d_events, pipeline.side_stream_hook = (
                    old.h2d_events,
                    old.side_stream_hook,
                )
            self._pipelines[d] = pipeline
            for b in self.buckets:
                b._slot_views.clear()
        for arena in arenas:
            for k, p in enumerate(arena.params):
                self._home[p] = (arena, k)
        odd = [pl.name for pl in placements if pl.reason == "non-contiguous"]
        if odd and self.offload_fraction > 0:
            self._warn_once(
                "non-contiguous",
                f"{len(odd)} params are not contiguous (e.g. channels_last conv weights: "
                f"{', '.join(odd[:3])}) and keep their state on the device",
            )
        self.arenas.extend(arenas)
        self.buckets.extend(buckets)
        self.placement.extend(placements)
        if buckets and torch.get_num_threads() == 1 and (os.cpu_count() or 1) > 1:
            self._warn_once(
                "threads",
                f"the CPU AdamW update will run on 1 thread of {os.cpu_count()} cores "
                f"(OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')!r}; torchrun sets 1 when it starts "
                "several processes): call torch.set_num_threads(cores // local ranks)",
            )
        self._check_pinned()

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, stacklevel=3)

    # ------------------------------------------------------------------ reporting
    def crossing_host_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Every host buffer that crosses the link: ``(label, tensor)`` pairs."""
        out = []
        for k, a in enumerate(self.arenas):
            if a.device.type == "cuda":
                out.append(
                    (
                        f"arena {k} weights (group {a.group}, {len(a.params)} params, first {a.names[0]})",
                        a.weight,
                    )
                )
        for d, pipeline in self._pipelines.items():
            if d.type == "cuda":
                out += [(f"{d} grad staging slot {i}", t) for i, t in enumerate(pipeline.host)]
        return out

    def _check_pinned(self) -> None:
        """The pinned invariant: every crossing host buffer is pinned (unless pin_memory=False)."""
        if not self.pin_memory:
            return
        bad = [f"{label}: {t.numel() * t.element_size()} bytes" for label, t in self.crossing_host_tensors()
               if t.numel() and not t.is_pinned()]  # fmt: skip
        if bad:
            raise RuntimeError(
                "host buffers that cross the link must be pinned; not pinned: " + "; ".join(bad)
            )

    def placement_table(self) -> str:
        """The placement as a fixed-width table (see :func:`offloadopt.placement.format_placement`)."""
        return format_placement(self.placement)

    @property
    def host_nbytes(self) -> int:
        """Bytes of host memory held for optimizer state and staging."""
        n = sum(3 * a.nbytes for a in self.arenas)
        return n + sum(sum(t.numel() for t in p.host) for p in self._pipelines.values())

    @property
    def pinned_nbytes(self) -> int:
        """Of :attr:`host_nbytes`, the bytes that are pinned."""
        return sum(
            t.numel() * t.element_size() for _, t in self.crossing_host_tensors() if t.is_pinned()
        )

    @property
    def stats(self) -> dict[str, float]:
        """Figures of the last ``step()``: ``d2h_wait_ms`` (host time blocked on D2H events),
        ``cpu_update_ms`` (host time in the fused kernel), ``device_update_ms`` (host time
        launching the device-resident update), ``collect_ms`` (host time checking grads and
        state before the update), ``h2d_ms`` and ``d2h_ms`` (GPU time of the
        copies and casts on the side streams), ``d2h_nbytes`` / ``h2d_nbytes`` (bytes over the
        link), ``step_ms`` (host wall time of ``step()``)."""
        for pipeline in self._pipelines.values():
            if pipeline.timing:
                for key, ms in pipeline.collect_timing().items():
                    self._stats[key] = self._stats.get(key, 0.0) + ms
        return dict(self._stats)

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        """One AdamW step over every param with a grad; params whose grad is None are skipped.

        Raises:
            RuntimeError: a sparse grad, or a grad whose shape differs from its param (named).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        t0 = time.perf_counter()
        work = self._collect()
        collect_ms = (time.perf_counter() - t0) * 1e3
        stats = dict.fromkeys(
            ("d2h_wait_ms", "cpu_update_ms", "device_update_ms", "h2d_ms", "d2h_ms"), 0.0
        )
        stats.update(d2h_nbytes=0, h2d_nbytes=0, collect_ms=collect_ms)
        for pipeline in self._pipelines.values():
            pipeline.timing = []
        # Marks all work queued on the compute stream before this step (backward, clipping):
        # the side streams wait on it, so grads are final and no kernel still reads old weights.
        before = {d: p.record_start() for d, p in self._pipelines.items()}
        t = time.perf_counter()
        for gi, params in work["device"].items():
            self._device_update(self.param_groups[gi], params)
        stats["device_update_ms"] = (time.perf_counter() - t) * 1e3
        # Each param's step advances once, even when buckets cut it in several segments.
        if work["host_params"]:
            torch._foreach_add_([self.state[p]["step"] for p in work["host_params"]], 1)
        by_device: dict[torch.device, list[tuple[Bucket, list[int]]]] = {}
        for b, idx in work["host"]:
            by_device.setdefault(b.arena.device, []).append((b, idx))
        for device, items in by_device.items():
            self._pipelines[device].run(items, self.state, self.param_groups, before[device], stats)
        for p in work["host_params"]:
            self._mark_written(p)
        stats["step_ms"] = (time.perf_counter() - t0) * 1e3
        self._stats = stats
        return loss

    def is_offloaded(self, p: torch.Tensor) -> bool:
        """Whether ``p``'s optimizer state (and fp32 master) lives on the host."""
        return p in self._home

    def _collect(self) -> dict[str, Any]:
        """Validate grads, refresh stale masters, create state lazily; sort work by placement."""
        device_work: dict[int, list[torch.Tensor]] = {}
        host_params: list[torch.Tensor] = []
        for gi, group in enumerate(self.param_groups):
            for i, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                if p.grad.layout != torch.strided:
                    raise RuntimeError(
                        "HybridAdamW does not support sparse gradients: "
                        f"{self._param_name(group, gi, i)} has a {p.grad.layout} grad"
                    )
                if p.grad.shape != p.shape:
                    raise RuntimeError(
                        f"grad of {self._param_name(group, gi, i)} has shape "
                        f"{tuple(p.grad.shape)}, param {tuple(p.shape)}"
                    )
        for gi, group in enumerate(self.param_groups):
            for i, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                if p not in self.state or not self.state[p]:
                    self._init_state(p)
                else:
                    self._refresh_if_stale(p, self._param_name(group, gi, i))
                if p in self._home:
                    host_params.append(p)
                else:
                    device_work.setdefault(gi, []).append(p)
        with_grad = {id(p) for p in host_params}
        host_work = []
        for b in self.buckets:
            idx = [n for n, seg in enumerate(b.segments) if id(b.arena.params[seg.k]) in with_grad]
            if idx:
                host_work.append((b, idx))
        return {"device": device_work, "host": host_work, "host_params": host_params}

    def _mirror(self, p: torch.Tensor) -> torch.Tensor | None:
        """The optimizer's own copy of ``p``'s weights (host weight view or device master)."""
        if p in self._home:
            arena, k = self._home[p]
            return arena.view(arena.weight, k)
        return self.state.get(p, {}).get("master")

    def _init_state(self, p: torch.Tensor) -> None:
        """Lazily create ``p``'s state at its first grad, as torch does."""
        if p in self._home:
            arena, k = self._home[p]
            weight = arena.view(arena.weight, k)
            weight.copy_(p.detach())  # blocking D2H (once per param): master = weights
            state = {
                "step": torch.zeros((), dtype=torch.float32),
                "exp_avg": arena.view(arena.exp_avg, k).zero_(),
                "exp_avg_sq": arena.view(arena.exp_avg_sq, k).zero_(),
            }
            if arena.dtype != p.dtype:
                state["master"] = weight
        else:
            udt = update_dtype(p.dtype, self.master_weights)
            state = {
                "step": torch.zeros((), dtype=torch.float32, device=p.device),
                "exp_avg": torch.zeros_like(p, dtype=udt, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, dtype=udt, memory_format=torch.preserve_format),
            }
            if udt != p.dtype:
                state["master"] = p.detach().to(udt, memory_format=torch.preserve_format, copy=True)
        self.state[p] = state
        self._mark_written(p)

    def _mark_written(self, p: torch.Tensor) -> None:
        self._written[p] = (p._version, p.data_ptr())

    def _refresh_if_stale(self, p: torch.Tensor, name: str) -> None:
        """No stale masters: weights changed outside the optimizer win over its copy."""
        mirror = self._mirror(p)
        if mirror is None or self._written.get(p) == (p._version, p.data_ptr()):
            return
        current = p.detach().to(mirror.device)
        changed = mirror.to(p.dtype) != current  # (shape of p) bool, where the mirror is stale
        if changed.any():
            warnings.warn(
                f"the weights of {name} changed outside the optimizer since its last step "
                f"({int(changed.sum())} of {p.numel()} elements); its master copy was refreshed there",
                stacklevel=4,
            )
            # Only the changed elements: the others keep their fp32 master's precision.
            mirror.copy_(torch.where(changed, current.to(mirror.dtype), mirror))
        self._mark_written(p)

    def _device_update(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        """Fused AdamW on the device, on the compute stream; fp32 masters where they exist,
        fed grads upcast chunk by chunk so the fp32 temporaries stay under ``bucket_nbytes``."""
        plain = [p for p in params if "master" not in self.state[p]]
        fused_adamw(group, plain, [_matching(p.grad, p) for p in plain], *self._state_lists(plain))
        mastered = [p for p in params if "master" in self.state[p]]
        chunk: list[torch.Tensor] = []
        nbytes = 0
        for n, p in enumerate(mastered):
            chunk.append(p)
            nbytes += p.numel() * 4
            if nbytes >= self.bucket_nbytes or n == len(mastered) - 1:
                masters = [self.state[q]["master"] for q in chunk]
                grads = [_matching(q.grad, m) for q, m in zip(chunk, masters, strict=True)]
                fused_adamw(group, masters, grads, *self._state_lists(chunk))
                torch._foreach_copy_(chunk, masters)  # weights = round(master)
                for q in chunk:
                    self._mark_written(q)
                chunk, nbytes = [], 0

    def _state_lists(self, params: list[torch.Tensor]):
        s = [self.state[p] for p in params]
        return [x["exp_avg"] for x in s], [x["exp_avg_sq"] for x in s], [x["step"] for x in s]

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """``torch.optim.AdamW(fused=True)``'s layout plus ``"master"`` (fp32) where one exists.

        Offloaded state is returned as standalone copies (a view of a bucket would save the
        whole bucket); device state is returned by reference, as torch does. Loadable with
        ``torch.load(weights_only=True)``.
        """
        sd = super().state_dict()
        return checkpoint.detach_host_views(self, sd)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Validate the whole dict, then copy into the existing buffers (see
        :func:`offloadopt.checkpoint.load`).

        Raises:
            ValueError: the dict does not fit this optimizer; nothing was changed.
        """
        checkpoint.load(self, state_dict)
        self._check_pinned()

    def __repr__(self) -> str:
        head = super().__repr__()
        n = sum(1 for p in self.placement if p.offloaded)
        return (
            f"{head[:-2]}\n    offload_fraction: {self.offload_fraction}\n"
            f"    offloaded params: {n} of {len(self.placement)}\n)"
        )

    def __getstate__(self):
        # torch's Optimizer pickles only defaults, state and groups; ours would come back
        # without its pinned arenas, staging and streams, broken. Refuse clearly instead.
        raise TypeError(
            "HybridAdamW cannot be pickled or deep-copied: its state lives in pinned host buffers "
            "and CUDA streams of this process; save and load opt.state_dict() instead"
        )
