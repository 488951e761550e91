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
from offloadopt.host import Arena, Bucket, alloc_host, build_arenas
from offloadopt.placement import ParamInfo, Placement, format_placement, place, update_dtype

__all__ = ["HybridAdamW"]

_SLOTS = 2  # staging slots per direction: bucket k+1 moves while bucket k is updated


def validate_hparams(lr: Any, betas: Any, eps: Any, weight_decay: Any) -> None:
    """Raise ``ValueError``/``TypeError`` naming the bad value, as ``torch.optim.AdamW`` does."""
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1:
            raise ValueError(f"Tensor lr must be 1-element, got shape {tuple(lr.shape)}")
        lr_value = float(lr.detach().cpu())
    elif isinstance(lr, (int, float)) and not isinstance(lr, bool):
        lr_value = float(lr)
    else:
        raise TypeError(f"Invalid learning rate: {lr!r} (expected a float or a 1-element Tensor)")
    if not lr_value >= 0.0:
        raise ValueError(f"Invalid learning rate: {lr}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0.0:
        raise ValueError(f"Invalid epsilon value: {eps!r}")
    if isinstance(weight_decay, bool) or not isinstance(weight_decay, (int, float)):
        raise TypeError(f"Invalid weight_decay value: {weight_decay!r}")
    if not weight_decay >= 0.0:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"Invalid betas: {betas!r} (expected a pair)")
    for i, b in enumerate(betas):
        b = float(b) if isinstance(b, torch.Tensor) and b.numel() == 1 else b
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0.0 <= b < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {betas[i]!r}")


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
        validate_hparams(lr, betas, eps, weight_decay)
        if (
            isinstance(offload_fraction, bool)
            or not isinstance(offload_fraction, (int, float))
            or not 0.0 <= offload_fraction <= 1.0
        ):
            raise ValueError(
                f"Invalid offload_fraction: {offload_fraction!r} (expected a number in [0, 1])"
            )
        if (
            isinstance(min_offload_numel, bool)
            or not isinstance(min_offload_numel, int)
            or min_offload_numel < 0
        ):
            raise ValueError(
                f"Invalid min_offload_numel: {min_offload_numel!r} (expected an int >= 0)"
            )
        if (
            isinstance(bucket_nbytes, bool)
            or not isinstance(bucket_nbytes, int)
            or bucket_nbytes <= 0
        ):
            raise ValueError(f"Invalid bucket_nbytes: {bucket_nbytes!r} (expected an int > 0)")
        for flag, value in [
            ("master_weights", master_weights),
            ("pin_memory", pin_memory),
            ("maximize", maximize),
        ]:
            if not isinstance(value, bool):
                raise TypeError(f"Invalid {flag}: {value!r} (expected a bool)")
        if amsgrad:
            raise NotImplementedError("HybridAdamW does not support amsgrad=True yet")
        if capturable:
            raise NotImplementedError("HybridAdamW does not support capturable=True (CUDA graphs)")
        if differentiable:
            raise NotImplementedError("HybridAdamW does not support differentiable=True")
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
        self._staging: dict[torch.device, dict[str, list[torch.Tensor]]] = {}
        self._streams: dict[torch.device, tuple[torch.cuda.Stream, torch.cuda.Stream]] = {}
        self._h2d_events: dict[int, torch.cuda.Event] = {}  # id(bucket) -> its last H2D
        self._timing: list[tuple[str, Any, Any]] = []
        self._stats: dict[str, float] = {}
        self._warned: set[str] = set()
        # Test hook: called as hook("d2h" | "h2d") inside each side-stream context, before the
        # copies; the race tests queue a torch.cuda._sleep there to make the copies late.
        self._side_stream_hook: Callable[[str], None] | None = None
        super().__init__(params, defaults)
        self._place(list(range(len(self.param_groups))))
        self._ready = True

    # ------------------------------------------------------------------ construction
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (``torch.optim`` contract); its params are placed by the same rule,
        with the fraction applied to the new group's eligible state bytes."""
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, but got {torch.typename(param_group)}")
        param_group = dict(param_group)
        raw = param_group["params"]
        raw = [raw] if isinstance(raw, torch.Tensor) else list(raw)
        param_group["params"] = raw
        tensors = [p[1] if isinstance(p, tuple) else p for p in raw]
        names = [p[0] if isinstance(p, tuple) else None for p in raw]
        seen: dict[int, int] = {}
        for i, p in enumerate(tensors):
            label = names[i] or f"param {i} of the new group"
            if not isinstance(p, torch.Tensor):
                raise TypeError(
                    f"optimizer can only optimize Tensors, but {label} is {torch.typename(p)}"
                )
            if id(p) in seen:
                raise ValueError(
                    f"duplicate parameter in one group: {label} (shape {tuple(p.shape)}) appears twice"
                )
            seen[id(p)] = i
            if p.is_complex():
                raise ValueError(f"complex parameters are not supported: {label} is {p.dtype}")
            if not p.is_floating_point():
                raise ValueError(
                    f"{label} has dtype {p.dtype}: only floating-point params can be optimized"
                )
            if p.layout != torch.strided:
                raise ValueError(
                    f"sparse parameters are not supported: {label} has layout {p.layout}"
                )
            if p.device.type not in ("cpu", "cuda"):
                raise ValueError(
                    f"{label} is on {p.device}: HybridAdamW supports cpu and cuda params"
                )
        for key in ("lr", "betas", "eps", "weight_decay"):
            if key in param_group:
                validate_hparams(
                    param_group.get("lr", self.defaults["lr"]),
                    param_group.get("betas", self.defaults["betas"]),
                    param_group.get("eps", self.defaults["eps"]),
                    param_group.get("weight_decay", self.defaults["weight_decay"]),
                )
                break
        offload = param_group.get("offload")
        if offload is not None and not isinstance(offload, bool):
            raise ValueError(
                f"Invalid 'offload' group key: {offload!r} (expected True, False or None)"
            )
        if param_group.get("amsgrad"):
            raise NotImplementedError("HybridAdamW does not support amsgrad=True yet")
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
        staging = {d: self._make_staging(d, n) for d, n in need.items()
                   if d not in self._staging or self._staging[d]["host"][0].numel() < n}  # fmt: skip
        # Everything allocated: commit.
        for d, s in staging.items():
            if d in self._streams:
                torch.cuda.synchronize(d)  # no copy of the last step still uses the old slots
            self._staging[d] = s
            for b in self.buckets:
                b._slot_views.clear()
            if d.type == "cuda" and d not in self._streams:
                self._streams[d] = (torch.cuda.Stream(d), torch.cuda.Stream(d))  # D2H, H2D
        for arena in arenas:
            for k, p in enumerate(arena.params):
                self._home[p] = (arena, k)
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

    def _make_staging(self, device: torch.device, nbytes: int) -> dict[str, list[torch.Tensor]]:
        """Byte slots of ``nbytes`` for one device: host (pinned on CUDA) and, on CUDA, device
        slots each way."""
        pin = self.pin_memory and device.type == "cuda"
        s = {
            "host": [
                alloc_host(nbytes, torch.uint8, pin, "grad staging", self) for _ in range(_SLOTS)
            ]
        }
        if device.type == "cuda":
            s["d2h"] = [
                torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(_SLOTS)
            ]
            s["h2d"] = [
                torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(_SLOTS)
            ]
        return s

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
        for d, s in self._staging.items():
            if d.type == "cuda":
                out += [(f"{d} grad staging slot {i}", t) for i, t in enumerate(s["host"])]
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
        return n + sum(sum(t.numel() for t in s["host"]) for s in self._staging.values())

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
        if self._timing:
            totals = {"d2h_ms": 0.0, "h2d_ms": 0.0}
            for key, start, end in self._timing:
                end.synchronize()  # the events of the last step; long done by the next forward
                totals[key] += start.elapsed_time(end)
            self._stats.update(totals)
            self._timing = []
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
        self._timing = []
        compute = {d: torch.cuda.current_stream(d) for d in self._streams}
        # Marks all work queued on the compute stream before this step (backward, clipping):
        # the side streams wait on it, so grads are final and no kernel still reads old weights.
        before = {d: s.record_event() for d, s in compute.items()}
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
            self._offloaded_update(device, items, before.get(device), stats)
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
                name = self._param_name(group, gi, i)
                if p.grad.is_sparse or p.grad.layout != torch.strided:
                    raise RuntimeError(
                        f"HybridAdamW does not support sparse gradients: {name} has a {p.grad.layout} grad"
                    )
                if p.grad.shape != p.shape:
                    raise RuntimeError(
                        f"grad of {name} has shape {tuple(p.grad.shape)}, param {tuple(p.shape)}"
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
        if not torch.equal(mirror.to(p.dtype), current):
            warnings.warn(
                f"the weights of {name} changed outside the optimizer since its last step; "
                "its master copy was refreshed from them",
                stacklevel=4,
            )
            mirror.copy_(current)
        self._mark_written(p)

    def _lr_for(self, group: dict[str, Any], device: torch.device):
        lr = group["lr"]
        if isinstance(lr, torch.Tensor) and lr.device != device:
            # One synchronous copy: the kernel must not read an lr still in flight (torch's
            # functional fused path moves it with non_blocking=True and can race).
            return lr.to(device)
        return lr

    def _adamw(
        self, group: dict[str, Any], weights, grads, exp_avgs, exp_avg_sqs, steps, increment=True
    ) -> None:
        """torch's own fused AdamW kernel over lists (per-param views and steps); with
        ``increment=False`` the steps were already advanced (params split across buckets)."""
        if not weights:
            return
        beta1, beta2 = group["betas"]
        if increment:
            torch._foreach_add_(steps, 1)
        torch._fused_adamw_(
            weights, grads, exp_avgs, exp_avg_sqs, [], steps, amsgrad=False,
            lr=self._lr_for(group, weights[0].device), beta1=float(beta1), beta2=float(beta2),
            weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
        )  # fmt: skip

    def _device_update(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        """Fused AdamW on the device, on the compute stream; fp32 masters where they exist,
        fed grads upcast chunk by chunk so the fp32 temporaries stay under ``bucket_nbytes``."""
        plain = [p for p in params if "master" not in self.state[p]]
        self._adamw(group, plain, [p.grad for p in plain], *self._state_lists(plain))
        mastered = [p for p in params if "master" in self.state[p]]
        chunk: list[torch.Tensor] = []
        nbytes = 0
        for n, p in enumerate(mastered):
            chunk.append(p)
            nbytes += p.numel() * 4
            if nbytes >= self.bucket_nbytes or n == len(mastered) - 1:
                masters = [self.state[q]["master"] for q in chunk]
                grads = [q.grad.to(m.dtype) for q, m in zip(chunk, masters, strict=True)]
                self._adamw(group, masters, grads, *self._state_lists(chunk))
                torch._foreach_copy_(chunk, masters)  # weights = round(master)
                for q in chunk:
                    self._mark_written(q)
                chunk, nbytes = [], 0

    def _state_lists(self, params: list[torch.Tensor]):
        s = [self.state[p] for p in params]
        return [x["exp_avg"] for x in s], [x["exp_avg_sq"] for x in s], [x["step"] for x in s]

    @staticmethod
    def _grad_segments(b: Bucket, idx: list[int]) -> list[torch.Tensor]:
        """The flat grad ranges of a bucket's segments ``idx``."""
        segs = [b.segments[i] for i in idx]
        return [b.arena.params[s.k].grad.reshape(-1)[s.lo : s.hi] for s in segs]

    def _offloaded_update(self, device, items, before, stats) -> None:
        """The bucket pipeline: D2H (k+1) and H2D (k-1) overlap the CPU update of bucket k.

        ``items``: ``(bucket, segment indices whose param has a grad)`` in bucket order.
        """
        staging = self._staging[device]
        cuda = device.type == "cuda"
        d2h, h2d = self._streams[device] if cuda else (None, None)
        if cuda:
            d2h.wait_event(before)  # grads final: backward and any in-place edit of them done
            h2d.wait_event(before)  # no queued compute kernel still reads the old weights
        pending: dict[int, Any] = {}

        def launch_d2h(n: int) -> None:
            b, idx = items[n]
            host_slot = staging["host"][n % _SLOTS]
            if not cuda:
                views = b.slot_views(host_slot)
                torch._foreach_copy_([views[i] for i in idx], self._grad_segments(b, idx))
                return
            dev_slot = staging["d2h"][n % _SLOTS]
            with torch.cuda.stream(d2h):
                if self._side_stream_hook is not None:
                    self._side_stream_hook("d2h")
                start = d2h.record_event(torch.cuda.Event(enable_timing=True))
                # On the side stream: a non-contiguous grad's flat copy is made (and freed) there.
                grads = self._grad_segments(b, idx)
                views = b.slot_views(dev_slot)
                torch._foreach_copy_([views[i] for i in idx], grads)  # upcast on the GPU
                # non_blocking: same dtype, both contiguous, host side pinned -> a true async DMA;
                # the host reads it only after the event below.
                host_slot[: b.nbytes].copy_(dev_slot[: b.nbytes], non_blocking=True)
                pending[n] = d2h.record_event(torch.cuda.Event(enable_timing=True))
                self._timing.append(("d2h_ms", start, pending[n]))
            stats["d2h_nbytes"] += b.nbytes

        for n in range(min(_SLOTS, len(items))):
            launch_d2h(n)
        for n, (b, idx) in enumerate(items):
            group = self.param_groups[b.arena.group]
            t = time.perf_counter()
            if cuda:
                pending.pop(n).synchronize()  # the host reads the pinned grads only once D2H landed
                last_h2d = self._h2d_events.get(id(b))
                if last_h2d is not None:
                    last_h2d.synchronize()  # last step's H2D from these weights is done: safe to overwrite
            stats["d2h_wait_ms"] += (time.perf_counter() - t) * 1e3
            grads = b.slot_views(staging["host"][n % _SLOTS])
            weights = b.state_views(b.arena.weight)
            exp_avgs = b.state_views(b.arena.exp_avg)
            exp_avg_sqs = b.state_views(b.arena.exp_avg_sq)
            steps = [self.state[b.arena.params[seg.k]]["step"] for seg in b.segments]
            t = time.perf_counter()
            with torch.profiler.record_function("offloadopt.cpu_update"):
                self._adamw(group, *([x[i] for i in idx] for x in (weights, grads, exp_avgs, exp_avg_sqs, steps)),
                            increment=False)  # fmt: skip
            stats["cpu_update_ms"] += (time.perf_counter() - t) * 1e3
            if n + _SLOTS < len(items):
                launch_d2h(n + _SLOTS)  # its slot's grads were consumed by the kernel above
            targets = b.param_views()
            if not cuda:
                torch._foreach_copy_([targets[i] for i in idx], [weights[i] for i in idx])
            else:
                dev_slot = staging["h2d"][n % _SLOTS]
                with torch.cuda.stream(h2d):
                    if self._side_stream_hook is not None:
                        self._side_stream_hook("h2d")
                    start = h2d.record_event(torch.cuda.Event(enable_timing=True))
                    # non_blocking: pinned source, same dtype, contiguous; the host does not write
                    # these weights again before this bucket's event (checked at the next step).
                    dev_slot[: b.nbytes].copy_(
                        b.arena.weight[b.lo : b.hi].view(torch.uint8), non_blocking=True
                    )
                    views = b.slot_views(dev_slot)
                    torch._foreach_copy_(
                        [targets[i] for i in idx], [views[i] for i in idx]
                    )  # downcast on the GPU
                    ev = h2d.record_event(torch.cuda.Event(enable_timing=True))
                self._h2d_events[id(b)] = ev
                self._timing.append(("h2d_ms", start, ev))
                stats["h2d_nbytes"] += b.nbytes
        for b, idx in items:
            for i in idx:
                self._mark_written(b.arena.params[b.segments[i].k])
        if cuda:
            # GPU-side wait, no host sync: the next forward on the compute stream reads the
            # params only after the last H2D (the h2d stream runs its copies in order).
            torch.cuda.current_stream(device).wait_event(self._h2d_events[id(items[-1][0])])

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
        return f"{head[:-1]}offload_fraction: {self.offload_fraction}\n    offloaded params: {n} of {len(self.placement)}\n)"
