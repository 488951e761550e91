"""The fault suites' fresh-process resumes, tests/test_resume_matrix.py's matrix: one
process trains and saves (``torch.save``, or ``torch.distributed.checkpoint`` with a gloo
process group of one), another builds everything afresh, loads and trains on, across modes,
fractions and classes (HybridAdamW, ``torch.optim.AdamW(fused=True)``,
``HybridDeviceOptimizer``); the result must equal torch's AdamW run without a stop, bitwise.
They run there, in two processes, not in tests/long/faults.py's loop.
"""

from __future__ import annotations

import os

import torch
from fault_probe import FRACTIONS, MODES, Probe, groups, hybrid

RESUME_STEPS = (3, 3)  # steps before the checkpoint, steps after the resume


def build(cfg: dict, model: Probe):
    """The optimizer of a resume configuration: ``cls`` "hybrid" (HybridAdamW, ``mode`` and
    ``fraction``), "torch" (``torch.optim.AdamW(fused=True)``) or "megatron"
    (``HybridDeviceOptimizer`` with torch's AdamW as both classes, ``fraction``)."""
    params = list(model.parameters())
    if cfg["cls"] == "torch":
        return torch.optim.AdamW(groups(params), fused=True)
    if cfg["cls"] == "megatron":
        from offloadopt import HybridDeviceOptimizer

        return HybridDeviceOptimizer(
            groups(params), offload_fraction=cfg["fraction"],
            cpu_optimizer_cls=torch.optim.AdamW, gpu_optimizer_cls=torch.optim.AdamW,
        )  # fmt: skip
    return hybrid(model, cfg["fraction"], cfg["mode"])


def resume_configs() -> dict[str, tuple[dict, dict, str]]:
    """name -> (the saving run's configuration, the resuming one's, how: "torch.save" or
    "dcp"). Every mode and fraction saves and resumes, into another mode and fraction, and
    each class into each other; the grads do not depend on the weights, so each pair must
    equal torch's AdamW run uninterrupted, bitwise."""
    h = lambda mode, fraction: {"cls": "hybrid", "mode": mode, "fraction": fraction}  # noqa: E731
    torch_ = {"cls": "torch"}
    meg = lambda fraction: {"cls": "megatron", "fraction": fraction}  # noqa: E731
    modes = list(MODES)
    out = {}
    for i, mode in enumerate(modes):
        for j, f in enumerate(FRACTIONS):
            other = (modes[(i + 1) % 3], FRACTIONS[(j + 1) % 3])
            out[f"hybrid-{mode}-{f}-to-{other[0]}-{other[1]}"] = (
                h(mode, f),
                h(*other),
                "torch.save",
            )
        out[f"hybrid-{mode}-0.5-to-same"] = (h(mode, 0.5), h(mode, 0.5), "torch.save")
        out[f"torch-to-hybrid-{mode}"] = (torch_, h(mode, FRACTIONS[i]), "torch.save")
        out[f"hybrid-{mode}-to-torch"] = (h(mode, 0.5), torch_, "torch.save")
        out[f"hybrid-{mode}-to-megatron"] = (h(mode, 1.0), meg(0.5), "torch.save")
        out[f"megatron-to-hybrid-{mode}"] = (meg(0.5), h(mode, 0.0), "torch.save")
        out[f"dcp-hybrid-{mode}-to-{modes[(i + 1) % 3]}"] = (h(mode, 0.5), h(modes[(i + 1) % 3], 1.0), "dcp")  # fmt: skip
    out["megatron-0.0-to-megatron-1.0"] = (meg(0.0), meg(1.0), "torch.save")
    out["torch-to-megatron"] = (torch_, meg(1.0), "torch.save")
    out["megatron-to-torch"] = (meg(0.5), torch_, "torch.save")
    out["dcp-torch-to-hybrid"] = (torch_, h("step", 0.5), "dcp")
    out["dcp-hybrid-to-torch"] = (h("delayed", 1.0), torch_, "dcp")
    return out


def _dcp_state(model: Probe, opt):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def resume_phase(phase: str, folder: str) -> None:
    """One process's part of the resume matrix: "save" trains each configuration's saving
    run ``RESUME_STEPS[0]`` steps and saves model and optimizer (``torch.save``, or
    ``torch.distributed.checkpoint`` with a gloo process group of one); "load" builds each
    resuming run afresh, loads, trains ``RESUME_STEPS[1]`` steps and saves the final weights
    and ``state_dict()`` (``{name}-final.pt``)."""
    import torch.distributed as dist

    folder_path = os.path.abspath(folder)
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{folder_path}/pg-{phase}",
                                rank=0, world_size=1)  # fmt: skip
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    before, after = RESUME_STEPS
    for name, (saving, resuming, how) in resume_configs().items():
        model = Probe(0)
        if phase == "save":
            opt = build(saving, model)
            for s in range(before):
                opt.zero_grad()
                model(s).backward()
                opt.step()
            getattr(opt, "synchronize", lambda: None)()
            if how == "dcp":
                dcp.save(_dcp_state(model, opt), checkpoint_id=f"{folder_path}/{name}")
            else:
                torch.save({"model": model.state_dict(), "opt": opt.state_dict()},
                           f"{folder_path}/{name}.pt")  # fmt: skip
        else:
            with torch.no_grad():  # a fresh init, overwritten by the checkpoint
                for p in model.parameters():
                    p.mul_(-1.0)
            opt = build(resuming, model)
            if how == "dcp":
                state = _dcp_state(model, opt)
                dcp.load(state, checkpoint_id=f"{folder_path}/{name}")
                set_state_dict(model, opt, model_state_dict=state["model"],
                               optim_state_dict=state["optim"])  # fmt: skip
            else:
                ckpt = torch.load(f"{folder_path}/{name}.pt", weights_only=True)
                model.load_state_dict(ckpt["model"])
                opt.load_state_dict(ckpt["opt"])
            for s in range(before, before + after):
                opt.zero_grad()
                model(s).backward()
                opt.step()
            getattr(opt, "synchronize", lambda: None)()
            torch.save({"weights": [p.detach() for p in model.parameters()],
                        "state": opt.state_dict()["state"]}, f"{folder_path}/{name}-final.pt")  # fmt: skip
        getattr(opt, "close", lambda: None)()
    dist.destroy_process_group()


def resume_reference() -> tuple[list[torch.Tensor], dict]:
    """torch's AdamW over ``sum(RESUME_STEPS)`` steps without a stop: weights and state."""
    model = Probe(0)
    opt = torch.optim.AdamW(groups(list(model.parameters())), fused=True)
    for s in range(sum(RESUME_STEPS)):
        opt.zero_grad()
        model(s).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], opt.state_dict()["state"]


def resume_mismatches(folder: str) -> dict[str, str]:
    """Each resumed configuration whose final weights or state differ from the reference
    (bitwise), with what differs."""
    weights, state = resume_reference()
    bad = {}
    for name in resume_configs():
        got = torch.load(os.path.join(folder, f"{name}-final.pt"), weights_only=True)
        diff = [i for i, (a, b) in enumerate(zip(got["weights"], weights, strict=True))
                if not torch.equal(a, b)]  # fmt: skip
        diff += [f"{k}.{key}" for k, e in state.items() for key, t in e.items()
                 if not torch.equal(got["state"][k][key].reshape(t.shape).to(t.device), t)]  # fmt: skip
        if diff:
            bad[name] = f"differs at {diff}"
    return bad
