"""A GradScaler in every mode against torch.optim.AdamW(fused=True) with the same scaler flow,
bitwise (CPU stands in for the GPU; offloadopt/step/amp.py's note): the scale reaches both kernels,
a step with an inf or a NaN is skipped and not counted, and the scaler backs off and grows
exactly as with torch's optimizer."""

import copy

import pytest
import torch
from oracle import FRACTIONS, assert_bitwise

from offloadopt import HybridAdamW, HybridSGD

INIT_SCALE, GROWTH_INTERVAL = 2.0**12, 2
BAD_STEPS = {2: "inf", 4: "nan"}  # step -> what one param's grad gets there
CLIP = 0.01  # below the unscaled grad norm of every step here (0.04-0.09): the clip bites


def mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(48, 48), torch.nn.Tanh(), torch.nn.Linear(48, 48), torch.nn.Linear(48, 48)
    )


def scaler():
    return torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)


def batch(step):
    return torch.randn(8, 48, generator=torch.Generator().manual_seed(step))


def train(model, opt, scaler, steps=7, clip=None, bad_param=0, opt_clips=False):
    """The usual AMP loop; at BAD_STEPS one param's grad gets an inf or a NaN (a tensor hook, so
    it happens inside backward, before any update can start). Returns the params, the
    scales after each update() and the steps skipped."""
    params = list(model.parameters())
    scales = []
    for step in range(steps):
        handle = None
        if step in BAD_STEPS:
            bad = float(BAD_STEPS[step])
            handle = params[bad_param].register_hook(lambda g, bad=bad: g.index_fill(0, torch.tensor([1]), bad))  # fmt: skip
        loss = model(batch(step)).pow(2).mean()
        scaler.scale(loss).backward()
        if handle is not None:
            handle.remove()
        if clip is not None and not opt_clips:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(params, clip)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        opt.zero_grad()
    getattr(opt, "synchronize", lambda: None)()
    return [p.detach().clone() for p in params], scales


def reference(clip=None, bad_param=0, sgd=False):
    model = mlp()
    if sgd:
        opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, fused=True)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    s = scaler()
    got = train(model, opt, s, clip=clip, bad_param=bad_param)
    return got, opt


MODES = {
    "step": dict(overlap="step"),
    "step-module": dict(overlap="step", wait="module"),
    "backward-unattached": dict(overlap="backward"),  # updates wait for step()
    "backward-attached": dict(overlap="backward", attach=True),
    "backward-attached-final": dict(overlap="backward", grads_final=True, attach=True),
    "backward-attached-release": dict(overlap="backward", release_grads=True, attach=True),
    "backward-attached-module": dict(overlap="backward", wait="module", attach=True),
}


def build(model, fraction, mode, s, cls=HybridAdamW, **extra):
    kw = dict(MODES[mode], **extra)
    if kw.pop("attach", False):
        kw["grad_scaler"] = s
    hyper = dict(momentum=0.9) if cls is HybridSGD else {}
    opt = cls(model.parameters(), lr=1e-2, offload_fraction=fraction, min_offload_numel=1,
              bucket_nbytes=4 * 1000, **hyper, **kw)  # fmt: skip
    if kw.get("wait") == "module":
        opt.watch(model)
    return opt


@pytest.mark.parametrize("fraction", FRACTIONS)
@pytest.mark.parametrize("mode", list(MODES))
def test_grad_scaler_matches_torch_fused_adamw_bitwise(mode, fraction):
    (ref, ref_scales), ref_opt = reference()
    model, s = mlp(), scaler()
    opt = build(model, fraction, mode, s)
    got, scales = train(model, opt, s)
    assert_bitwise(got, ref, f"{mode} at {fraction}")
    assert scales == ref_scales, (mode, scales, ref_scales)
    assert scales[2] < scales[1], "the inf step backed the scale off"
    want = [int(ref_opt.state[p]["step"]) for p in ref_opt.param_groups[0]["params"]]
    have = [int(opt.state[p]["step"]) for p in opt.param_groups[0]["params"]]
    assert have == want == [7 - len(BAD_STEPS)] * len(want), "skipped steps are not counted"


@pytest.mark.parametrize("fraction", FRACTIONS)
@pytest.mark.parametrize("bad_param", [0, 5])  # the first param (offloaded first) and the last
def test_grad_scaler_with_clipping_through_the_optimizer(fraction, bad_param):
    """max_grad_norm= with a scaler is torch's unscale_, clip_grad_norm_, step."""
    (ref, ref_scales), _ = reference(clip=CLIP, bad_param=bad_param)
    for mode in ("step", "backward-attached", "backward-attached-release"):
        model, s = mlp(), scaler()
        opt = build(model, fraction, mode, s, max_grad_norm=CLIP)
        got, scales = train(model, opt, s, clip=CLIP, bad_param=bad_param, opt_clips=True)
        assert CLIP < opt.last_grad_norm < float("inf"), "the clip bites (unscaled norm)"
        assert_bitwise(got, ref, f"{mode} at {fraction}")
        assert scales == ref_scales, mode


def test_grad_scaler_with_torch_clipping_after_unscale():
    """scaler.unscale_(opt), then torch's clip: step() gets found_inf and no scale."""
    (ref, ref_scales), _ = reference(clip=CLIP)
    for mode in ("step", "backward-unattached"):
        model, s = mlp(), scaler()
        got, scales = train(model, build(model, 0.5, mode, s), s, clip=CLIP)
        assert_bitwise(got, ref, mode)
        assert scales == ref_scales, mode


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_grad_scaler_with_sgd(fraction):
    (ref, ref_scales), _ = reference(sgd=True, bad_param=5)
    model, s = mlp(), scaler()
    got, scales = train(model, build(model, fraction, "step", s, cls=HybridSGD), s, bad_param=5)
    assert_bitwise(got, ref, f"SGD at {fraction}")
    assert scales == ref_scales


@pytest.mark.parametrize("clip", [None, 1.0])
def test_attached_scaler_starts_the_updates_at_the_end_of_backward(clip):
    """Attached, every offloaded bucket is queued to the worker once backward ends, before
    scaler.step(); unattached, backward mode's updates wait for step(). An inf step with
    release_grads: the grads are gone after step(), the scale backed off, nothing changed."""
    for attach in (True, False):
        model, s = mlp(), scaler()
        kw = dict(grad_scaler=s, release_grads=True) if attach else {}
        opt = HybridAdamW(model.parameters(), lr=1e-2, min_offload_numel=1, bucket_nbytes=4000,
                          overlap="backward", max_grad_norm=clip, **kw)  # fmt: skip
        params = list(model.parameters())
        s.scale(model(batch(0)).pow(2).mean()).backward()
        fed = opt.debug.step is not None and len(opt.debug.step.fed)
        # unattached, max_grad_norm starts them too, from the scaled grads: refused below
        want = len(opt.buckets) if attach or clip else 0
        assert fed == want and len(opt.buckets) > 2, (attach, fed)
        if attach:
            assert opt.debug.step.amp.found_inf.item() == 0.0
        elif clip:
            with pytest.raises(RuntimeError, match="grad_scaler=scaler"):
                s.step(opt)
    model, s = mlp(), scaler()
    opt = build(model, 1.0, "backward-attached-release", s, max_grad_norm=clip)
    params = list(model.parameters())
    handle = params[0].register_hook(lambda g: g.index_fill(0, torch.tensor([1]), float("inf")))
    s.scale(model(batch(0)).pow(2).mean()).backward()
    handle.remove()
    assert opt.debug.step.amp.found_inf.item() == 1.0, "the optimizer's own check saw the inf"
    before = [p.detach().clone() for p in params]
    s.step(opt)
    s.update()
    assert all(p.grad is None for p in params), "released in step()"
    assert s.get_scale() == INIT_SCALE * s.get_backoff_factor()
    assert_bitwise([p.detach() for p in params], before, "the inf step changed nothing")
    assert all(int(opt.state[p]["step"]) == 0 for p in params), "and is not counted"


def test_unattached_scaler_after_early_updates_is_refused():
    """grads_final=True started the updates from scaled grads: the scaler's step() must not
    pass silently."""
    model, s = mlp(), scaler()
    opt = build(model, 1.0, "backward-attached-final", s)
    opt.grad_scaler = None  # as if built without grad_scaler=
    s.scale(model(batch(0)).pow(2).mean()).backward()
    with pytest.raises(RuntimeError, match="grad_scaler=scaler"):
        s.step(opt)
    with pytest.raises(RuntimeError, match="inconsistent"):
        opt.state_dict()


def test_grad_scaler_bad_values():
    model = mlp()
    with pytest.raises(TypeError, match="Invalid grad_scaler: float"):
        HybridAdamW(model.parameters(), grad_scaler=1.0)
    with pytest.raises(ValueError, match="grad_scaler="):
        HybridAdamW(model.parameters(), release_grads=True, overlap="step", grad_scaler=scaler())
    # release_grads with an attached scaler alone is enough (its updates start at the end)
    HybridAdamW(model.parameters(), overlap="backward", release_grads=True, grad_scaler=scaler())


def test_disabled_scaler_changes_nothing():
    """GradScaler(enabled=False) calls step() plainly: the same as no scaler."""
    ref_model, model = mlp(), mlp()
    ref = HybridAdamW(ref_model.parameters(), lr=1e-2, min_offload_numel=1)
    off = torch.amp.GradScaler("cpu", enabled=False)
    opt = HybridAdamW(model.parameters(), lr=1e-2, min_offload_numel=1, overlap="backward",
                      grads_final=True, grad_scaler=off)  # fmt: skip
    for step in range(3):
        for m, o in ((ref_model, ref), (model, opt)):
            off.scale(m(batch(step)).pow(2).mean()).backward()
            off.step(o) if o is opt else o.step()
            o.zero_grad()
    assert_bitwise(list(model.parameters()), list(ref_model.parameters()))


@pytest.mark.slow
@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_grad_scaler_with_the_delayed_update(fraction):
    """overlap="delayed" reads the scale in step(): without bad steps it trains bitwise as the
    unscaled delayed run (the default scale is a power of two); a bad step is skipped on both
    sides of the link and not counted, and the scaler backs off as with torch's optimizer."""
    ref_model, model = mlp(), mlp()
    ref = HybridAdamW(ref_model.parameters(), lr=1e-2, offload_fraction=fraction,
                      min_offload_numel=1, overlap="delayed")  # fmt: skip
    opt = HybridAdamW(model.parameters(), lr=1e-2, offload_fraction=fraction,
                      min_offload_numel=1, overlap="delayed")  # fmt: skip
    s = scaler()
    for step in range(4):
        ref_model(batch(step)).pow(2).mean().backward()
        ref.step()
        ref.zero_grad()
        s.scale(model(batch(step)).pow(2).mean()).backward()
        s.step(opt)
        s.update()
        opt.zero_grad()
    for o in (ref, opt):
        o.synchronize()
    assert_bitwise(list(model.parameters()), list(ref_model.parameters()), "delayed, scaled")
    (_, ref_scales), ref_opt = reference()
    model, s = mlp(), scaler()
    opt = HybridAdamW(model.parameters(), lr=1e-2, offload_fraction=fraction,
                      min_offload_numel=1, overlap="delayed")  # fmt: skip
    _, scales = train(model, opt, s)
    assert scales == ref_scales
    assert [int(opt.state[p]["step"]) for p in model.parameters()] == [7 - len(BAD_STEPS)] * 6


@pytest.mark.parametrize("fraction", [0.0, 1.0])
def test_a_skipped_first_sgd_step_leaves_no_momentum_buffer(fraction):
    """With dampening the first update differs from the others (buf = g): a first step the
    scaler skips must leave it for the next one, as torch's SGD that GradScaler does not step
    (a fresh user's finding; the fused kernel of torch leaves the buffer uninitialised)."""
    kw = dict(lr=0.1, momentum=0.9, dampening=0.5)
    got = {}
    for name in ("torch", "hybrid"):
        torch.manual_seed(0)
        model = torch.nn.Linear(48, 48)
        if name == "torch":
            opt = torch.optim.SGD(model.parameters(), foreach=False, **kw)
        else:
            opt = HybridSGD(
                model.parameters(), offload_fraction=fraction, min_offload_numel=1, **kw
            )
        s = torch.amp.GradScaler("cpu", init_scale=1024.0)
        for step in range(3):
            handle = None
            if step == 0:
                handle = model.weight.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf")))  # fmt: skip
            s.scale(model(batch(step)).pow(2).mean()).backward()
            if handle is not None:
                handle.remove()
            s.step(opt)
            s.update()
            opt.zero_grad()
            if step == 0:
                assert "momentum_buffer" not in opt.state.get(model.weight, {}), name
        got[name] = [p.detach().clone() for p in model.parameters()]
    assert_bitwise(got["hybrid"], got["torch"], f"SGD, dampening, fraction {fraction}")


def test_a_scaler_other_than_the_attached_one_is_refused():
    """The updates that started at the end of backward divided by the attached scaler's scale:
    a different scaler stepping the optimizer is an error, not a silent mismatch."""
    model, s, other = mlp(), scaler(), scaler()
    other.scale(torch.ones(()))
    opt = build(model, 1.0, "backward-attached", other)
    s.scale(model(batch(0)).pow(2).mean()).backward()
    with pytest.raises(RuntimeError, match="other than the attached one"):
        s.step(opt)


@pytest.mark.parametrize(
    "kw,user_clip,match",
    [(dict(max_grad_norm=1.0), False, "max_grad_norm= clipped them.*leave max_grad_norm out"),
     (dict(grads_final=True), False, r"grads_final=True\).*or leave grads_final=False"),
     (dict(attach=True), True, r"leave out scaler.unscale_\(opt\)")],
)  # fmt: skip
def test_scaler_misuse_errors_name_the_fix(kw, user_clip, match):
    model, s = mlp(), scaler()
    if kw.pop("attach", False):
        kw["grad_scaler"] = s
    opt = HybridAdamW(model.parameters(), min_offload_numel=1, overlap="backward", **kw)
    s.scale(model(batch(0)).pow(2).mean()).backward()
    if user_clip:
        s.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with pytest.raises(RuntimeError, match=match):
        s.step(opt)


@pytest.mark.parametrize("mode", ["step", "backward-attached-release", "backward-attached-module"])
def test_a_scaled_run_resumes_bitwise_from_opt_and_scaler_state(mode):
    """A checkpoint of the model, the optimizer and the scaler after step 3 (an inf step is
    among the first 3 and one after) resumes into the uninterrupted run's weights and scales."""
    model, s = mlp(), scaler()
    opt = build(model, 0.5, mode, s)
    full, scales = train(model, opt, s, steps=3)
    saved = (copy.deepcopy(model.state_dict()), opt.state_dict(), s.state_dict())
    rest = {}

    def go(model, opt, s, start):
        out = []
        for step in range(start, 7):
            bad = BAD_STEPS.get(step)
            handle = None
            if bad:
                handle = next(model.parameters()).register_hook(lambda g, v=float(bad): g.index_fill(0, torch.tensor([1]), v))  # fmt: skip
            s.scale(model(batch(step)).pow(2).mean()).backward()
            if handle is not None:
                handle.remove()
            s.step(opt)
            s.update()
            out.append(s.get_scale())
            opt.zero_grad()
        opt.synchronize()
        return [p.detach().clone() for p in model.parameters()], out

    rest["full"] = go(model, opt, s, 3)
    model2, s2 = mlp(seed=1), scaler()
    model2.load_state_dict(saved[0])
    opt2 = build(model2, 0.5, mode, s2)
    opt2.load_state_dict(saved[1])
    s2.load_state_dict(saved[2])
    rest["resumed"] = go(model2, opt2, s2, 3)
    assert_bitwise(rest["resumed"][0], rest["full"][0], f"{mode}: resumed")
    assert rest["resumed"][1] == rest["full"][1]


def test_opt_clip_grad_norm_with_an_attached_scaler_is_refused_and_changes_nothing():
    """A fresh user's finding: opt.clip_grad_norm_() took the norm of the still-scaled grads
    (an attached scaler is never unscale_'d), clipping the scale times too hard, silently."""
    model = mlp()
    sc = scaler()
    opt = HybridAdamW(model.parameters(), lr=1e-2, offload_fraction=0.5, min_offload_numel=1,
                      grad_scaler=sc)  # fmt: skip
    sc.scale(model(batch(0)).float().pow(2).mean()).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="build the optimizer with max_grad_norm= instead"):
        opt.clip_grad_norm_(1.0)
    assert opt.debug.scaling.pending_clip is None
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
    opt.close()


class WithEmpty(torch.nn.Module):
    """mlp() plus a 0-element param that the loss uses (its grad is a 0-element tensor)."""

    def __init__(self):
        super().__init__()
        self.empty = torch.nn.Parameter(torch.zeros(0, 48))
        self.body = mlp()

    def forward(self, x):
        return self.body(x) + self.empty.sum()


@pytest.mark.parametrize("fraction", [0.5, 1.0])
@pytest.mark.parametrize("mode", list(MODES))
def test_an_empty_param_with_a_grad_scaler_in_every_mode(mode, fraction):
    """A fuzz's finding: with an attached scaler in backward mode, found_inf took the inf-norm
    of every grad, and a 0-element grad made torch's _foreach_norm raise at the end of
    backward, at every later iteration too. A 0-element grad holds no inf: the run is bitwise
    torch's, inf steps skipped as there."""
    torch.manual_seed(0)
    ref_model = WithEmpty()
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, fused=True)
    ref, ref_scales = train(ref_model, ref_opt, scaler(), bad_param=1)
    torch.manual_seed(0)
    model, s = WithEmpty(), scaler()
    opt = build(model, fraction, mode, s)
    got, scales = train(model, opt, s, bad_param=1)
    assert_bitwise(got, ref, f"{mode} at {fraction}")
    assert scales == ref_scales
    assert got[0].shape == (0, 48)
