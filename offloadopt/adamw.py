"""HybridAdamW: AdamW's signature (``torch.optim.AdamW``) on the hybrid machinery
(offloadopt/optim.py), with its timeline, memory and caveats in the class docstring."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from offloadopt.optim import HybridOptimizer
from offloadopt.rules import ADAMW

if TYPE_CHECKING:  # the keywords of **options, for IDEs and type checkers
    from typing_extensions import Unpack

    from offloadopt.options import OffloadOptions

__all__ = ["HybridAdamW"]


class HybridAdamW(HybridOptimizer):
    r"""AdamW with exactly the math of ``torch.optim.AdamW(fused=True)``, whose optimizer state
    and fp32 master weights live on the host for a chosen fraction of the parameters.

    Timeline of one training step (``overlap="step"``, the default; offloadopt/step/start.py's note
    says what ``overlap="backward"`` and ``wait="module"`` move earlier):

    1. *Backward* (unchanged): grads appear on the device as usual.
    2. *step()*: phase 0 freezes every group's hyperparameters and checks every grad; phase 1
       updates the device-resident params with torch's fused AdamW on the compute stream;
       phase 2 moves the offloaded params bucket by bucket (last-registered params first): a
       D2H side stream upcasts the grads into a device staging slot and copies them to a
       pinned host slot; a CPU worker thread waits for that event, runs ``torch._fused_adamw_``
       on the bucket's fp32 master, ``exp_avg`` and ``exp_avg_sq`` (per-param views, per-param
       ``step``) and queues the master's H2D on a second side stream into a device slot, from
       which it is cast into the params. The D2H of bucket k+1 and the H2D of bucket k-1 run
       while the worker updates bucket k. ``step()`` waits for the worker before it returns.
    3. *Before the next forward*: phase 3 makes the compute stream wait (a GPU-side event
       wait, no host sync) for the last H2D, so the next forward reads the new weights.

    The worker runs with flush-to-zero and denormals-are-zero (``flush_denormal=True``): torch's
    CPU kernel is 4-9x slower on subnormal operands (tiny grads, an ``exp_avg`` stuck near
    zero); flushing changes results only where values are subnormal, far below where ``eps``
    dominates the update. With ``flush_denormal=False`` results are bitwise torch's there too.
    The training thread's floating-point mode is never changed.

    Memory per parameter, bf16 params with masters: device-resident 2 (weight) + 2 (grad) +
    12 (fp32 master, ``exp_avg``, ``exp_avg_sq``) bytes on the GPU; offloaded 2 + 2 on the GPU and
    12 on the host (master 4 pinned, moments 8 pageable), plus staging of 4 x ``bucket_nbytes``
    on the GPU and 2 x ``bucket_nbytes`` pinned on the host. fp32 params: 4 + 4 + 8 on the GPU,
    or 4 + 4 on the GPU and 12 on the host (master copy pinned, moments).

    Without CUDA every param is a CPU tensor and the same path runs with the CPU standing in
    for the device: separate host state, plain copies, no pinning, no streams.

    Caveats: a param's placement is made when it is added (construction or
    ``add_param_group``) and changes only through :meth:`set_offload_fraction` or
    ``offload_fraction="auto"``; in step mode grads are copied out inside ``step()``
    (``overlap="backward"`` copies them during backward); weights
    changed outside the optimizer are detected through ``param._version`` (edits through
    ``param.data`` are not seen); ``amsgrad``, ``capturable`` and ``differentiable`` are not
    supported; ``fused`` and ``foreach`` are accepted and ignored (torch's fused kernel always runs).

    Args:
        params: tensors, ``named_parameters()`` or param-group dicts (a list, not a set); a
            group may carry ``"offload": True`` (all its trainable params go to the host) or
            ``False`` (none do), read when the group is placed (``step()`` refuses a change).
        lr: the learning rate, as ``torch.optim.AdamW``'s (a float or a 1-element Tensor).
        betas: the moments' coefficients (both floats or both 1-element Tensors).
        eps: added to the denominator.
        weight_decay: decoupled weight decay (AdamW's).
        amsgrad: not supported (``NotImplementedError`` when True).
        maximize: maximize the objective instead of minimizing it.
        foreach: accepted and ignored (torch's fused kernel runs), checked as torch checks it.
        capturable: not supported (``NotImplementedError`` when True).
        differentiable: not supported (``NotImplementedError`` when True).
        fused: accepted and ignored (torch's fused kernel always runs).
        offload_fraction: share in [0, 1] of the eligible params' optimizer-state bytes kept
            on the host (see :mod:`offloadopt.place.placement`), or ``"auto"``: the first steps run
            at 0.5 and are measured (forward+backward, both kernels, the link), the cost model
            (:mod:`offloadopt.place.costmodel`) predicts every fraction and picks the largest predicted
            within half of ``auto_tolerance`` of fraction 0's step; the state moves without
            loss to fraction 0, whose step is measured, then to that choice, whose step is
            measured against ``1 + auto_tolerance`` times fraction 0's (a step above moves it
            down, twice at most; still above, a warning says so); with ``max_gpu_memory`` the budget's choice stays (the smallest fraction
            that fits is the fastest that fits) and is measured. ``opt.placement_choice``
            holds the inputs and the predicted and measured step times (ms); see
            :mod:`offloadopt.place.auto`. One process only (``ValueError`` with several ranks); not
            with ``overlap="delayed"`` unless ``max_gpu_memory`` is given (the fraction decides
            which params are stale), nor with groups that force ``"offload"``. During the probe
            ``overlap="backward"``'s updates wait for ``step()``, so what backward mode refuses
            (a grad edited with ``grads_final=True``, a second backward without
            ``accumulating()``) is refused from the first step after it. A resumed run probes
            again (the state moves without loss); pass ``placement_choice["fraction"]`` to
            skip that.
        min_offload_numel: params with fewer elements keep their state on the device.
        master_weights: keep an fp32 master for bf16/fp16 params (on the host for offloaded
            params, on the device otherwise); with False they update in their own dtype.
            ``"bf16-sr"``: no fp32 master; the bf16 weight is the master, and the update is
            computed in fp32 and rounded back stochastically (offloadopt's own kernel; 2 bytes
            per param instead of 4 on the host and over the link; docs/compressed-state.md has
            its measured quality). fp32 params keep updating in fp32.
        state_dtype: how ``exp_avg`` and ``exp_avg_sq`` are stored: ``"fp32"`` (default:
            torch's kernel, bitwise ``torch.optim.AdamW(fused=True)``), ``"bf16"`` (rounded
            stochastically: 4 bytes per param instead of 8) or ``"int8"`` (block-wise codes, one
            fp32 scale per 256 elements: about 2.03 bytes per param; in ``opt.state`` the keys
            ``exp_avg_q``, ``exp_avg_scale``, ``exp_avg_sq_q`` and ``exp_avg_sq_scale``).
            Compressed state runs offloadopt's fused CPU kernel, compiled with the machine's
            C++ compiler at first use (``RuntimeError`` at construction, saying what to
            install, when it cannot be built); device-resident params use the same
            representation. ``state_dict()`` holds the moments in fp32 under torch's keys (and
            the int8 codes beside them, for an exact resume), so ``torch.optim.AdamW`` loads it.
        pin_memory: pin crossing host buffers (checked); False reproduces the slow pageable path
            and warns once.
        bucket_nbytes: target bytes of fp32 state per bucket (pipelining unit); default 64 MiB,
            128 MiB with ``overlap="backward"`` and 256 MiB with ``overlap="delayed"`` (fewer
            copy launches on the worker, and fewer hand-offs of the GIL between it and the
            training thread while it launches the next forward and backward).
        flush_denormal: run the CPU update with flush-to-zero (see above).
        cpu_threads: threads of the CPU worker; default one per CPU of ``worker_cpus``. With
            the update thread (``OFFLOADOPT_UPDATE_THREAD=link``, off by default), where the
            copies cross to a GPU and there are at least 2, one launches them and the others
            (an OpenMP pool) run the update, so the update never waits for a launch.
        worker_cpus: the CPUs the worker and its threads run on (their affinity). ``None``
            (default): the CPUs this process may use (``os.sched_getaffinity``; with several
            local ranks, this rank's slice), less the first core and its hyperthread siblings
            when updates overlap the training thread's work (``overlap`` other than ``"step"``,
            or ``wait="module"``), so that the thread launching the GPU work keeps a core;
            ``"any"``: no affinity, the OS places the threads (the cores less one when updates
            overlap); or a list of CPU ids. ``opt.stats`` and ``offloadopt audit`` report it.
        timeout_s: the longest any wait for the worker or a copy may last (seconds).
        overlap: ``"step"`` (everything inside ``step()``), ``"backward"`` (grad hooks start
            buckets during backward, as far as ``grads_final`` and ``max_grad_norm`` allow) or
            ``"delayed"`` (the delayed parameter update of ZeRO-Offload: ``step()`` returns at
            once, the CPU update runs during the next forward and backward, which read the
            weights one step old, and the next ``step()`` or :meth:`synchronize` copies the
            new weights in; ``p.grad`` of offloaded params is None after ``step()``; memory:
            one more copy of the offloaded weights on the device, in their dtype; see the
            README's "The delayed parameter update").
        wait: ``"step"`` (``step()`` returns with every copy back queued and waited for on the
            compute stream) or ``"module"`` (``step()`` returns at once; modules registered with
            :meth:`watch` wait for their own params; :meth:`synchronize` for the rest).
        max_grad_norm: clip the global grad norm inside the update (the coefficient of
            ``torch.nn.utils.clip_grad_norm_`` multiplies the fp32 grads on the device);
            ``opt.last_grad_norm`` holds the norm. With ``overlap="backward"`` the updates
            start at the end of backward.
        grads_final: declare that nothing edits grads between backward and ``step()`` (no
            torch clipping, no GradScaler unscale, no hand edit): with ``overlap="backward"``
            a bucket's update starts as soon as its grads are complete.
        speculate: with ``overlap="backward"`` and ``max_grad_norm`` or ``grad_scaler``: start
            each offloaded bucket's update during backward as if the clip coefficient were 1.0
            and no grad inf or NaN, keeping its pre-step host state; at the end of backward,
            if either check fails, restore that state and update again with the true values
            (bitwise the run without it; offloadopt/step/speculate.py's note, docs/modes.md).
            ``ValueError`` in other modes, without a clip or scaler, or with
            ``release_grads``. ``opt.speculation`` counts the steps redone. GPU memory: at
            most 8 bytes a step above the same run without it, redone or not (the factors of
            a passing check; ``opt.speculation["device_extra_peak_nbytes"]`` counts it); the
            backups are pageable host memory (``backup_nbytes``).
        release_grads: free the device grads of offloaded params as soon as their copy has
            landed on the host (``p.grad`` is then None after ``step()``); needs
            ``overlap="backward"`` with ``grads_final``, ``max_grad_norm`` or ``grad_scaler``.
        grad_scaler: the ``torch.amp.GradScaler`` that scales this model's loss, attached so
            that ``overlap="backward"`` can start the updates at the end of backward: there
            the optimizer checks every grad for infs and NaNs itself (on the device, no
            ``.item()``), the worker's kernel divides by the scale, and ``scaler.step(opt)``
            then gets that found_inf into its ``update()`` (offloadopt/step/amp.py). Without it a
            GradScaler still works in every mode, as with ``torch.optim.AdamW(fused=True)``:
            ``scaler.step(opt)`` hands its scale and found_inf to ``step()``, and backward
            mode's updates wait for ``step()`` (with ``grads_final=True`` an unattached
            scaler is a ``RuntimeError`` at ``step()``: the updates read scaled grads). With
            ``max_grad_norm`` the grads are unscaled on the device before the clip, as
            ``scaler.unscale_(opt)`` then ``clip_grad_norm_`` would. One process, or DDP with
            ``ddp=`` (``ValueError`` otherwise: an FSDP2 rank sees its own shard only).
        delay_after: with ``overlap="delayed"``, the number of synchronous updates (step mode's,
            the new weights in place when ``step()`` returns) before the delay begins, as
            ZeRO-Offload starts its delayed parameter update only after the first steps, when
            the weights change fastest (arXiv 2101.06840, section 5). Counted by the offloaded
            params' ``step``, so a resumed run goes on where it left off; default 0 (delayed
            from the first step). The README's "The delayed parameter update" has what it does
            to the held-out loss.
        ddp: the ``DistributedDataParallel`` model (built with ``gradient_as_bucket_view=True``)
            whose grads ``overlap="backward"`` reads: a comm hook (torch's all-reduce, then an
            announcement) starts each offloaded bucket once DDP's all-reduce of its grads is
            done, never before; DDP's ``no_sync()`` marks accumulation micro-steps. Under DDP
            without it, ``overlap="backward"`` is refused (a grad hook sees the un-reduced grad).
        max_gpu_memory: a GPU budget in bytes, or a string (``"120GB"`` = 120e9 bytes,
            ``"112GiB"`` = 112 x 2**30): placement waits for the first ``step()`` (so forward
            and backward are measured, before any optimizer state is allocated) and takes the
            smallest fraction whose device bytes fit (``opt.placement_choice`` says what and
            why; logger ``offloadopt``). Leave ``offload_fraction`` at its default.
        max_host_memory: the host bytes the chosen fraction may use (default ``MemAvailable``).
        activation_bytes: what forward and backward need on the device, if not measured (the
            CPU, or a placement before the first backward).
        auto_tolerance: with ``offload_fraction="auto"``, the share the step may grow over
            fraction 0's (default 0.05: 5%).

    Raises:
        ValueError: a bad value, named in the message, before anything is built (torch's
            messages where torch's AdamW checks the same: ``Invalid learning rate``, ``betas
            must be either both floats or both Tensors``, a Tensor ``lr`` with ``foreach=True``).
        TypeError: an unknown keyword, ``params`` a Tensor or a set, an object of the wrong
            class (``grad_scaler``, ``ddp``).
        NotImplementedError: ``amsgrad``, ``capturable`` or ``differentiable`` set.
        PinnedAllocationError: pinned host memory could not be had (the bytes asked for).

    Example::

        model = GPT(cfg).cuda().bfloat16()
        opt = HybridAdamW(model.named_parameters(), lr=3e-4, offload_fraction=1.0)
        loss = model(x, y)[1]; loss.backward(); opt.step(); opt.zero_grad()
    """

    rule = ADAMW

    def __init__(
        self,
        params,
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float | torch.Tensor, float | torch.Tensor] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        **options: Unpack[OffloadOptions],
    ):
        hyper = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, maximize=maximize)
        super().__init__(params, hyper, amsgrad=amsgrad, capturable=capturable,
                         differentiable=differentiable, foreach=foreach, fused=fused, **options)  # fmt: skip
