"""One rank of a multi-process test (tests/test_distributed.py starts WORLD_SIZE of these with
RANK, LOCAL_RANK, WORLD_SIZE and OFFLOADOPT_INIT_FILE set; gloo on the CPU).

``python tests/dist_job.py SCENARIO OUT_DIR [ARG]``: runs SCENARIO, writes each rank's results
to ``OUT_DIR/SCENARIO.rank{r}.pt`` and then ``...done`` *before* the barrier and teardown (gloo
aborts at teardown now and then, with torch's own AdamW too; the results are judged from the
files).

Every run trains a tiny GPT (harness.gpt) from seed 0 on per-rank random tokens and records
the whole weights (``full_tensor()`` of FSDP2's shards) after the last step.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from oracle import DelayedTorch

import offloadopt
from offloadopt.harness.distributed import init_from_env, shard_fsdp, teardown, wrap_ddp
from offloadopt.harness.gpt import GPT, GPTConfig

CFG = GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=64, block_size=16)
STEPS, LR, BATCH = 4, 1e-2, 2


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    seq = torch.randint(0, CFG.vocab_size, (BATCH, CFG.block_size + 1), generator=g)
    return seq[:, :-1], seq[:, 1:]


def whole(model) -> dict[str, torch.Tensor]:
    """Every weight, whole (FSDP2's shards gathered), on the CPU."""
    out = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name.removeprefix("module.")] = t.detach().cpu().clone()
    return out


def fresh(kind: str, **shard):
    torch.manual_seed(0)
    model = GPT(CFG)
    if kind == "fsdp":
        shard_fsdp(model, **shard)
    elif kind == "ddp":
        model = wrap_ddp(model)
    elif kind == "ddp_view":  # what ddp= needs: grads are views of DDP's buckets
        from torch.nn.parallel import DistributedDataParallel

        # small buckets both sides: several all-reduces, several offloaded buckets
        model = DistributedDataParallel(model, gradient_as_bucket_view=True, bucket_cap_mb=0.02)
    return model


def hybrid(params, **kw):
    kw.setdefault("min_offload_numel", 64)
    return offloadopt.HybridAdamW(params, lr=LR, **kw)


def torch_adamw(params):
    return torch.optim.AdamW(params, lr=LR, fused=True)


def train(model, opt, rank, steps=STEPS, start=0, clip=None, accumulate=1):
    for step in range(start, start + steps):
        for micro in range(accumulate - 1):  # DDP's no_sync(): local accumulation, no all-reduce
            with model.no_sync():
                x, y = batch(100 + 10 * step + micro, rank)
                model(x, y)[1].backward()
        x, y = batch(step, rank)
        _, loss = model(x, y)
        loss.backward()
        st = (
            opt.debug.step if hasattr(opt, "debug") else None
        )  # overlap="backward": started in backward
        opt.fed_in_backward = len(st.fed) if st is not None else 0
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    if hasattr(opt, "synchronize"):
        opt.synchronize()


def run_fsdp(rank: int, world: int, arg: str) -> dict:
    out = {}
    runs = {
        "torch": (torch_adamw, None, {}),
        "f0": (lambda p: hybrid(p, offload_fraction=0.0), None, {}),
        "f0.5": (lambda p: hybrid(p, offload_fraction=0.5), None, {}),
        "f1": (lambda p: hybrid(p, offload_fraction=1.0), None, {}),
        "torch_clip": (torch_adamw, 0.05, {}),
        "f0.5_clip": (lambda p: hybrid(p, offload_fraction=0.5, max_grad_norm=0.05), None, {}),
        "torch_mp": (torch_adamw, None, {"param_dtype": torch.bfloat16, "reshard_after_forward": False}),
        "f1_mp": (lambda p: hybrid(p, offload_fraction=1.0), None,
                  {"param_dtype": torch.bfloat16, "reshard_after_forward": False}),
        "f0.5_bwd_final": (lambda p: hybrid(p, offload_fraction=0.5, overlap="backward",
                                            grads_final=True), None, {}),
        "f1_bwd_clip": (lambda p: hybrid(p, offload_fraction=1.0, overlap="backward",
                                         max_grad_norm=0.05), None, {}),
        "f1_bwd_release": (lambda p: hybrid(p, offload_fraction=1.0, overlap="backward",
                                            grads_final=True, release_grads=True), None, {}),
        "f1_bwd_torchclip": (lambda p: hybrid(p, offload_fraction=1.0, overlap="backward"),
                             0.05, {}),  # torch's clip: the updates wait for step()
        # speculate=True: every step clips (redone), or none does (the speculation stands)
        "f1_bwd_clip_spec": (lambda p: hybrid(p, offload_fraction=1.0, overlap="backward",
                                              max_grad_norm=0.05, speculate=True), None, {}),
        "f0.5_bwd_noclip_spec": (lambda p: hybrid(p, offload_fraction=0.5, overlap="backward",
                                                  max_grad_norm=1e9, speculate=True), None, {}),
        # wait="module" with opt.watch(model): each FSDP2 module waits before its all-gather
        "f1_module": (lambda p: hybrid(p, offload_fraction=1.0, wait="module"), None, {}),
        "f0.5_bwd_module": (lambda p: hybrid(p, offload_fraction=0.5, overlap="backward",
                                             grads_final=True, wait="module"), None, {}),
        "torch_delayed": (None, None, {}),
        "f1_delayed": (lambda p: hybrid(p, offload_fraction=1.0, overlap="delayed", min_offload_numel=1),
                       None, {}),  # every param delayed, as in DelayedTorch
    }  # fmt: skip
    for name, (make, clip, shard) in runs.items():
        model = fresh("fsdp", **shard)
        opt = DelayedTorch(model, LR) if make is None else make(model.parameters())
        if name.endswith("_spec"):  # every step speculates: no holding back after a clip
            opt.debug.speculation.MAX_HOLD = 0
        if "module" in name:
            opt.watch(model)
            out[f"{name}.hooks"] = opt.debug.publisher.module_waits[
                0
            ].modules  # on the FSDP2 modules only
            from offloadopt.step.hooks import _fsdp_shards  # FSDP2's private state, read as it is

            out[f"{name}.shards"] = len(_fsdp_shards(model.transformer.h[0])[0])
        train(model, opt, rank, clip=clip)
        out[name] = whole(model)
        if "_bwd_" in name:
            out[f"{name}.fed"] = (opt.fed_in_backward, len(opt.buckets))
        if name.endswith("_spec"):
            out[f"{name}.spec"] = opt.speculation
        if name == "f0.5":
            out["table"] = opt.placement_table()
            sd = opt.state_dict()
            out["state_types"] = sorted({type(v).__name__ for e in sd["state"].values()
                                         for k, v in e.items() if k != "step"})  # fmt: skip
        if hasattr(opt, "close"):
            opt.close()
    return out


class TwoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x, use_b=True):
        h = self.a(x)
        return self.b(h) if use_b else h


def run_ddp(rank: int, world: int, arg: str) -> dict:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    out = {}
    runs = {
        "torch": torch_adamw,
        "f0": lambda p: hybrid(p, offload_fraction=0.0),
        "f0.5": lambda p: hybrid(p, offload_fraction=0.5),
        "f1": lambda p: hybrid(p, offload_fraction=1.0),
        "torch_delayed": None,
        "f1_delayed": lambda p: hybrid(
            p, offload_fraction=1.0, overlap="delayed", min_offload_numel=1
        ),
        "torch_zero": lambda p: ZeroRedundancyOptimizer(
            p, optimizer_class=torch.optim.AdamW, lr=LR, fused=True
        ),
        "zero_f0.5": lambda p: ZeroRedundancyOptimizer(
            p,
            optimizer_class=offloadopt.HybridAdamW,
            lr=LR,
            offload_fraction=0.5,
            min_offload_numel=64,
        ),  # fmt: skip
    }

    def backward(**kw):  # overlap="backward" with DDP's all-reduced buckets as the grad source
        return lambda m: hybrid(
            m.parameters(), overlap="backward", ddp=m, bucket_nbytes=16384, **kw
        )

    views = {  # name -> (optimizer of the DDP model, torch's clip, micro-steps)
        "torch_view": (lambda m: torch_adamw(m.parameters()), None, 1),
        "bwd_final": (backward(offload_fraction=0.5, grads_final=True), None, 1),
        "torch_clip": (lambda m: torch_adamw(m.parameters()), 0.05, 1),
        "bwd_clip": (backward(offload_fraction=1.0, max_grad_norm=0.05), None, 1),
        "bwd_clip_spec": (
            backward(offload_fraction=1.0, max_grad_norm=0.05, speculate=True),
            None,
            1,
        ),
        "bwd_noclip_spec": (
            backward(offload_fraction=0.5, max_grad_norm=1e9, speculate=True),
            None,
            1,
        ),
        "torch_accum": (lambda m: torch_adamw(m.parameters()), None, 2),
        "bwd_accum": (backward(offload_fraction=1.0, grads_final=True), None, 2),
        # nothing offloaded: no grad hook fires, DDP's comm hook ends the step (fresh user)
        "bwd_f0": (backward(offload_fraction=0.0, grads_final=True), None, 1),
    }
    for name, (make, clip, accumulate) in views.items():
        model = fresh("ddp_view")
        opt = make(model)
        if name.endswith("_spec"):  # every step speculates: no holding back after a clip
            opt.debug.speculation.MAX_HOLD = 0
        train(model, opt, rank, clip=clip, accumulate=accumulate)
        out[name] = whole(model)
        if name.startswith("bwd"):
            out[f"{name}.fed"] = (opt.fed_in_backward, len(opt.buckets))
            if name.endswith("_spec"):
                out[f"{name}.spec"] = opt.speculation
            opt.close()
    # find_unused_parameters=True: a layer unused in one step keeps grad None (fresh-user bug:
    # it was announced, and its None grad was read).
    # bwd_unused_b: only b is offloaded, and at step 1 no offloaded param gets a grad.
    for name in ("torch_unused", "bwd_unused", "bwd_unused_b"):
        from torch.nn.parallel import DistributedDataParallel

        torch.manual_seed(0)
        model = DistributedDataParallel(
            TwoLayers(), gradient_as_bucket_view=True, find_unused_parameters=True
        )
        if name == "torch_unused":
            opt = torch_adamw(model.parameters())
        else:
            opt = hybrid(model.parameters(), overlap="backward", grads_final=True, ddp=model,
                         min_offload_numel=0,
                         offload_fraction=0.5 if name.endswith("_b") else 1.0)  # fmt: skip
        for step in range(3):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
            model(x, use_b=step != 1).square().mean().backward()  # step 1: b gets no grad
            opt.step()
            opt.zero_grad()
        out[name] = whole(model)
        if hasattr(opt, "close"):
            opt.close()
    for name, make in runs.items():
        model = fresh("ddp")
        opt = DelayedTorch(model, LR) if make is None else make(list(model.parameters()))
        train(model, opt, rank)
        out[name] = whole(model)
        if name == "zero_f0.5":
            # A resume through ZeRO's consolidated dict: two more steps from a reload equal
            # two more steps of the same optimizer.
            opt.consolidate_state_dict(to=0)
            sd = opt.state_dict() if rank == 0 else None
            objs = [sd]
            torch.distributed.broadcast_object_list(objs, src=0)
            snapshot = {k: v.clone() for k, v in model.module.state_dict().items()}
            train(model, opt, rank, steps=2, start=STEPS)
            out["zero_more"] = whole(model)
            model2 = fresh("ddp")
            model2.module.load_state_dict(snapshot)
            opt2 = make(list(model2.parameters()))
            opt2.load_state_dict(objs[0])
            train(model2, opt2, rank, steps=2, start=STEPS)
            out["zero_resumed"] = whole(model2)
            opt2.optim.close()
        inner = getattr(opt, "optim", opt)
        if hasattr(inner, "close"):
            inner.close()
    return out


def run_dcp(rank: int, world: int, arg: str) -> dict:
    """``arg`` = "save:DIR" (train, save, train on), "reshard:SRC:DST" (load, record, save)
    or "resume:DIR" (load, train on)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    mode, *dirs = arg.split(":")
    model = fresh("fsdp")
    opt = hybrid(model.parameters(), offload_fraction=0.5)
    out = {}

    def full_state():
        _, osd = get_state_dict(model, opt)
        return {f"{fqn}.{k}": (v.full_tensor() if hasattr(v, "full_tensor") else v).cpu().clone()
                for fqn, e in osd["state"].items() for k, v in e.items()}  # fmt: skip

    def load(path):
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])

    def save(path):
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)

    if mode == "save":
        train(model, opt, rank)
        save(dirs[0])
        out["state"] = full_state()
        train(model, opt, rank, start=STEPS)
        out["weights"] = whole(model)
    elif mode == "reshard":
        load(dirs[0])
        out["state"] = full_state()
        out["table"] = opt.placement_table()
        save(dirs[1])
    else:
        load(dirs[0])
        out["state"] = full_state()
        train(model, opt, rank, start=STEPS)
        out["weights"] = whole(model)
    opt.close()
    return out


def run_bad(rank: int, world: int, arg: str) -> dict:
    """Setups refused with a clear error (each message recorded), and the worker's threads
    under torchrun's OMP_NUM_THREADS=1 (the launcher sets it for this scenario)."""
    import logging

    out = {}

    def error(fn):
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - recorded, judged by the test
            return f"{type(e).__name__}: {e}"
        return None

    ddp = fresh("ddp")
    out["backward"] = error(lambda: hybrid(ddp.parameters(), overlap="backward"))
    out["ddp_no_view"] = error(
        lambda: hybrid(ddp.parameters(), overlap="backward", grads_final=True, ddp=ddp)
    )
    view = fresh("ddp_view")
    out["ddp_step"] = error(lambda: hybrid(view.parameters(), ddp=view))
    out["ddp_release"] = error(lambda: hybrid(view.parameters(), overlap="backward", grads_final=True,
                                              release_grads=True, ddp=view))  # fmt: skip
    other = GPT(CFG)  # not the DDP model's params
    out["ddp_other"] = error(
        lambda: hybrid(other.parameters(), overlap="backward", grads_final=True, ddp=view)
    )
    hooked = fresh("ddp_view")
    hooked.register_comm_hook(None, lambda state, bucket: torch.futures.Future())
    out["ddp_hooked"] = error(
        lambda: hybrid(hooked.parameters(), overlap="backward", grads_final=True, ddp=hooked)
    )
    from torch.distributed.optim import ZeroRedundancyOptimizer

    out["ddp_zero"] = error(lambda: ZeroRedundancyOptimizer(
        view.parameters(), optimizer_class=offloadopt.HybridAdamW, lr=LR, overlap="backward",
        grads_final=True, ddp=view))  # fmt: skip
    out["zero_delayed"] = error(lambda: ZeroRedundancyOptimizer(
        view.parameters(), optimizer_class=offloadopt.HybridAdamW, lr=LR, overlap="delayed"))  # fmt: skip
    import functools

    class Delayed(offloadopt.HybridAdamW):  # the option set inside, not a ZeRO keyword
        def __init__(self, params, **kw):
            super().__init__(params, overlap="delayed", **kw)

    for key, cls in (("zero_delayed_partial", functools.partial(offloadopt.HybridAdamW, overlap="delayed")),
                     ("zero_delayed_subclass", Delayed)):  # fmt: skip
        out[key] = error(lambda cls=cls: ZeroRedundancyOptimizer(
            view.parameters(), optimizer_class=cls, lr=LR))  # fmt: skip
    for key, kw in (("zero_clip", dict(max_grad_norm=1.0)),  # each shard's norm alone
                    ("zero_backward", dict(overlap="backward", grads_final=True)),
                    ("zero_scaler", dict(grad_scaler=torch.amp.GradScaler("cpu")))):  # fmt: skip
        out[key] = error(lambda kw=kw: ZeroRedundancyOptimizer(
            view.parameters(), optimizer_class=offloadopt.HybridAdamW, lr=LR, **kw))  # fmt: skip
    out["zero_step"] = error(lambda: ZeroRedundancyOptimizer(
        view.parameters(), optimizer_class=offloadopt.HybridAdamW, lr=LR).optim.close())  # fmt: skip
    out["ddp_module"] = error(
        lambda: hybrid(view.parameters(), overlap="backward", grads_final=True, ddp=view.module)
    )
    fsdp = fresh("fsdp")
    # A grad that is not sharded like its param (here: replicated) is refused, nothing changes.
    from torch.distributed.tensor import Replicate

    opt = hybrid(fsdp.parameters(), offload_fraction=0.5)
    out["watch_inner"] = error(lambda: opt.watch(fsdp.lm_head))  # not an FSDP2 module
    before = whole(fsdp)
    for p in fsdp.parameters():
        p.grad = p.detach().redistribute(placements=[Replicate()]).clone()
    out["replicated_grad"] = error(opt.step)
    out["unchanged"] = all(torch.equal(before[k], v) for k, v in whole(fsdp).items())
    opt.close()
    # Threads per rank: the default, and the knob over OMP_NUM_THREADS=1, with its log line.
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("offloadopt").addHandler(handler)
    opt = hybrid(ddp.parameters(), offload_fraction=1.0)
    out["default_threads"] = opt.cpu_threads
    opt.close()
    opt = hybrid(ddp.parameters(), offload_fraction=1.0, cpu_threads=2)
    train(ddp, opt, rank, steps=1)
    out["stats"] = opt.stats
    out["worker_threads"] = []
    job = opt.debug.pipeline.worker.submit(
        lambda: out["worker_threads"].append(torch.get_num_threads()), "probe"
    )
    job.wait(30)
    out["training_threads"] = torch.get_num_threads()
    out["log"] = [r.getMessage() for r in records]
    opt.close()
    return out


def main() -> None:
    scenario, out_dir = sys.argv[1], Path(sys.argv[2])
    arg = sys.argv[3] if len(sys.argv) > 3 else ""
    d = init_from_env("cpu")
    if scenario != "run_bad":
        torch.set_num_threads(1)
    jobs = {"run_fsdp": run_fsdp, "run_ddp": run_ddp, "run_dcp": run_dcp, "run_bad": run_bad}
    results = jobs[scenario](d.rank, d.world, arg)
    tag = f"{scenario}{'.' + arg.split(':')[0] if arg else ''}"
    torch.save(results, out_dir / f"{tag}.rank{d.rank}.pt")
    (out_dir / f"{tag}.rank{d.rank}.done").write_text("ok")
    sys.stdout.flush()
    teardown()
    os._exit(0)  # no interpreter teardown after the group is gone (gloo's abort there)


if __name__ == "__main__":
    main()
