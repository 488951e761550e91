"""The endurance run's checks (tests/long/endurance.py): the lockstep oracle and the
flatness of memory.

1. Bitwise lockstep (:class:`Oracle`). For every param whose state the hybrid offloads, the
   oracle keeps its own fp32 master, ``exp_avg``, ``exp_avg_sq`` and ``step`` on the CPU, is
   fed the same clipped grads and runs ``torch._fused_adamw_`` (``ORACLE_KERNEL``) with the
   group's hyperparameters on the training thread; after every step the hybrid's offloaded
   state must equal the oracle's (``torch.equal``), and at each sample its low-precision
   weights the oracle's masters rounded.
2. Flat memory (:func:`sample`, :func:`flatness`): host RSS, pinned, host-state, GPU allocated
   and GPU peak bytes; after warm-up (the first ``WARMUP_FRACTION`` of the steps) the spread of
   each within its limit: host RSS within max(64 MiB, 2% of its smallest sample), the others
   exactly flat.
"""

from __future__ import annotations

import torch

from offloadopt import HybridAdamW
from offloadopt.harness.train import host_rss_nbytes

WARMUP_FRACTION = 0.1  # samples within the first 10% of the steps are warm-up
RSS_LIMIT_NBYTES = 64 * 2**20  # host RSS spread allowed after warm-up: max(64 MiB, 2%)
RSS_LIMIT_FRACTION = 0.02

# The oracle's kernel; a module attribute so that a test can break it and see the check fire.
ORACLE_KERNEL = torch._fused_adamw_


class Oracle:
    """Lockstep shadow of the hybrid's offloaded params: fp32 master, ``exp_avg``,
    ``exp_avg_sq`` and ``step`` per param on the CPU, updated by ``torch._fused_adamw_`` on the
    calling thread (no flush-to-zero: the hybrid runs with ``flush_denormal=False``).

    Args:
        opt: the HybridAdamW whose offloaded params are shadowed (``opt.is_offloaded``).
        named: ``model.named_parameters()`` as a list; the weights at build time are the
            masters' start, as the hybrid makes its masters at the first step.
    """

    KEYS = ("master", "exp_avg", "exp_avg_sq", "step")

    def __init__(self, opt: HybridAdamW, named: list[tuple[str, torch.nn.Parameter]]):
        self.opt = opt
        self.names = [n for n, p in named if opt.is_offloaded(p)]
        self.params = [p for _, p in named if opt.is_offloaded(p)]
        if not self.params:
            raise ValueError("the optimizer offloads no param: nothing to check")
        group_of = {p: g for g in opt.param_groups for p in g["params"]}
        self.groups = [group_of[p] for p in self.params]
        self.state = {
            "master": [p.detach().float().cpu().clone() for p in self.params],
            "exp_avg": [torch.zeros(p.shape, dtype=torch.float32) for p in self.params],
            "exp_avg_sq": [torch.zeros(p.shape, dtype=torch.float32) for p in self.params],
            "step": [torch.zeros((), dtype=torch.float32) for _ in self.params],
        }

    @property
    def numel(self) -> int:
        """Elements of the shadowed params."""
        return sum(p.numel() for p in self.params)

    def capture(self) -> list[torch.Tensor]:
        """The params' current grads as fp32 CPU tensors (blocking copies; a CPU fp32 grad is
        cloned, so nothing done to ``p.grad`` later reaches the oracle)."""
        grads = []
        for p in self.params:
            g = p.grad.float().cpu()
            grads.append(g.clone() if g.data_ptr() == p.grad.data_ptr() else g)
        return grads

    @torch.no_grad()
    def step(self, grads: list[torch.Tensor]) -> None:
        """One AdamW update of every shadowed param, one kernel call per param group, with the
        group's values now (the hybrid freezes them when its step starts; nothing changes them
        in between)."""
        st = self.state
        torch._foreach_add_(st["step"], 1)
        by_group: dict[int, list[int]] = {}
        for i, g in enumerate(self.groups):
            by_group.setdefault(id(g), []).append(i)
        for idx in by_group.values():
            g = self.groups[idx[0]]
            beta1, beta2 = g["betas"]
            ORACLE_KERNEL(
                [st["master"][i] for i in idx],
                [grads[i] for i in idx],
                [st["exp_avg"][i] for i in idx],
                [st["exp_avg_sq"][i] for i in idx],
                [],
                [st["step"][i] for i in idx],
                amsgrad=False,
                lr=float(g["lr"]),
                beta1=float(beta1),
                beta2=float(beta2),
                weight_decay=g["weight_decay"],
                eps=g["eps"],
                maximize=g["maximize"],
            )

    def _hybrid(self, i: int, key: str) -> torch.Tensor:
        """The hybrid's value of ``key`` for param ``i``, on the CPU. ``opt.state[p]`` is a
        dict read of host tensors (views of the arenas). An fp32 param keeps no ``"master"``
        key: its weights are the master (copied to the CPU when they live on the GPU)."""
        p = self.params[i]
        entry = self.opt.state[p]
        if key == "master" and "master" not in entry:
            return p.detach().cpu()
        return entry[key]

    def compare(self) -> list[dict]:
        """The mismatching (param, key) pairs: ``torch.equal`` of the hybrid's offloaded state
        and the oracle's; each with the differing elements and their largest absolute gap."""
        bad = []
        for i, name in enumerate(self.names):
            for key in self.KEYS:
                mine, theirs = self.state[key][i], self._hybrid(i, key)
                if mine.shape == theirs.shape and torch.equal(mine, theirs):
                    continue
                diff = (mine.double() - theirs.double().reshape(mine.shape)).abs()
                bad.append(
                    {
                        "param": name,
                        "key": key,
                        "elements_differing": int((diff != 0).sum()),
                        "elements": mine.numel(),
                        "max_abs_diff": float(diff.max()),
                    }
                )
        return bad

    def resync(self) -> None:
        """Take the hybrid's state, so that a later mismatch is a new one."""
        for i in range(len(self.params)):
            for key in self.KEYS:
                self.state[key][i].copy_(self._hybrid(i, key).reshape(self.state[key][i].shape))

    @torch.no_grad()
    def weights_mismatching(self) -> list[str]:
        """Params kept in a low-precision dtype whose weights (on their device) differ from
        the oracle's master rounded to that dtype; fp32 params are compared by ``compare``."""
        bad = []
        for name, p, m in zip(self.names, self.params, self.state["master"], strict=True):
            if p.dtype != torch.float32 and not torch.equal(p, m.to(p.device).to(p.dtype)):
                bad.append(name)
        return bad


def sample(step: int, opt: HybridAdamW, device: torch.device, loss: float) -> dict:
    """One sample of the memory figures (bytes) and the train loss (nats) at ``step``."""
    cuda = device.type == "cuda"
    return {
        "step": step,
        "host_rss_nbytes": host_rss_nbytes(),
        "pinned_nbytes": opt.pinned_nbytes,
        "host_nbytes": opt.host_nbytes,
        "gpu_allocated_nbytes": torch.cuda.memory_allocated(device) if cuda else 0,
        "gpu_max_allocated_nbytes": torch.cuda.max_memory_allocated(device) if cuda else 0,
        "train_loss_nats": loss,
    }


FLAT_KEYS = (
    "host_rss_nbytes",
    "pinned_nbytes",
    "host_nbytes",
    "gpu_allocated_nbytes",
    "gpu_max_allocated_nbytes",
)


def flatness(samples: list[dict], steps: int) -> dict:
    """Spread (max - min, bytes and as a fraction of the min) of each memory figure over the
    samples after warm-up (step > ``WARMUP_FRACTION`` * steps), its limit and whether it holds.
    Fewer than two samples after warm-up: the samples of the whole run."""
    warmup = int(steps * WARMUP_FRACTION)
    after = [s for s in samples if s["step"] > warmup]
    if len(after) < 2:
        after = samples
    out: dict = {
        "warmup_steps": warmup,
        "samples_after_warmup": len(after),
        "first_step": after[0]["step"],
        "last_step": after[-1]["step"],
    }
    for key in FLAT_KEYS:
        values = [s[key] for s in after]
        lo, hi = min(values), max(values)
        limit = (
            max(RSS_LIMIT_NBYTES, int(RSS_LIMIT_FRACTION * lo)) if key == "host_rss_nbytes" else 0
        )
        name = key.removesuffix("_nbytes")
        out[name] = {
            "min_nbytes": lo,
            "max_nbytes": hi,
            "spread_nbytes": hi - lo,
            "spread_fraction": (hi - lo) / lo if lo else 0.0,
            "growth_nbytes": values[-1] - values[0],  # last minus first sample after warm-up
            "limit_nbytes": limit,
            "ok": hi - lo <= limit,
        }
    return out
