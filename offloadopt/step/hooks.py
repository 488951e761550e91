"""Where the optimizer hears from autograd and the model: grad-ready hooks during backward and
forward pre-hooks before each module reads its params. Each owns its handles; ``remove()``
takes them off (``opt.close()`` calls it).

Neither holds a strong reference to the optimizer: the model's params outlive it, and a hook
that kept it alive would keep its pinned memory and worker alive too.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from offloadopt.shards import is_dtensor

__all__ = ["BackwardEnd", "GradHooks", "ModuleWaits", "DDPGrads"]


class BackwardEnd:
    """``owner.on_backward_end()`` queued as autograd's final callback once per backward (its
    graph task), by whichever hook of that backward calls :meth:`queue` first: a grad hook
    (:class:`GradHooks`, any of them) or DDP's comm hook (:class:`DDPGrads`, which fires in a
    backward where no offloaded param gets a grad). Holds ``owner`` weakly."""

    def __init__(self, owner: Any):
        ref = weakref.ref(owner)
        self._task = None  # the graph task (one backward call) whose callback is queued

        def run() -> None:
            opt = ref()
            if opt is not None:
                opt.on_backward_end()

        self._run = run

    def queue(self) -> None:
        """Called from a hook of the running backward (even after a failed one)."""
        task = torch._C._current_graph_task_id()
        if task != -1 and task != self._task:
            self._task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._run)


class _Handles:
    """Hook handles taken off together by :meth:`remove` (``close()``), or when ``owner`` is
    collected: an optimizer dropped without ``close()`` leaves no hook behind on the model's
    params and modules (each would do nothing, but they piled up, one per param per dropped
    optimizer: a fresh user's finding; tests/test_faults.py)."""

    def __init__(self, owner: Any):
        self.handles: list = []
        weakref.finalize(owner, self.remove).atexit = False

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


class GradHooks(_Handles):
    """Post-accumulate-grad hooks on the given params, and an end-of-backward callback.

    ``owner.on_grad(p)`` runs when ``p``'s grad is final for this backward (on autograd's
    thread for the device, whose current stream is the one the grad was made on);
    ``owner.on_backward_end()`` runs once when a backward that fired any of the hooks ends
    (autograd's final callback: on the thread that called backward, its stream synced with the
    streams that made the grads). A backward that raises never calls it: the owner sees that at
    its next call.
    """

    def __init__(self, owner: Any, params: Iterable[torch.Tensor], backward_end: BackwardEnd):
        ref = weakref.ref(owner)

        def on_grad(p: torch.Tensor) -> None:
            opt = ref()
            if opt is None:
                return
            backward_end.queue()
            opt.on_grad(p)

        super().__init__(owner)
        self.handles = [
            p.register_post_accumulate_grad_hook(on_grad) for p in params if p.requires_grad
        ]


class Compiled:
    """Whether a watched module runs inside a ``torch.compile``d region: its forward pre-hook
    was traced (dynamo replays the hook's store of ``seen`` at every call of the region), or
    the module was compiled before ``watch()``. Its per-module waits do not run there."""

    seen = False


def _compiled(model: torch.nn.Module) -> bool:
    """``model`` is torch.compile's wrapper, or holds a module compiled in place."""
    from torch._dynamo.eval_frame import OptimizedModule

    return isinstance(model, OptimizedModule) or any(
        getattr(m, "_compiled_call_impl", None) is not None for m in model.modules()
    )


def dynamo_compiled_any() -> bool:
    """Whether ``torch.compile`` (dynamo) has compiled a frame in this process. A graph traced
    from one instance of a module class is reused for another instance of it, hooks or not
    (dynamo does not guard on hooks by default): a watched model whose compiled forward got
    such a graph runs without its waits, and without setting ``compiled.seen`` (a user's
    find: wrong losses, then an in-place error, with a compiled copy traced first). Reads
    dynamo's counters; one that cannot be read counts as compiled (the safe side)."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None:
        return False
    try:
        counters = dynamo.utils.counters
        return bool(counters["frames"]["ok"] or counters["stats"]["unique_graphs"])
    except Exception:  # noqa: BLE001 - another torch's internals: assume a compile ran
        return True


# torch's modules whose forward reads their children's params directly, not through the
# children's forward (so the children's pre-hooks never run): MultiheadAttention reads
# out_proj.weight and .bias in F.multi_head_attention_forward; TransformerEncoderLayer's fast
# path (eval, no grad) reads every child's params in one fused op.
READS_CHILDREN: tuple[type, ...] = (torch.nn.MultiheadAttention, torch.nn.TransformerEncoderLayer)


class ModuleWaits(_Handles):
    """Forward pre-hooks (run before any other pre-hook of the module) that make the module's
    stream wait for the copies back of its own params only (of its whole subtree for the
    types in :data:`READS_CHILDREN`): ``owner.wait_for(params)``; and a
    state-dict pre-hook on every module of the model that waits for everything
    (``owner.synchronize()``). Traced by ``torch.compile``, a pre-hook is a no-op that sets
    ``compiled.seen``: the owner then waits for everything before ``step()`` returns.

    ``owner`` is the optimizer's publish policy (offloadopt/step/publish.py's ``Publisher``),
    held weakly."""

    def __init__(self, owner: Any, model: torch.nn.Module, offloaded: set[torch.Tensor]):
        super().__init__(owner)
        ref = weakref.ref(owner)
        self.modules = 0
        self.compiled = compiled = Compiled()
        compiled.seen = _compiled(model)
        fsdp = _fsdp_modules(model)
        if fsdp is None and any(is_dtensor(p) for p in model.parameters()):
            raise ValueError(
                "watch(): the model's params are DTensors but none of its modules is FSDP2's: "
                "call opt.watch(model) after fully_shard (the waits must run before FSDP2's "
                "own pre-forward)"
            )
        for module in fsdp if fsdp is not None else model.modules():
            if fsdp is not None:
                _fsdp_shards(module)  # FSDP2's state is readable on this torch, or it raises

                def pre_hook(mod, args) -> None:
                    if torch.compiler.is_compiling():
                        compiled.seen = True
                        return
                    pub = ref()
                    if pub is not None and (
                        pub.timeline.inflight is not None or pub.timeline.updates_started()
                    ):
                        # copies back to wait for (of the step before, or of this one's
                        # updates started before step())
                        # FSDP2 all-gathers these shards next, on its streams
                        params, streams = _fsdp_shards(mod)
                        pub.wait_for([p for p in params if p in offloaded], streams)

            else:
                # A module of READS_CHILDREN waits for its whole subtree: it reads its
                # children's params without calling them (tests/test_overlap.py,
                # test_torchs_attention_modules_wait_for_the_params_they_read).
                whole = isinstance(module, READS_CHILDREN)
                mine = [p for p in module.parameters(recurse=whole) if p in offloaded]
                if not mine:
                    continue

                def pre_hook(mod, args, mine=mine) -> None:
                    if torch.compiler.is_compiling():
                        compiled.seen = True  # the region waits once, in step() (publish.py)
                        return
                    pub = ref()
                    if pub is not None:
                        pub.wait_for(mine)

            self.handles.append(module.register_forward_pre_hook(pre_hook, prepend=True))
            self.modules += 1

        def state_dict_pre_hook(module, prefix, keep_vars) -> None:
            pub = ref()
            if pub is not None:
                pub.synchronize()  # model.state_dict() through any framework sees new weights

        # On every submodule: a framework may save a part (model.module, model.backbone).
        for module in model.modules():
            self.handles.append(module.register_state_dict_pre_hook(state_dict_pre_hook))


class DDPGrads:
    """A DDP comm hook: torch's default all-reduce of each bucket (divide by the world size, then
    all-reduce), then ``owner.on_reduced(params)`` once the reduced values are in the bucket.
    The announcement is a callback of the all-reduce's future: on gloo it runs when the
    all-reduce is done (on gloo's thread); on NCCL when it is queued, with the current stream
    made to wait for it, so a D2H marked on that stream reads reduced grads. With
    ``gradient_as_bucket_view=True`` each ``p.grad`` is a view of its bucket: reduced in place.

    DDP takes one comm hook per model and cannot take it back: ``remove()`` leaves the plain
    all-reduce."""

    def __init__(self, owner: Any, ddp: torch.nn.Module, backward_end: BackwardEnd):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ref = weakref.ref(owner)
        self.active = True
        group = ddp.process_group

        def hook(state, bucket):
            fut = default_hooks.allreduce_hook(group, bucket)
            opt = ref()
            if opt is None or not self.active:
                return fut
            params = bucket.parameters()
            # The end of this backward, queued here too: a backward in which no offloaded
            # param got a grad (fraction 0, or the offloaded ones unused this step) fires no
            # grad hook, and the step begun by on_reduced would never end (a fresh user's
            # finding).
            backward_end.queue()

            def announce(done):
                o = ref()
                if o is not None and self.active:
                    o.on_reduced(params)
                return done.value()

            out = fut.then(announce)
            opt.reduction_started(out)
            return out

        ddp.register_comm_hook(None, hook)

    def remove(self) -> None:
        self.active = False


def _fsdp_modules(model: torch.nn.Module) -> list[torch.nn.Module] | None:
    """The FSDP2 modules of ``model`` (``fully_shard`` applied), or None when it has none."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - a torch without FSDP2
        return None
    found = [m for m in model.modules() if isinstance(m, FSDPModule)]
    return found or None


def _fsdp_shards(module: torch.nn.Module) -> tuple[list[torch.Tensor], tuple]:
    """What FSDP2's pre-forward of ``module`` is about to all-gather: the sharded params of its
    param groups and of the modules it prefetches (``set_modules_to_forward_prefetch``), and
    the all-gather streams (FSDP2 makes them wait for the compute stream once, at the root's
    pre-forward, so a wait on the compute stream alone would not order a block's all-gather
    after its H2D). FSDP2's state is read through its private attributes (torch 2.11-2.13
    name them alike; the single-group ``_fsdp_param_group`` of older releases too)."""
    state = module._get_fsdp_state()
    params: list[torch.Tensor] = []
    for s in (state, *getattr(state, "_states_to_forward_prefetch", ())):
        groups = getattr(s, "_fsdp_param_groups", None)
        if groups is None:
            if not hasattr(s, "_fsdp_param_group"):
                # Waiting for nothing would let the forward race the H2D: refuse instead.
                raise RuntimeError(
                    f"wait='module' under FSDP2 reads FSDP2's state, and this torch "
                    f"({torch.__version__}) names it otherwise: no param groups on "
                    f"{type(module).__name__}; use wait='step'"
                )
            one = s._fsdp_param_group
            groups = [one] if one is not None else []
        params += [fp.sharded_param for g in groups for fp in g.fsdp_params]
    comm = getattr(state, "_comm_ctx", None)
    streams = tuple(
        st for st in (getattr(comm, "all_gather_copy_in_stream", None),
                      getattr(comm, "all_gather_stream", None))
        if isinstance(st, torch.cuda.Stream)
    )  # fmt: skip
    return params, streams
