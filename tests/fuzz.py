"""A differential fuzz of the hybrid optimizers against torch's fused optimizers on the CPU.

:func:`draw` turns a seed into a :class:`Case`: a random small model (Linear, LayerNorm,
Embedding, a tied head, raw 0-d, empty and strided params, frozen ones), its param groups
(their own hyperparameters, ``"offload"`` forced either way, one added mid-run) and a random
run (class, dtype, fraction or ``"auto"``, mode, wait, accumulation, three ways to clip, a
GradScaler attached or not with inf/NaN steps, set_offload_fraction, state_dict reloads through
a fresh optimizer or torch's, ``opt.state`` reads, weight edits, lr changes, steps without
grads, a closure). :func:`run_case` trains it with the hybrid optimizer and with the reference
below in lockstep and returns an :class:`Outcome`; :func:`minimise` shrinks a failing case.

The reference: a twin of the model (same seed, same dtype) whose fp32 masters (for fp32
params, bitwise copies of them; without masters, copies in the params' dtype) are updated by
``torch.optim.AdamW/Adam/SGD(fused=True)`` and copied into the twin's params after each step;
with ``overlap="delayed"`` the offloaded params get their new weights only at the next
``step()`` or ``synchronize()``, as ``tests/oracle.DelayedReference`` does. Every comparison is
bitwise (the bits of the params, NaN payloads included, of the state and of the scaler's
scale): the CPU stands in for the device and both sides run torch's fused kernels on the same
inputs. Every step's grads come from a forward and backward on each side, so in delayed mode
they depend on the stale weights the same way on both.

Documented refusals count as ``refused``, never as a pass: a ``ValueError``,
``NotImplementedError`` or ``TypeError`` from the constructor (``grads_final`` outside backward
mode, ...), and, in cases drawn with ``step_refusal``, the ``RuntimeError`` that ``step()`` (or
``scaler.step()``, ``opt.clip_grad_norm_()``) raises naming the cause when an update started
during backward. Anything else raised, anywhere, is a failure; so is any bit that differs.
Left out, with no torch reference: what torch itself refuses or gets wrong (GradScaler's
unscale_ of fp16 grads; torch 2.13's fused SGD with a param whose first grad comes late, where
it raises TypeError; tests/test_adam_sgd.py checks HybridSGD there against torch's for-loop
SGD). Where a GradScaler skips fused SGD's first step, the reference drops the uninitialised
momentum buffers torch's kernel leaves, as the for-loop SGD never makes them.
``tests/long/fuzz_loop.py`` is the long run; ``tests/test_fuzz.py`` the CI slice.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import random
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from offloadopt import HybridAdam, HybridAdamW, HybridSGD

KINDS = {
    "adamw": (HybridAdamW, torch.optim.AdamW),
    "adam": (HybridAdam, torch.optim.Adam),
    "sgd": (HybridSGD, torch.optim.SGD),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BATCH = 4
# The known failures (issue 28, part 2) by a piece of their message, so that the long run can
# tell them from new ones. Each has a strict xfail test in tests/test_fuzz.py.
KNOWN = {
    "empty-param-attached-scaler": lambda case, msg: (
        "cannot compute the infinity norm on an empty tensor" in msg
    ),
    "state-replaced": lambda case, msg: (
        bool(case.reset_state)
        and ("has no attribute 'install'" in msg or msg.startswith("KeyError: 'step'"))
    ),
    "nan-payload": lambda case, msg: bool(case.poison) and "NaN payload" in msg,
}


@dataclass
class Case:
    """One fuzz case: everything :func:`run_case` needs, printable as a reproducer."""

    seed: int
    kind: str = "adamw"  # adamw | adam | sgd
    dtype: str = "float32"  # float32 | bfloat16
    dim: int = 8
    layers: tuple = ("linear",)  # linear | linear-nobias | layernorm | tanh
    embedding: bool = False
    tie: bool = False  # the head's weight is the embedding's (one Parameter, two modules)
    extras: tuple = ()  # shapes of raw Parameters: () is 0-d, a 0 in a shape is empty
    transposed: tuple = ()  # (a, b): a raw Parameter that is a (b, a) tensor's .t() (strided)
    frozen: tuple = ()  # indices into the param list whose requires_grad is False
    n_groups: int = 1
    hyper: tuple = ()  # per group: dict of hyperparameters
    offload: tuple = ()  # per group: None, True or False ("offload" key)
    fraction: float = 1.0
    min_offload_numel: int = 1
    bucket_nbytes: int | None = None
    overlap: str = "step"
    wait: str = "step"
    grads_final: bool = False
    release_grads: bool = False
    # none | optimizer (max_grad_norm=) | torch (clip_grad_norm_) | method (opt.clip_grad_norm_)
    clip: str = "none"
    max_norm: float = 0.1
    scaler: str = "none"  # none | attached (grad_scaler=) | unattached (scaler.step(opt))
    accum: int = 1  # backward passes per step
    steps: int = 3
    bad: dict = field(default_factory=dict)  # step -> "inf" | "nan" in one grad (a hook)
    refraction: dict = field(default_factory=dict)  # step -> set_offload_fraction(f) after it
    reload: tuple = ()  # steps after which state_dict -> fresh optimizer -> load_state_dict
    reset_state: tuple = ()  # steps after which opt.state = defaultdict(dict), both sides
    edit: tuple = ()  # steps after which one weight element is written outside the optimizer
    peek: tuple = ()  # steps after which opt.state[p] is read for every param (a logger's way)
    poison: tuple = ()  # steps after which a master element gets a NaN with a payload (bf16)
    delay_after: int = 0
    master_weights: bool = True  # False: bf16 params update in bf16, against torch on them
    zero_to_zeros: bool = False  # zero_grad(set_to_none=False) on both sides
    lr_at: dict = field(default_factory=dict)  # step -> factor on every group's lr after it
    reload_via_torch: bool = False  # reload through torch's optimizer's load/state_dict
    late: int | None = None  # the last param joins (add_param_group) after this step
    sparse_extras: bool = False  # raw params enter the loss (get grads) at even steps only
    idle: tuple = ()  # steps with no backward: step() with every grad None (or zeros)
    reload_fraction: float | None = None  # the fresh optimizer of a reload takes this fraction
    closure: bool = False  # forward and backward inside opt.step(closure), as torch allows
    # a combination refused at step() when updates started in backward (torch's clip, an
    # unattached scaler): a RuntimeError there that says so counts as refused, not failed
    step_refusal: bool = False

    def __repr__(self) -> str:
        fields = ", ".join(
            f"{f.name}={getattr(self, f.name)!r}"
            for f in dataclasses.fields(self)
            if f.name != "seed" and getattr(self, f.name) != _DEFAULTS[f.name]
        )
        return f"Case(seed={self.seed!r}{', ' if fields else ''}{fields})"


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Case) if f.name != "seed"}
_DEFAULTS.update(bad={}, refraction={}, lr_at={})


def draw(seed: int, known: bool = True, refusals: bool = True) -> Case:
    """A random case from ``seed`` (Python's ``random``, so the same on every platform).

    ``known=False`` leaves out what triggers the known failures (an empty param with an
    attached scaler in backward mode, ``opt.state`` replaced, NaN-payload masters);
    ``refusals=False`` draws only combinations the optimizer accepts at construction.
    """
    r = random.Random(seed)
    kind = r.choice(["adamw", "adamw", "adam", "sgd"])
    dtype = r.choice(["float32", "float32", "float32", "bfloat16", "bfloat16", "float16"])
    layers = tuple(
        r.choice(["linear", "linear", "linear-nobias", "layernorm", "tanh"])
        for _ in range(r.randint(1, 3))
    )
    embedding = r.random() < 0.4
    extras = tuple(
        r.choice([(), (0,), (0, 3), (3,), (2, 5), (7,), (4, 4)]) for _ in range(r.randint(0, 3))
    )
    case = Case(seed=seed, kind=kind, dtype=dtype, dim=r.choice([4, 8, 12, 12, 40]), layers=layers,
                embedding=embedding, tie=embedding and r.random() < 0.5, extras=extras)  # fmt: skip
    if r.random() < 0.2:
        case.transposed = (r.choice([(3, 5), (8, 2), (1, 4)]),)
    n = len(_params(build_model(case)))
    case.frozen = tuple(i for i in range(n) if r.random() < 0.1)[: n - 1]  # one trains
    case.n_groups = r.randint(1, min(3, n))
    case.hyper = tuple(_hyper(r, kind) for _ in range(case.n_groups))
    case.offload = tuple(r.choice([None, None, None, True, False]) for _ in range(case.n_groups))
    case.fraction = r.choice([0.0, 0.5, 1.0, round(r.random(), 3)])
    case.min_offload_numel = r.choice([0, 1, 1, 8, 32])
    case.bucket_nbytes = r.choice([None, 64, 256, 512, 1000, 4096])
    case.overlap = r.choice(["step", "backward", "backward", "delayed"])
    case.wait = r.choice(["step", "step", "module"])
    case.clip = r.choice(["none", "none", "optimizer", "torch", "method"])
    case.max_norm = r.choice([0.01, 0.1, 10.0])
    case.scaler = r.choice(["none", "none", "attached", "unattached"])
    case.grads_final = r.random() < 0.3
    case.release_grads = r.random() < 0.2
    case.accum = r.choice([1, 1, 2, 3])
    case.steps = r.randint(2, 6)
    if case.scaler != "none":
        case.bad = {s: r.choice(["inf", "nan"]) for s in range(case.steps) if r.random() < 0.3}
    case.refraction = {
        s: r.choice([0.0, 0.5, 1.0, round(r.random(), 3)])
        for s in range(case.steps - 1)
        if r.random() < 0.15
    }
    case.reload = tuple(s for s in range(case.steps - 1) if r.random() < 0.15)
    case.edit = tuple(s for s in range(case.steps - 1) if r.random() < 0.15)
    case.peek = tuple(s for s in range(case.steps - 1) if r.random() < 0.15)
    case.zero_to_zeros = r.random() < 0.2
    case.lr_at = {s: r.choice([0.5, 2.0, 0.0]) for s in range(case.steps - 1) if r.random() < 0.15}
    case.master_weights = dtype == "float32" or r.random() < 0.75
    if kind == "sgd" and dtype != "float32" and not case.master_weights and r.random() < 0.8:
        case.master_weights = True  # refused (torch's fused CPU SGD on bf16): rarely drawn
    # torch's load_state_dict casts state to the param's dtype: lossless only where the state
    # is in that dtype already
    lossless = dtype == "float32" or not case.master_weights
    case.reload_via_torch = bool(case.reload) and lossless and r.random() < 0.5
    others = [i for i in range(n - 1) if i not in case.frozen]  # the group has a trainable one
    if others and n - 1 not in case.frozen and r.random() < 0.2:
        case.late = r.randrange(case.steps - 1)
    # torch 2.13's fused SGD raises TypeError when a param gets its first grad after others
    # have momentum buffers: no reference for HybridSGD there
    sgd = kind == "sgd"
    n_extras = len(extras) + len(case.transposed)
    inner = [i for i in range(n - n_extras) if i not in case.frozen]  # odd steps' grads
    case.sparse_extras = bool(n_extras) and r.random() < 0.25 and not sgd and bool(inner)
    case.idle = tuple(s for s in range(case.steps) if r.random() < 0.08)
    if case.reload and r.random() < 0.4:
        case.reload_fraction = r.choice([0.0, 0.5, 1.0, round(r.random(), 3)])
    case.closure = r.random() < 0.1
    if r.random() < 0.05:
        case.fraction = "auto"  # timed: placed differently run to run, results the same
    if case.overlap == "delayed" and kind != "sgd" and r.random() < 0.3:
        case.delay_after = r.randint(1, 3)
    # Drawn either way, so that a seed's other fields do not depend on ``known``.
    case.reset_state = tuple(s for s in range(case.steps - 1) if r.random() < 0.05)
    poison = tuple(s for s in range(case.steps - 1) if r.random() < 0.1)
    case.poison = poison if dtype == "bfloat16" else ()
    if not known:
        case.reset_state, case.poison = (), ()
    if r.random() < 0.85 or not refusals:
        _accepted(case)
    if case.dtype == "float16" and case.scaler != "none" and case.clip == "torch":
        case.clip = "optimizer"  # torch's GradScaler.unscale_ refuses fp16 grads, as for torch
    if case.clip == "method" and case.scaler != "none":
        case.clip = "optimizer"  # refused with grad_scaler= attached; unscale_ first otherwise
    if refusals and r.random() < 0.1:
        case.step_refusal = _refused_at_step(case)
        if case.step_refusal and case.release_grads and case.clip == "torch":
            # torch's clip then sees only the grads whose copies have not landed: an error
            # when some are left, and when every one was released a clip of nothing, silently
            # (timing decides; README's table says "no" to the combination)
            case.release_grads = False
    else:
        _runtime_refusals_out(case)
    _consistent(case)
    if not known and case.scaler == "attached" and case.overlap == "backward":
        case.extras = tuple(s for s in case.extras if 0 not in s)
        n = len(_params(build_model(case)))
        case.frozen = tuple(i for i in case.frozen if i < n)[: n - 1]
        if not [i for i in range(n - 1) if i not in case.frozen] or n - 1 in case.frozen:
            case.late = None  # the params moved up: the late one needs a trainable one beside
        inner = n - len(case.extras) - len(case.transposed)
        if not [i for i in range(inner) if i not in case.frozen]:
            case.sparse_extras = False
    return case


def _hyper(r: random.Random, kind: str) -> dict[str, Any]:
    if kind == "sgd":
        h = dict(lr=r.choice([0.01, 0.1]), momentum=r.choice([0.0, 0.5, 0.9]))
        if h["momentum"] and r.random() < 0.3:
            h["nesterov"] = True
        elif h["momentum"] and r.random() < 0.3:
            h["dampening"] = 0.3
        if r.random() < 0.4:
            h["weight_decay"] = r.choice([0.0, 0.01])
        if r.random() < 0.1:
            h["maximize"] = True
        return h
    h = dict(lr=r.choice([1e-3, 1e-2, 3e-2]), weight_decay=r.choice([0.0, 0.01, 0.1]))
    if r.random() < 0.4:
        h["betas"] = r.choice([(0.8, 0.95), (0.9, 0.99)])
    if r.random() < 0.2:
        h["eps"] = 1e-6
    if r.random() < 0.1:
        h["maximize"] = True
    return h


def _accepted(case: Case) -> None:
    """Drop what the constructor refuses (the docstrings' and README's refusals)."""
    declared = case.overlap == "backward" and (
        case.grads_final or case.clip == "optimizer" or case.scaler == "attached"
    )
    if case.overlap != "backward":
        case.grads_final = False
    if not declared or case.overlap != "backward":
        case.release_grads = False
    if case.overlap == "delayed":
        case.wait = "step"
    else:
        case.delay_after = 0
    if case.kind == "sgd":
        case.delay_after = 0


def _refused_at_step(case: Case) -> bool:
    """Whether ``step()`` refuses the case (README's table) once an update started during
    backward, which needs an offloaded param."""
    declared = case.overlap == "backward" and (
        case.grads_final or case.clip == "optimizer" or case.scaler == "attached"
    )
    return declared and (case.clip in ("torch", "method") or case.scaler == "unattached")


# What step() says when it refuses such a case (offloadopt/step/guards.py, offloadopt/step/amp.py).
STEP_REFUSALS = (
    "changed after its bucket's update started during backward",
    "updates of this step started during backward",
    "updates of this step already started from the unclipped grads",
)


def _runtime_refusals_out(case: Case) -> None:
    """Leave out the combinations refused at step() (README's table): torch's clip or an
    unattached scaler after updates that started in backward."""
    declared = case.overlap == "backward" and (
        case.grads_final or case.clip == "optimizer" or case.scaler == "attached"
    )
    if declared and case.clip in ("torch", "method"):
        case.clip = "optimizer"
    if case.overlap == "backward" and case.grads_final and case.scaler == "unattached":
        case.scaler = "attached"
    if case.clip == "optimizer" and case.scaler == "unattached" and case.overlap == "backward":
        case.scaler = "attached"  # max_grad_norm with an unattached scaler clips scaled grads


def _consistent(case: Case) -> None:
    """What the harness or torch itself cannot run (no reference, or torch refuses it)."""
    fp16_grads = case.dtype == "float16" and not case.master_weights
    if fp16_grads and case.scaler != "none" and case.clip == "optimizer":
        case.clip = "none"  # no torch flow to compare with: it cannot unscale fp16 grads
    if case.scaler != "none":
        case.idle = ()  # GradScaler.step() needs a scale() in the iteration
        case.closure = False  # scaler.step(opt) takes no closure of a scaled loss
    if case.clip in ("torch", "method") or case.accum > 1:
        case.closure = False  # the closure is the whole forward and backward
    if case.zero_to_zeros and case.release_grads:
        case.zero_to_zeros = False  # documented: released grads cannot be kept as zeros
    if case.poison and case.overlap == "delayed":
        case.poison = ()
    if case.edit and case.overlap == "delayed":
        case.edit = ()


# ---------------------------------------------------------------------------- the model
class Net(torch.nn.Module):
    """Embedding (optional) -> layers -> head (tied to the embedding or not), plus raw
    Parameters that enter the loss through a fixed coefficient times the hidden state's mean."""

    def __init__(self, case: Case):
        super().__init__()
        d = case.dim
        self.vocab = 11
        self.emb = torch.nn.Embedding(self.vocab, d) if case.embedding else None
        mods = []
        for kind in case.layers:
            if kind == "linear":
                mods.append(torch.nn.Linear(d, d))
            elif kind == "linear-nobias":
                mods.append(torch.nn.Linear(d, d, bias=False))
            elif kind == "layernorm":
                mods.append(torch.nn.LayerNorm(d))
            else:
                mods.append(torch.nn.Tanh())
        self.body = torch.nn.Sequential(*mods)
        out = self.vocab if case.embedding else 3
        self.head = torch.nn.Linear(d, out, bias=not case.tie)
        if case.tie:
            self.head.weight = self.emb.weight
        self.extras = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.randn(s) * 0.5) for s in case.extras]
            + [torch.nn.Parameter(torch.randn(b, a).t() * 0.5) for a, b in case.transposed]
        )
        self.coefs = [torch.randn(s) for s in case.extras]
        self.coefs += [torch.randn(a, b) for a, b in case.transposed]

    def forward(self, x: torch.Tensor, extras: bool = True) -> torch.Tensor:
        h = self.emb(x) if self.emb is not None else x
        h = self.body(h)
        loss = self.head(h).float().pow(2).mean()
        m = h.float().mean()
        for p, c in zip(self.extras if extras else [], self.coefs, strict=False):
            loss = loss + (p.float() * c).sum() * m
        return loss


def build_model(case: Case) -> Net:
    torch.manual_seed(case.seed)
    return Net(case).to(DTYPES[case.dtype])


def _params(model: Net) -> list[torch.nn.Parameter]:
    return list(model.parameters())  # deduplicated: a tied weight once


def batch(case: Case, step: int, micro: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(case.seed * 1000 + step * 10 + micro)
    if case.embedding:
        return torch.randint(0, 11, (BATCH,), generator=g)
    return torch.randn(BATCH, case.dim, generator=g).to(DTYPES[case.dtype])


def groups_of(
    case: Case, params: list[torch.Tensor], forced: bool = True, added: bool = False
) -> list[dict]:
    """Contiguous slices of the params in model order, one per group; with ``case.late`` the
    last param is left out, or (``added``) makes a group of its own at the end."""
    if case.late is not None:
        late = params[-1]
        params = params[:-1]
        if added:
            return [
                *groups_of(dataclasses.replace(case, late=None), params, forced),
                late_group(case, late),
            ]
    n, k = len(params), case.n_groups
    cuts = [round(i * n / k) for i in range(k + 1)]
    out = []
    for i in range(k):
        g = {"params": params[cuts[i] : cuts[i + 1]], **_at(case.hyper, i, {})}
        if forced and _at(case.offload, i, None) is not None:
            g["offload"] = case.offload[i]
        out.append(g)
    return [g for g in out if g["params"]]


def late_group(case: Case, p: torch.Tensor) -> dict:
    if case.kind == "sgd":
        return {"params": [p], "lr": 0.05, "momentum": 0.9}
    return {"params": [p], "lr": 0.02, "weight_decay": 0.05}


def _at(values: tuple, i: int, default: Any) -> Any:
    return values[i] if i < len(values) else default


# ---------------------------------------------------------------------------- the reference
class Reference:
    """torch's fused optimizer over fp32 masters of the twin model's params (see the module
    docstring); ``delayed`` holds the indices whose new weights wait for the next step."""

    def __init__(self, case: Case, params: list[torch.nn.Parameter]):
        self.case, self.params = case, params
        udt = torch.float32 if case.master_weights else DTYPES[case.dtype]
        self.masters = [p.detach().to(udt).clone() for p in params]
        for p, m in zip(params, self.masters, strict=True):
            m.requires_grad_(p.requires_grad)
        torch_cls = KINDS[case.kind][1]
        self.opt = torch_cls(groups_of(case, self.masters, forced=False), fused=True)
        # unscale_ of the twin's own grads (torch's clip after unscale_) goes through this
        # never-stepped optimizer over the twin's params, as the user's does on the hybrid's.
        self.added = False
        self.shadow = self._shadow()
        self.scaler = new_scaler() if case.scaler != "none" else None
        self.delayed: set[int] = set()
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        # weights written outside the optimizer: param index -> [(element, value)]; a master
        # takes them at the param's next update, as the optimizer refreshes stale masters
        self.stale: dict[int, list] = {}

    def _shadow(self) -> torch.optim.Optimizer:
        mine = {id(m) for g in self.opt.param_groups for m in g["params"]}
        ps = [p for p, m in zip(self.params, self.masters, strict=True) if id(m) in mine]
        return torch.optim.SGD(ps, lr=0.0)

    def add_late(self) -> None:
        self.synchronize()  # add_param_group() waits for the update in flight, publishing it
        self.opt.add_param_group(late_group(self.case, self.masters[-1]))
        self.added = True
        self.shadow = self._shadow()

    def in_opt(self, i: int) -> bool:
        return self.case.late is None or self.added or i != len(self.params) - 1

    @torch.no_grad()
    def step(self, found_inf: bool | None = None) -> None:
        """One step on the twin's grads; ``found_inf``: the caller already unscaled them
        through :attr:`shadow` (torch's clip with a scaler) and found infs or not."""
        case = self.case
        have = [i for i, p in enumerate(self.params) if p.grad is not None and self.in_opt(i)]
        self.synchronize()
        # delay_after counts the offloaded params' updates: the largest step among them
        taken = max((int(self.opt.state[self.masters[i]]["step"]) for i in self.delayed
                     if "step" in self.opt.state.get(self.masters[i], {})), default=0)  # fmt: skip
        late = taken >= case.delay_after
        for i in have:
            for at, value in self.stale.pop(i, []):
                self.masters[i][at] = value
        for p, m in zip(self.params, self.masters, strict=True):
            m.grad = p.grad.to(m.dtype) if p.grad is not None else None
        if self.scaler is not None and found_inf is None:
            fresh = [m for m in self.masters if not self.opt.state.get(m)]
            if case.clip == "optimizer":
                self.scaler.unscale_(self.opt)
                _clip([self.masters[i] for i in have], case.max_norm)
            self.scaler.step(self.opt)
            found = self.scaler._per_optimizer_states[id(self.opt)]["found_inf_per_device"]
            found_inf = bool(sum(v.item() for v in found.values()))
            if found_inf:
                # torch's fused SGD makes its momentum buffers with empty_like() before the
                # kernel, which then skips the step: garbage in them from the next step on
                # (torch 2.13). A skipped step must leave no state, as torch's for-loop
                # SGD (its step is skipped whole) and Adam's kernel (step counted back) do.
                for m in fresh:
                    self.opt.state.pop(m, None)
        elif not found_inf:  # None without a scaler
            if case.clip in ("optimizer", "method"):
                _clip([self.masters[i] for i in have], case.max_norm)
            self.opt.step()
        if self.scaler is not None:
            self.scaler.update()
        for i in have:
            p, m = self.params[i], self.masters[i]
            if i in self.delayed and late:
                self.pending.append((p, m.to(p.dtype)))
            else:
                p.copy_(m)

    @torch.no_grad()
    def reset(self) -> None:
        """``opt.state = defaultdict(dict)``: torch's state starts afresh; the masters, state
        too on the hybrid side, start again from the weights."""
        self.synchronize()
        self.opt.state = collections.defaultdict(dict)
        for p, m in zip(self.params, self.masters, strict=True):
            m.copy_(p)
        self.stale = {}

    @torch.no_grad()
    def synchronize(self) -> None:
        for p, w in self.pending:
            p.copy_(w)
        self.pending = []


def _found_inf(scaler, shadow) -> bool:
    scaler.unscale_(shadow)
    states = scaler._per_optimizer_states[id(shadow)]["found_inf_per_device"]
    return bool(sum(v.item() for v in states.values()))


def _clip(masters: list[torch.Tensor], max_norm: float) -> None:
    """torch's clip_grad_norm_ in param-group order (the optimizer's), its norms taken in
    fp32 and its coefficient applied in fp32 (rounded once to bf16 grads without masters),
    as the README says the optimizer clips."""
    grads = [m.grad for m in masters if m.grad is not None]
    if not grads:
        return
    norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
    norm = torch.linalg.vector_norm(torch.stack(list(norms)))
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    torch._foreach_mul_(grads, coef)


def new_scaler() -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)


# ---------------------------------------------------------------------------- running
@dataclass
class Outcome:
    case: Case
    status: str  # passed | refused | failed
    message: str = ""
    known: str | None = None  # a key of KNOWN when the failure is a known one
    trace: str = ""
    offloaded: int = 0  # the most params offloaded at once during the run

    @property
    def ok(self) -> bool:
        return self.status != "failed"


def make_opt(case: Case, model: Net, scaler, added: bool = False, fraction=None) -> Any:
    cls = KINDS[case.kind][0]
    kw: dict[str, Any] = dict(
        offload_fraction=case.fraction if fraction is None else fraction, min_offload_numel=case.min_offload_numel,
        bucket_nbytes=case.bucket_nbytes, overlap=case.overlap, wait=case.wait,
        cpu_threads=1,
    )  # fmt: skip
    if case.grads_final:
        kw["grads_final"] = True
    if case.release_grads:
        kw["release_grads"] = True
    if case.clip == "optimizer":
        kw["max_grad_norm"] = case.max_norm
    if case.scaler == "attached":
        kw["grad_scaler"] = scaler
    if case.delay_after:
        kw["delay_after"] = case.delay_after
    if not case.master_weights:
        kw["master_weights"] = False
    opt = cls(groups_of(case, _params(model), added=added), **kw)
    if case.wait == "module":
        opt.watch(model)
    return opt


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.dtype == torch.float32:
        return t.view(torch.int32)
    if t.dtype in (torch.bfloat16, torch.float16):
        return t.view(torch.int16)
    return t


class Mismatch(AssertionError):
    pass


def check_equal(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    if a.shape != b.shape or a.dtype != b.dtype:
        raise Mismatch(f"{what}: {tuple(a.shape)} {a.dtype} against {tuple(b.shape)} {b.dtype}")
    if not torch.equal(bits(a), bits(b)):
        diff = (bits(a) != bits(b)).reshape(-1)
        k = int(diff.nonzero()[0])
        x, y = a.reshape(-1)[k], b.reshape(-1)[k]
        nan = " (NaN payload)" if bool(x.isnan()) and bool(y.isnan()) else ""
        raise Mismatch(
            f"{what}: {int(diff.sum())} of {a.numel()} elements differ{nan}, first at {k}: "
            f"{x.item()!r} (bits {hex(int(bits(a).reshape(-1)[k]) & 0xFFFFFFFF)}) against "
            f"{y.item()!r} (bits {hex(int(bits(b).reshape(-1)[k]) & 0xFFFFFFFF)})"
        )


def run_case(case: Case) -> Outcome:
    """Train ``case`` with the hybrid optimizer and the reference in lockstep."""
    seen = [0]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _run(case, seen)
    except _Refused as e:
        return Outcome(case, "refused", str(e))
    except Exception as e:  # noqa: BLE001 - every other exception is the finding
        msg = f"{type(e).__name__}: {e}"
        known = next((k for k, said in KNOWN.items() if said(case, msg)), None)
        trace = traceback.format_exc(limit=-6)
        return Outcome(case, "failed", msg, known, trace, seen[0])
    return Outcome(case, "passed", offloaded=seen[0])


class _Refused(Exception):
    pass


def _run(case: Case, seen: list[int]) -> None:
    dtype = DTYPES[case.dtype]
    model, twin = build_model(case), build_model(case)
    params, ref_params = _params(model), _params(twin)
    for i in case.frozen:
        params[i].requires_grad_(False)
        ref_params[i].requires_grad_(False)
    scaler = new_scaler() if case.scaler != "none" else None
    try:
        opt = make_opt(case, model, scaler)
    except (ValueError, NotImplementedError, TypeError) as e:
        raise _Refused(f"{type(e).__name__}: {e}") from e
    ref = Reference(case, ref_params)
    order = {id(p): i for i, p in enumerate(params)}

    def offloaded() -> set[int]:
        if case.overlap != "delayed":
            return set()
        return {order[id(p)] for g in opt.param_groups for p in g["params"] if opt.is_offloaded(p)}

    ref.delayed = offloaded()
    try:
        for step in range(case.steps):
            _one_step(case, step, model, opt, scaler, twin, ref)
            seen[0] = max(seen[0], sum(opt.is_offloaded(p) for p in params))
            if case.overlap == "delayed":
                # The offloaded params still hold the weights of the step before, on both sides.
                _zero_grad(opt, twin, params, ref)
            else:
                opt.synchronize()
            _compare_params(params, ref_params, f"after step {step}")
            if scaler is not None and scaler.get_scale() != ref.scaler.get_scale():
                raise Mismatch(
                    f"after step {step}: scale {scaler.get_scale()} against "
                    f"{ref.scaler.get_scale()}"
                )
            _zero_grad(opt, twin, params, ref, set_to_none=not case.zero_to_zeros)
            if step in case.lr_at:
                for o in (opt, ref.opt):
                    for g in o.param_groups:
                        g["lr"] *= case.lr_at[step]
            if step == case.late:
                opt.add_param_group(late_group(case, params[-1]))
                ref.add_late()
                ref.delayed = offloaded()
            if step in case.refraction:
                opt.set_offload_fraction(case.refraction[step])
                ref.synchronize()  # it publishes the update in flight, as state_dict() does
                ref.delayed = offloaded()
            if step in case.reload:
                sd = copy.deepcopy(opt.state_dict())
                ref.synchronize()
                opt.close()
                if case.reload_via_torch:  # a torch optimizer in between: its layout both ways
                    groups = groups_of(case, _params(model), forced=False, added=ref.added)
                    through = KINDS[case.kind][1](groups, fused=True)
                    through.load_state_dict(sd)
                    sd = copy.deepcopy(through.state_dict())
                opt = make_opt(case, model, scaler, ref.added, case.reload_fraction)
                opt.load_state_dict(sd)
                ref.delayed = offloaded()
            if step in case.reset_state:
                opt.state = collections.defaultdict(dict)
                ref.reset()
            if step in case.peek:  # leaves {} for params without state, as in torch
                for i, (p, m) in enumerate(zip(params, ref.masters, strict=True)):
                    if ref.in_opt(i):  # a param outside both optimizers breaks state_dict()
                        _ = opt.state[p], ref.opt.state[m]
            if step in case.edit:
                _edit(case, step, opt, params, ref)
            if step in case.poison:
                _poison(case, step, opt, params, ref)
        opt.synchronize()
        ref.synchronize()
        _compare_params(params, ref_params, "at the end")
        _compare_state(opt, params, ref)
        if dtype != torch.float32 and case.poison:
            _check_payloads(opt, params, ref)
    finally:
        opt.close()


def _one_step(case, step, model, opt, scaler, twin, ref) -> None:
    if step in case.idle:  # no backward: every grad None (or the zeros zero_grad left)
        opt.step()
        ref.step()
        return
    if case.closure:
        for m in (model, twin):
            handle = _bad_hook(case, step, m, ref)

            def closure(m=m):
                loss = m(batch(case, step, 0), extras=not case.sparse_extras or step % 2 == 0)
                loss.backward()
                return loss

            if m is model:
                opt.step(closure)
            else:
                closure()
                ref.step()
            if handle is not None:
                handle.remove()
        return
    for side, m, s in (("hybrid", model, scaler), ("reference", twin, ref.scaler)):
        o = opt if side == "hybrid" else None
        for micro in range(case.accum):
            final = micro == case.accum - 1
            handle = _bad_hook(case, step, m, ref) if final else None
            loss = m(batch(case, step, micro), extras=not case.sparse_extras or step % 2 == 0)
            if s is not None:
                loss = s.scale(loss)
            ctx = o.accumulating() if (o is not None and not final) else _null()
            with ctx:
                loss.backward()
            if handle is not None:
                handle.remove()
        if side == "hybrid":
            try:
                if case.clip == "torch":
                    if s is not None:
                        s.unscale_(opt)
                    torch.nn.utils.clip_grad_norm_(m.parameters(), case.max_norm)
                if case.clip == "method":
                    opt.clip_grad_norm_(case.max_norm)
                if s is not None:
                    s.step(opt)
                    s.update()
                else:
                    opt.step()
            except RuntimeError as e:
                if case.step_refusal and any(said in str(e) for said in STEP_REFUSALS):
                    raise _Refused(f"at step {step}: {e}") from e
                raise
        else:
            found = None
            if case.clip == "torch":
                if s is not None:
                    found = _found_inf(s, ref.shadow)  # the user's unscale_, on the twin
                torch.nn.utils.clip_grad_norm_(m.parameters(), case.max_norm)
            ref.step(found)


def _bad_hook(case: Case, step: int, m: Net, ref: Reference):
    """At a bad step, a hook that puts an inf or a NaN in one grad, inside backward."""
    if step not in case.bad:
        return None
    ps = [p for i, p in enumerate(m.parameters()) if ref.in_opt(i)]
    p = next((p for p in ps if p.requires_grad and p.numel()), None)
    bad = float(case.bad[step])
    return None if p is None else p.register_hook(lambda g, bad=bad: _poisoned(g, bad))


def _zero_grad(opt, twin, params, ref: Reference, set_to_none: bool = True) -> None:
    """opt.zero_grad() on the hybrid's side, model.zero_grad() for a param not (yet) in it,
    as a training loop that adds a group later has its grads dropped (the twin: all)."""
    opt.zero_grad(set_to_none=set_to_none)
    twin.zero_grad(set_to_none=set_to_none)
    for i, p in enumerate(params):
        if not ref.in_opt(i) and p.grad is not None:
            p.grad = None if set_to_none else p.grad.zero_()


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _poisoned(g: torch.Tensor, bad: float) -> torch.Tensor:
    g = g.clone()
    g.view(-1)[0] = bad
    return g


def _compare_params(params, ref_params, what) -> None:
    for i, (p, q) in enumerate(zip(params, ref_params, strict=True)):
        check_equal(p, q, f"{what}, param {i}")


def _compare_state(opt, params, ref: Reference) -> None:
    for i, (p, m) in enumerate(zip(params, ref.masters, strict=True)):
        theirs = ref.opt.state.get(m, {})
        mine = opt.state[p] if theirs else {}
        for k, v in theirs.items():
            if k not in mine:
                raise Mismatch(f"state of param {i}: no {k!r} (has {sorted(mine)})")
            check_equal(mine[k].to(v.dtype), v, f"state {k!r} of param {i}")
        if "master" in mine:
            check_equal(mine["master"], m.detach(), f"master of param {i}")


@torch.no_grad()
def _edit(case: Case, step: int, opt, params, ref: Reference) -> None:
    """One weight element written outside the optimizer, on both sides; the reference's
    master takes the written value there (the optimizer refreshes only changed elements)."""
    r = random.Random(case.seed * 31 + step)
    cands = [i for i, p in enumerate(params) if p.numel() > 0 and p.requires_grad]
    if not cands:
        return
    i = r.choice(cands)
    at = _element(params[i], r)
    value = torch.tensor(r.uniform(-2, 2)).to(params[i].dtype)
    for p in (params[i], ref.params[i]):
        p[at] = value
    ref.stale.setdefault(i, []).append((at, value.to(ref.masters[i].dtype)))


def _element(p: torch.Tensor, r: random.Random) -> tuple:
    """A random element's index (any strides: a transposed param has no flat view)."""
    k = r.randrange(p.numel())
    return tuple(int(i) for i in torch.unravel_index(torch.tensor(k), p.shape))


@torch.no_grad()
def _poison(case: Case, step: int, opt, params, ref: Reference) -> None:
    """A NaN with a payload in one fp32 master element (bf16 params), and the param set to
    that master's bf16 value: the weight equals its master's rounding, so the optimizer must
    keep the master's bits (issue 28, part 2: the refresh replaced them)."""
    r = random.Random(case.seed * 37 + step)
    cands = [i for i, p in enumerate(params) if p.numel() and "master" in opt.state.get(p, {})]
    if not cands:
        return
    i = r.choice(cands)
    at = _element(params[i], r)
    nan = torch.tensor(0x7FC00123, dtype=torch.int32).view(torch.float32)
    for master in (opt.state[params[i]]["master"], ref.masters[i]):
        master[at].copy_(nan)
    for p in (params[i], ref.params[i]):
        p[at].copy_(nan.to(p.dtype))


def _check_payloads(opt, params, ref: Reference) -> None:
    for i, (p, m) in enumerate(zip(params, ref.masters, strict=True)):
        mine = opt.state[p].get("master")
        if mine is not None and not torch.equal(bits(mine), bits(m)):
            raise Mismatch(f"NaN payload of the master of param {i} changed")


SIMPLER = dict(
    kind="adamw", dtype="float32", layers=("linear",), embedding=False, tie=False, extras=(),
    transposed=(), frozen=(), n_groups=1, hyper=(), offload=(), fraction=1.0,
    min_offload_numel=1, bucket_nbytes=None, overlap="step", wait="step", grads_final=False,
    release_grads=False, clip="none", scaler="none", accum=1, bad={}, refraction={}, reload=(),
    reset_state=(), edit=(), peek=(), poison=(), delay_after=0, master_weights=True,
    zero_to_zeros=False, lr_at={}, reload_via_torch=False, late=None, sparse_extras=False,
    idle=(), reload_fraction=None, closure=False, step_refusal=False,
)  # fmt: skip


def minimise(case: Case, still_fails) -> Case:
    """Greedy: each field set to its simplest value, and steps cut, while ``still_fails``
    (a function of an :class:`Outcome`) holds; twice over, since one change can unblock
    another."""
    for _ in range(2):
        for name, simple in SIMPLER.items():
            if getattr(case, name) == simple:
                continue
            trial = dataclasses.replace(case, **{name: simple})
            try:
                if still_fails(run_case(trial)):
                    case = trial
            except Exception:  # noqa: BLE001 - a field the others depend on: keep it
                pass
        while case.steps > 1:
            trial = dataclasses.replace(case, steps=case.steps - 1)
            if not still_fails(run_case(trial)):
                break
            case = trial
    return case
