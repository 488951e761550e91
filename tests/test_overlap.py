"""overlap="backward" and wait="module" against step mode, bitwise (CPU stands in for the GPU):
grads announced by hooks, clipping through the optimizer, accumulation, waits, failures."""

import contextlib
import signal
import threading
import time

import pytest
import torch
from oracle import FRACTIONS, assert_bitwise

from offloadopt import HybridAdamW
from offloadopt.link.transfer import SLOTS
from offloadopt.step.step import Phase

MODES = {
    "step": dict(overlap="step"),
    "backward": dict(overlap="backward", grads_final=True),
    "backward-release": dict(overlap="backward", grads_final=True, release_grads=True),
    "backward-module": dict(overlap="backward", grads_final=True, wait="module"),
}


def mlp(seed=0, dtype=torch.float32, unused=False):
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(48, 48) for _ in range(4)]
    model = torch.nn.Sequential(*layers[:3], torch.nn.Tanh(), layers[3]).to(dtype)
    if unused:
        model.register_parameter("unused", torch.nn.Parameter(torch.randn(300, dtype=dtype)))
    return model


def make_opt(model, fraction, **kw):
    opt = HybridAdamW(model.parameters(), lr=1e-2, offload_fraction=fraction,
                      min_offload_numel=1, bucket_nbytes=4 * 1000, **kw)  # fmt: skip
    if kw.get("wait") == "module":
        opt.watch(model)
    return opt


def batch(step, micro=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(100 * step + micro)
    return torch.randn(8, 48, generator=g).to(dtype)


def train(model, opt, steps=4, micro_steps=1, clip=None, dtype=torch.float32, outputs=None):
    for step in range(steps):
        for micro in range(micro_steps):
            x = batch(step, micro, dtype)
            out = model(x)
            if outputs is not None:
                outputs.append(out.detach().clone())
            loss = out.float().pow(2).mean() * (1 + micro)  # uneven micro-steps
            if micro < micro_steps - 1:
                with opt.accumulating():
                    loss.backward()
            else:
                loss.backward()
        if clip == "torch":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
        elif clip == "method":
            opt.clip_grad_norm_(0.01)
        opt.step()
        opt.zero_grad()
    getattr(opt, "synchronize", lambda: None)()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("fraction", FRACTIONS)
@pytest.mark.parametrize("mode", [m for m in MODES if m != "step"])
def test_backward_modes_equal_step_mode_bitwise(mode, fraction):
    ref_model, model = mlp(), mlp()
    ref_outs, outs = [], []
    ref = train(ref_model, make_opt(ref_model, fraction), outputs=ref_outs)
    opt = make_opt(model, fraction, **MODES[mode])
    assert len(opt.buckets) > 2 or fraction < 1
    got = train(model, opt, outputs=outs)
    assert_bitwise(got, ref, mode)
    assert_bitwise(outs, ref_outs, f"{mode}: every forward saw the new weights")


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_release_grads_frees_offloaded_grads_during_backward(fraction):
    model = mlp()
    opt = make_opt(model, fraction, **MODES["backward-release"])
    model(batch(0)).pow(2).mean().backward()
    opt.step()  # the grads of offloaded params went as soon as their copy landed
    for p in model.parameters():
        assert (p.grad is None) == opt.is_offloaded(p)


@pytest.mark.parametrize("fraction", FRACTIONS)
@pytest.mark.parametrize("overlap", ["step", "backward"])
def test_clipping_through_the_optimizer_equals_torchs_clip_for_fp32(overlap, fraction):
    """fp32: the same norm (per-param fp32 norms, then their norm) and the same coefficient
    multiplied into the fp32 grads: bitwise torch's clip_grad_norm_ + fused AdamW."""
    ref_model = mlp()
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, fused=True)
    ref = train(ref_model, ref_opt, clip="torch")
    model = mlp()
    opt = make_opt(model, fraction, overlap=overlap, max_grad_norm=0.01)
    got = train(model, opt)
    assert_bitwise(got, ref, "max_grad_norm")
    assert opt.last_grad_norm is not None and opt.last_grad_norm > 0.01  # it really clipped
    model = mlp()
    got = train(model, make_opt(model, fraction), clip="method")
    assert_bitwise(got, ref, "clip_grad_norm_")


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_bf16_clipping_is_the_same_in_both_modes_and_near_torchs(fraction):
    kw = dict(dtype=torch.bfloat16)
    step_mode = train(m := mlp(**kw), make_opt(m, fraction, max_grad_norm=0.01), **kw)
    backward = train(m := mlp(**kw), make_opt(m, fraction, overlap="backward", max_grad_norm=0.01), **kw)  # fmt: skip
    assert_bitwise(backward, step_mode, "bf16, optimizer clipping in both modes")
    ref_model = mlp(**kw)
    masters = [torch.nn.Parameter(p.detach().float()) for p in ref_model.parameters()]
    torch_opt = torch.optim.AdamW(masters, lr=1e-2, fused=True)
    for step in range(4):
        ref_model(batch(step, dtype=torch.bfloat16)).float().pow(2).mean().backward()
        torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.01)  # bf16 grads, as torch does
        for m, p in zip(masters, ref_model.parameters(), strict=True):
            m.grad = p.grad.float()
        torch_opt.step()
        ref_model.zero_grad()
        with torch.no_grad():
            for m, p in zip(masters, ref_model.parameters(), strict=True):
                p.copy_(m)
    # torch multiplies the bf16 grads by the coefficient (rounding each to bf16); we multiply
    # the fp32 upcast: after 4 steps at lr 1e-2 the weights differ by at most one bf16 ulp
    # of the update, measured here as <= 2 ** -7 (bf16's relative precision).
    for a, b in zip(step_mode, ref_model.parameters(), strict=True):
        torch.testing.assert_close(a.float(), b.detach().float(), rtol=2**-7, atol=2**-7)


@pytest.mark.parametrize("micro_steps", [1, 2, 4])
@pytest.mark.parametrize("fraction", FRACTIONS)
def test_accumulation_with_the_marker_equals_step_mode(micro_steps, fraction):
    ref = train(m := mlp(unused=True), make_opt(m, fraction), micro_steps=micro_steps)
    for mode in ("backward", "backward-module"):
        model = mlp(unused=True)
        got = train(model, make_opt(model, fraction, **MODES[mode]), micro_steps=micro_steps)
        assert_bitwise(got, ref, f"{mode}, {micro_steps} micro-steps")


def test_clip_at_the_end_of_backward_with_accumulation():
    ref = train(m := mlp(), make_opt(m, 1.0, max_grad_norm=0.01), micro_steps=3)
    got = train(m := mlp(), make_opt(m, 1.0, overlap="backward", max_grad_norm=0.01), micro_steps=3)
    assert_bitwise(got, ref, "clipped, accumulated")


def test_a_second_backward_without_the_marker_is_an_error_and_the_optimizer_refuses():
    model = mlp()
    opt = make_opt(model, 1.0, **MODES["backward"])
    model(batch(0)).pow(2).mean().backward()
    # The worker writes the updated weights into the params: let it finish, or the second
    # forward may save a param it then writes, and autograd's in-place check fires before our
    # first grad hook can (seen once in a CI replica).
    run = opt.debug.step.run
    for work in list(run.fed):
        run.wait_h2d_queued(work.bucket, 60)
    with pytest.raises(RuntimeError, match=r"a backward came before step.*opt.accumulating\(\)"):
        model(batch(1)).pow(2).mean().backward()
    with pytest.raises(RuntimeError, match="inconsistent.*discard_failed_step"):
        opt.step()
    with pytest.raises(RuntimeError, match="inconsistent"):
        opt.state_dict()
    opt.discard_failed_step()
    opt.zero_grad()
    model(batch(2)).pow(2).mean().backward()
    opt.step()


class FailInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("backward failed here")


def test_a_backward_that_fails_after_updates_started_leaves_the_optimizer_refusing():
    model = mlp()
    opt = make_opt(model, 1.0, **MODES["backward"])
    ref_model = mlp()
    x = FailInBackward.apply(model[0](batch(0)))  # fails after the later layers' buckets ran
    with pytest.raises(RuntimeError, match="backward failed here"):
        model[1:](x).pow(2).mean().backward()
    first = next(iter(opt.debug.step.fed))
    opt.debug.step.run.wait_h2d_queued(first, 10)  # that bucket's update ran
    pairs = zip(model.parameters(), ref_model.parameters(), strict=True)
    assert any(not torch.equal(p, q) for p, q in pairs)
    with pytest.raises(
        RuntimeError, match="inconsistent: a backward that announced grads never finished"
    ):
        opt.step()
    opt.discard_failed_step()


def test_a_grad_edited_after_its_update_started_is_named():
    model = mlp()
    opt = make_opt(model, 1.0, **MODES["backward"])
    model(batch(0)).pow(2).mean().backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)  # edits grads already used
    with pytest.raises(
        RuntimeError, match=r"the grad of group0.param\d changed after its bucket's update"
    ):
        opt.step()


def test_a_grad_whose_data_was_replaced_after_its_update_started_is_named():
    """A user's trial: ``w.grad.data = torch.zeros(3, 3)`` after backward (a new shape, the
    same grad object and version) passed step() without a word."""
    model = mlp()
    opt = make_opt(model, 1.0, **MODES["backward"])
    model(batch(0)).pow(2).mean().backward()
    w = model[0].weight
    w.grad.data = torch.zeros(3, 3)
    with pytest.raises(
        RuntimeError, match=r"the grad of group0.param0 changed after its bucket's update"
    ):
        opt.step()


def test_without_declarations_backward_mode_waits_for_step_and_sees_torchs_clip():
    ref_model = mlp()
    ref = train(
        ref_model, torch.optim.AdamW(ref_model.parameters(), lr=1e-2, fused=True), clip="torch"
    )
    model = mlp()
    opt = make_opt(model, 1.0, overlap="backward")  # may be edited: nothing starts early
    assert not opt.debug.grad_hooks
    assert_bitwise(train(model, opt, clip="torch"), ref, "torch's clip, updates at step()")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["step", "backward", "backward-module"])
def test_ema_and_state_dict_right_after_step_see_the_new_weights_with_a_slow_worker(mode):
    model = mlp()
    opt = make_opt(model, 1.0, **MODES[mode])
    opt.debug.pipeline.worker_hook = lambda bucket: time.sleep(0.02)
    ema = torch.optim.swa_utils.AveragedModel(model)
    ref_model = mlp()
    ref = make_opt(ref_model, 1.0)
    for step in range(2):
        for m, o in ((model, opt), (ref_model, ref)):
            m(batch(step)).pow(2).mean().backward()
            o.step()
            o.zero_grad()
        sd = model.state_dict()  # wait="module": watch() made this wait for the copies back
        assert_bitwise(list(sd.values()), list(ref_model.state_dict().values()), "state_dict")
        if mode != "backward-module":  # wait="module": anything else calls opt.synchronize()
            ema.update_parameters(model)
            assert_bitwise(list(model.parameters()), list(ref_model.parameters()), "params")


def test_resume_from_a_backward_mode_checkpoint_is_bitwise():
    ref = train(m := mlp(), make_opt(m, 0.5, **MODES["backward-module"]), steps=6)
    model = mlp()
    opt = make_opt(model, 0.5, **MODES["backward-module"])
    train(model, opt, steps=3)
    sd, weights = opt.state_dict(), model.state_dict()
    fresh = mlp(seed=7)
    fresh.load_state_dict(weights)
    opt2 = make_opt(fresh, 0.5, **MODES["backward-module"])
    opt2.load_state_dict(sd)
    for step in range(3, 6):
        fresh(batch(step)).pow(2).mean().backward()
        opt2.step()
        opt2.zero_grad()
    opt2.synchronize()
    assert_bitwise(list(fresh.parameters()), ref, "resumed")


@pytest.mark.parametrize(
    "kw,match",
    [(dict(overlap="forward"), "Invalid overlap: 'forward'"),
     (dict(wait="layer"), "Invalid wait: 'layer'"),
     (dict(max_grad_norm=0.0), "Invalid max_grad_norm: 0.0"),
     (dict(release_grads=True), "release_grads=True .* needs overlap='backward'"),
     (dict(overlap="backward", release_grads=True), "needs overlap='backward' and grads_final")],
)  # fmt: skip
def test_bad_mode_options_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        HybridAdamW(mlp().parameters(), **kw)


def test_close_removes_the_hooks():
    model = mlp()
    opt = make_opt(model, 1.0, **MODES["backward-module"])
    assert opt.debug.grad_hooks and opt.debug.publisher.module_waits
    opt.close()
    assert not opt.debug.grad_hooks and not opt.debug.publisher.module_waits
    model(batch(0)).pow(2).mean().backward()  # no hook of a closed optimizer runs
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize(
    "kw", [dict(grads_final=True), dict(max_grad_norm=0.01)], ids=["grads_final", "clipped"]
)
def test_in_backward_mode_every_bucket_is_fed_by_the_end_of_backward(kw):
    model = mlp()
    opt = make_opt(model, 1.0, overlap="backward", **kw)
    model(batch(0)).pow(2).mean().backward()
    assert opt.debug.step is not None and opt.debug.step.phase is Phase.BACKWARD_DONE
    assert set(opt.debug.step.fed) == set(opt.buckets)  # all started before step()
    opt.step()
    assert opt.debug.step is None and opt.stats["buckets"] == len(opt.buckets)


def test_a_no_op_torch_clip_after_backward_is_not_an_edit():
    """transformers' Trainer calls clip_grad_norm_(params, inf) to log the norm: it multiplies
    every grad by 1.0 in place. The values are unchanged, so the step goes on (and equals step
    mode); a clip that changes them is still an error."""
    ref = train(m := mlp(), make_opt(m, 1.0, max_grad_norm=0.01))
    model = mlp()
    opt = make_opt(model, 1.0, overlap="backward", max_grad_norm=0.01)
    for step in range(4):
        model(batch(step)).pow(2).mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))  # only logs the norm
        opt.step()
        opt.zero_grad()
    assert_bitwise([p.detach() for p in model.parameters()], ref, "after no-op clips")
    model(batch(9)).pow(2).mean().backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-4)
    with pytest.raises(RuntimeError, match="changed after its bucket's update"):
        opt.step()


def test_a_submodules_state_dict_waits_for_the_copies_back():
    ref_model, model = mlp(), mlp()
    ref_opt = make_opt(ref_model, 1.0)
    opt = make_opt(model, 1.0, **MODES["backward-module"])
    opt.debug.pipeline.worker_hook = lambda bucket: time.sleep(0.02)
    for m, o in ((ref_model, ref_opt), (model, opt)):
        m(batch(0)).pow(2).mean().backward()
        o.step()
    sub = model[0].state_dict()  # a part of the watched model (model.module, model.backbone)
    assert_bitwise(list(sub.values()), list(ref_model[0].state_dict().values()), "submodule")


def test_closed_optimizer_refuses_to_step_at_any_fraction():
    model = mlp()
    opt = make_opt(model, 0.0)
    opt.close()
    model(batch(0)).pow(2).mean().backward()
    with pytest.raises(RuntimeError, match="is closed"):
        opt.step()


@pytest.fixture
def fresh_dynamo():
    """A process where torch.compile has compiled nothing yet, as far as the optimizer can
    tell (hooks.dynamo_compiled_any reads dynamo's counters; other tests compile): the caches
    and the counters cleared before and after."""
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()


def test_a_watched_model_compiled_after_another_instance_waits_in_step(fresh_dynamo):
    """A user's find: with another instance of the model's class compiled first (a compiled
    eval copy, a reference run), dynamo reused that instance's graph, traced without the
    waits, for the watched model's compiled forward: no pre-hook ran, nothing set
    ``compiled.seen``, and wait="module" let the next forward read weights being copied back
    (wrong losses, then an in-place error in backward). Any compile in the process now makes
    step() wait for every copy back; training is step mode's, bitwise."""
    ref_model, model, other = mlp(), mlp(), mlp()
    ref = train(ref_model, make_opt(ref_model, 1.0))
    torch.compile(other, backend="eager")(batch(0))  # another instance, compiled first
    opt = HybridAdamW(model.parameters(), lr=1e-2, offload_fraction=1.0, min_offload_numel=1,
                      bucket_nbytes=4 * 1000, wait="module")  # fmt: skip
    opt.watch(model)  # before the compile, as the docs ask
    opt.debug.pipeline.worker_hook = lambda bucket: time.sleep(0.005)  # copies still in flight
    run = torch.compile(model, backend="eager")
    for step in range(4):
        run(batch(step)).float().pow(2).mean().backward()
        opt.step()
        assert opt.debug.publisher.compiled_region() and opt.debug.inflight is None
        opt.zero_grad()
    assert_bitwise([p.detach() for p in model.parameters()], ref, "another instance first")
    opt.close()


@pytest.mark.parametrize("how", ["compiled-then-watched", "watched-then-compiled", "in-place"])
def test_a_compiled_model_traces_whole_and_step_waits_once(how, fresh_dynamo):
    """Under torch.compile (fullgraph=True: no graph break) the per-module waits trace as
    nothing; step() then waits for every copy back before it returns (wait="module" eager
    returns with them in flight), and training is step mode's, bitwise."""
    ref_model, model = mlp(), mlp()
    ref = train(ref_model, make_opt(ref_model, 1.0))
    opt = HybridAdamW(model.parameters(), lr=1e-2, offload_fraction=1.0, min_offload_numel=1,
                      bucket_nbytes=4 * 1000, overlap="backward", grads_final=True,
                      wait="module")  # fmt: skip
    kw = dict(backend="eager", fullgraph=True)
    if how == "compiled-then-watched":
        run = torch.compile(model, **kw)
        opt.watch(run)
        assert opt.debug.publisher.compiled_region()  # seen at watch(): the wrapper
    else:
        opt.watch(model)
        assert not opt.debug.publisher.compiled_region()
        run = torch.compile(model, **kw) if how == "watched-then-compiled" else model
        if how == "in-place":
            model.compile(**kw)
    for step in range(4):
        run(batch(step)).float().pow(2).mean().backward()
        opt.step()
        assert opt.debug.publisher.compiled_region() and opt.debug.inflight is None, (
            "one full wait in step()"
        )
        opt.zero_grad()
    assert_bitwise([p.detach() for p in model.parameters()], ref, how)
    opt.close()


def test_an_eager_watched_model_keeps_its_copies_in_flight_after_step(fresh_dynamo):
    """The other side of the compiled case: eager, step() returns before the copies back."""
    model = mlp()
    opt = make_opt(model, 1.0, overlap="backward", grads_final=True, wait="module")
    opt.debug.pipeline.worker_hook = lambda bucket: time.sleep(0.01)
    model(batch(0)).pow(2).mean().backward()
    opt.step()
    assert not opt.debug.publisher.compiled_region() and opt.debug.inflight is not None
    opt.synchronize()
    opt.close()


def test_a_model_compiled_and_run_before_watch_is_caught_after_one_step(monkeypatch):
    """torch.compile ignores hooks added after a region first ran compiled, so watch() after
    that adds waits that never run (a fresh user's finding). The next step sees that no watched
    module waited, warns, and from then on step() waits for every copy back. (Any compile in
    the process now makes step() wait from the first step, hooks.dynamo_compiled_any: this is
    the check behind it, for a compile the counters would not show.)"""
    from offloadopt.step import publish

    monkeypatch.setattr(publish, "dynamo_compiled_any", lambda: False)
    model = mlp()
    opt = HybridAdamW(model.parameters(), lr=1e-2, offload_fraction=1.0, min_offload_numel=1,
                      bucket_nbytes=4 * 1000, wait="module")  # fmt: skip
    run = torch.compile(model, backend="eager", fullgraph=True)
    run(batch(0))  # a warm-up forward, compiled, before watch()
    opt.watch(model)
    assert not opt.debug.publisher.compiled_region()
    run(batch(1)).pow(2).mean().backward()
    opt.step()
    assert opt.debug.inflight is not None  # nothing known yet: the copies are in flight
    # Let the worker finish its writes (without a wait that counts as one), so the unwaited
    # forward below does not race them here: the race is what the detection is for, and
    # autograd's in-place check could fire first (seen once in a CI replica).
    opt.debug.inflight.run.wait(60)
    opt.zero_grad()
    run(batch(2)).pow(2).mean().backward()
    with pytest.warns(UserWarning, match="no module watched with opt.watch"):
        opt.step()
    assert opt.debug.publisher.compiled_region() and opt.debug.inflight is None
    opt.close()


def test_queued_buckets_are_updated_in_the_order_the_next_forward_reads_them():
    """In backward mode the last layers' grads arrive first; of the buckets queued when the
    worker takes its next one, it takes the one the next forward reads first (the highest
    index), so with wait="module" the forward's first modules wait least. The worker is held
    at its first bucket until backward has fed them all (pipeline.StepRun)."""
    model = mlp()
    opt = make_opt(model, 1.0, **MODES["backward-module"])
    assert len(opt.buckets) >= 4
    order, fed_all = [], threading.Event()

    def hook(bucket):
        order.append(bucket.index)
        if len(order) == 1:
            assert fed_all.wait(10.0), "backward never fed the other buckets"

    opt.debug.pipeline.worker_hook = hook
    published = []
    transfer = next(iter(opt.debug.pipeline.transfers.values()))
    transfer.publish = lambda stream, buckets: published.append([b.index for b in buckets])
    model(batch(0)).pow(2).mean().backward()
    fed_all.set()  # every bucket was fed by the grad hooks during that backward
    opt.step()
    opt.synchronize()
    n = len(opt.buckets)
    # The worker had taken at most SLOTS buckets (each holds a staging slot) before backward
    # had fed them all (on this CPU, often none yet); every one it took after that ran from
    # the highest index down (FIFO would run them upwards, in the order backward fed them).
    rest = order[SLOTS:]
    assert sorted(order) == list(range(n)), order
    assert len(rest) >= 3 and rest == sorted(rest, reverse=True), order
    # The consumer stream waits on the event of the H2D queued last, which covers the others
    # (one H2D stream runs them in order): the last one updated, not the last one fed.
    assert published == [order], (published, order)


class Branchy(torch.nn.Module):
    """``side`` is used only when asked: by the accumulation micro-steps, not the final one."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.a, self.side, self.b = (torch.nn.Linear(48, 48) for _ in range(3))

    def forward(self, x, use_side):
        h = self.a(x) + (self.side(x) if use_side else 0)
        return self.b(torch.tanh(h)).pow(2).mean()


def train_branchy(opt_of, side_in_final: bool, set_to_none=True, steps=3):
    """Two micro-steps a step; ``side`` is in the first only (or in neither when
    ``side_in_final`` is False and set_to_none=False: its grad stays a zero tensor)."""
    model = Branchy()
    opt = opt_of(model)
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        xs = [torch.randn(8, 48, generator=g) for _ in range(2)]
        if side_in_final:  # accumulation: side's grad comes only from the marked micro-step
            with getattr(opt, "accumulating", contextlib.nullcontext)():
                model(xs[0], True).backward()
            model(xs[1], False).backward()
        else:  # no accumulation: side gets no grad, and keeps the zero one zero_grad left
            model(xs[1], step == 0).backward()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
    getattr(opt, "synchronize", lambda: None)()
    return [p.detach().clone() for p in model.parameters()]


DECLARED = {
    "grads_final": dict(overlap="backward", grads_final=True),
    "max_grad_norm": dict(overlap="backward", max_grad_norm=1e9),  # a coefficient of 1
    "release": dict(overlap="backward", grads_final=True, release_grads=True),
    "module": dict(overlap="backward", grads_final=True, wait="module"),
}


@pytest.mark.parametrize("fraction", [0.5, 1.0])
@pytest.mark.parametrize("mode", list(DECLARED))
@pytest.mark.parametrize("case", ["accumulated-only", "zero-grad-kept"])
def test_grads_no_hook_announced_are_updated_at_backward_end(case, mode, fraction):
    """A fresh user's finding: in declared backward mode a grad whose hook did not fire in the
    final backward was never updated, silently: one accumulated only under accumulating(), or
    the zero grad that zero_grad(set_to_none=False) leaves on a param the backward does not
    reach (torch updates it: weight decay and the moments). With small buckets ``side``'s
    weight was split, and part of it updated while its state said otherwise."""
    if mode == "release" and case == "zero-grad-kept":
        pytest.skip("grad release sets grads to None: no zero grad is left to keep")
    side_in_final, set_to_none = case == "accumulated-only", case == "accumulated-only"

    def torch_adamw(model):
        return torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)

    ref = train_branchy(torch_adamw, side_in_final, set_to_none)
    for kw in (dict(), DECLARED[mode]):
        got = train_branchy(
            lambda m, kw=kw: make_opt(m, fraction, **kw), side_in_final, set_to_none
        )
        assert_bitwise(got, ref, f"{kw or 'step mode'}")


def test_a_grad_set_after_its_bucket_started_is_named():
    """A grad set by hand after backward, on a param whose bucket's update started without it
    (it shares a bucket with the layer that got grads): an error naming it, not a skip."""
    model = mlp()
    opt = make_opt(model, 1.0, **MODES["backward"])
    model[4](batch(0)).pow(2).mean().backward()  # only the last layer gets grads
    late = [p for p in model.parameters() if p.grad is None
            and any(b in opt.debug.step.fed for b in opt.debug.records[p].buckets)]  # fmt: skip
    assert late, "no param without a grad shares a fed bucket at this bucket size"
    late[0].grad = torch.ones_like(late[0])  # by hand, after its bucket's update started
    name = opt.debug.records[late[0]].name
    with pytest.raises(RuntimeError, match=rf"grad of {name} was set after its bucket's update"):
        opt.step()
    with pytest.raises(RuntimeError, match="inconsistent"):
        opt.step()
    opt.discard_failed_step()


def test_an_interrupt_in_a_grad_hook_leaves_no_half_fed_step(monkeypatch, ctrl_c_raises):
    """A fresh user's finding: Ctrl-C landing in a grad hook while it queued a bucket (on the
    CPU the hook runs on the main thread, where Python raises KeyboardInterrupt) left a step
    begun with nothing queued; the next backward was accepted, and step() then waited for
    that step until timeout_s. Now the hook queues its buckets whole and the interrupt
    arrives after: the interrupted step is refused at once, and discarding it goes on."""
    from offloadopt.link.layout import Bucket

    model = mlp()
    opt = make_opt(model, 1.0, **MODES["backward"], timeout_s=5.0)
    views, calls = Bucket.grad_views, []

    def interrupted(self, idx):
        calls.append(self.index)
        if len(calls) == 1:  # the first bucket the hooks queue
            signal.raise_signal(signal.SIGINT)  # the handler runs at the next bytecode
        return views(self, idx)

    monkeypatch.setattr(Bucket, "grad_views", interrupted)
    with pytest.raises(KeyboardInterrupt):
        model(batch(0)).pow(2).mean().backward()
    monkeypatch.setattr(Bucket, "grad_views", views)
    # The worker goes on with the buckets queued before the interrupt, writing their weights in
    # place (the CPU stands in for the device): let them land, or the next forward reads
    # weights mid-write and autograd, not the optimizer, refuses its backward (seen on torch
    # 2.15 under load: "modified by an inplace operation").
    run, deadline = opt.debug.step.run, time.monotonic() + 5.0
    while len(run.h2d_queued) < len(run.fed) and time.monotonic() < deadline:
        time.sleep(0.005)
    t = time.perf_counter()
    with pytest.raises(RuntimeError, match="another one started|inconsistent"):
        model(batch(1)).pow(2).mean().backward()
        opt.step()
    assert time.perf_counter() - t < 4.0, "it waited for the interrupted step"
    opt.discard_failed_step()
    opt.zero_grad()
    model(batch(2)).pow(2).mean().backward()
    opt.step()  # the worker serves this step: nothing left open holds it back
    opt.close()


@pytest.mark.parametrize("how", ["watch", "synchronize"])
@pytest.mark.parametrize("declared", ["grads_final", "max_grad_norm"])
def test_a_read_between_backward_and_step_sees_whole_new_weights(declared, how):
    """A fresh user's finding: declared updates start during or at the end of backward and the
    worker writes the params until step(); an evaluation forward in between read weights being
    written (five losses in 15 identical runs). A watched model's forward, or any read after
    opt.synchronize(), now waits for the updates started, and sees their new weights (every
    param is offloaded here: step mode's weights after step()). state_dict() there is
    refused: some params hold the step's update, others not yet."""
    kw = DECLARED[declared]
    clip = {"max_grad_norm": kw["max_grad_norm"]} if declared == "max_grad_norm" else {}
    ref_model, model = mlp(), mlp()
    ref = make_opt(ref_model, 1.0, **clip)
    opt = make_opt(model, 1.0, **kw)
    if how == "watch":
        opt.watch(model)
    opt.debug.pipeline.worker_hook = lambda bucket: time.sleep(0.005)
    for step in range(3):
        ref_model(batch(step)).pow(2).mean().backward()
        ref.step()
        ref.zero_grad()
        model(batch(step)).pow(2).mean().backward()
        if how == "synchronize":
            opt.synchronize()
        with torch.no_grad():
            got, want = model(batch(9)), ref_model(batch(9))
        assert_bitwise([got], [want], f"eval forward between backward and step {step}")
        with pytest.raises(RuntimeError, match=r"state_dict\(\) between backward and step"):
            opt.state_dict()
        opt.step()
        opt.zero_grad()
    assert_bitwise(list(model.parameters()), list(ref_model.parameters()), "after the steps")
    opt.state_dict()  # after step(): a checkpoint


@pytest.mark.slow
def test_a_watched_second_backward_before_step_is_refused_by_the_optimizer():
    """With the model watched the second forward waits for the first backward's updates, so
    autograd's in-place check cannot fire first (the fresh user saw it in 8 of 20 runs with
    max_grad_norm, and the optimizer then did not refuse step()). Here the worker is held at
    its first bucket for up to 1 s: an unwaited second forward saves params the worker then
    writes, which autograd's check catches before any grad hook; a waited one cannot."""
    model = mlp()
    opt = make_opt(model, 1.0, overlap="backward", max_grad_norm=1e9)
    opt.watch(model)
    held, taken = threading.Event(), []

    def hook(bucket):
        taken.append(bucket)
        if len(taken) == 1:
            held.wait(1.0)

    opt.debug.pipeline.worker_hook = hook
    model(batch(0)).pow(2).mean().backward()  # the clipped updates start as it ends
    loss = model(batch(1)).pow(2).mean()  # waits (watched) for the H2Ds; the worker goes on
    held.set()
    run = opt.debug.step.run
    for work in list(run.fed):  # every write into the params is done before backward
        run.wait_h2d_queued(work.bucket, 60)
    with pytest.raises(RuntimeError, match="a backward came before step"):
        loss.backward()
    with pytest.raises(RuntimeError, match="inconsistent"):
        opt.step()
    opt.discard_failed_step()


@pytest.mark.parametrize("overlap", ["step", "backward"])
def test_torchs_attention_modules_wait_for_the_params_they_read(overlap):
    """A fresh user's finding: torch's MultiheadAttention reads out_proj's params without
    calling out_proj (and TransformerEncoderLayer's eval fast path reads every child's), so
    out_proj's own pre-hook never ran and, with wait="module", the forward after step() read
    weights still being written (autograd's in-place error, or another result than torch's).
    Those modules now wait for their whole subtree."""

    def build():
        torch.manual_seed(0)
        layer = torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
        return torch.nn.Sequential(torch.nn.Linear(64, 64), layer)

    def run(model, opt):
        evals = []
        for step in range(4):
            x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(step))
            model.train()
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            model.eval()  # the encoder layer's fast path
            with torch.no_grad():
                evals.append(model(x))
        getattr(opt, "synchronize", lambda: None)()
        return [*model.parameters(), *evals]

    ref = run(m := build(), torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True))
    model = build()
    kw = dict(overlap="backward", grads_final=True) if overlap == "backward" else {}
    opt = make_opt(model, 1.0, wait="module", **kw)
    opt.debug.pipeline.worker_hook = lambda bucket: time.sleep(0.002)
    assert_bitwise([t.detach() for t in run(model, opt)], [t.detach() for t in ref], overlap)


@pytest.mark.parametrize("how", ["model.zero_grad", "grad.zero_"])
def test_a_grad_zeroed_in_place_while_its_copy_is_pending_is_an_error(how):
    """A fresh user's finding: with wait="module" step() returns before the copies have read
    the grads; model.zero_grad(set_to_none=False) (or p.grad.zero_()) right after it zeroed
    grads the worker had not copied yet, and the update silently used zeros. The step now ends
    with an error naming the params; opt.zero_grad(set_to_none=False) waits first and is fine."""
    model = mlp()
    opt = make_opt(model, 1.0, wait="module")
    opt.debug.pipeline.worker_hook = lambda bucket: time.sleep(
        0.003
    )  # the copies are still pending
    model(batch(0)).pow(2).mean().backward()
    opt.step()
    if how == "model.zero_grad":
        model.zero_grad(set_to_none=False)
    else:
        for p in model.parameters():
            p.grad.zero_()
    with pytest.raises(
        RuntimeError, match=r"grads of \d+ params \(group0.param\d.*changed in place"
    ):
        model(batch(1))  # the watched forward ends the step
    with pytest.raises(RuntimeError, match="inconsistent"):
        opt.state_dict()
    opt.discard_failed_step()


def test_opt_zero_grad_in_place_after_a_module_wait_step_equals_torch():
    ref = train(m := mlp(), torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True))
    model = mlp()
    opt = make_opt(model, 1.0, wait="module")
    opt.debug.pipeline.worker_hook = lambda bucket: time.sleep(0.003)
    for step in range(4):
        model(batch(step)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)  # waits for the copies, then zeroes
    opt.synchronize()
    assert_bitwise([p.detach() for p in model.parameters()], ref, "opt.zero_grad in place")


def test_an_lr_set_between_backward_and_step_after_updates_started_is_reported():
    """A fresh user's finding: declared backward mode freezes a step's values at its first
    update, during backward, so an lr set after backward applied a step late, silently. The
    step now warns (once) and says which value it used; set before backward, it is torch's."""
    model = mlp()
    opt = make_opt(model, 1.0, **MODES["backward"])
    model(batch(0)).pow(2).mean().backward()
    opt.param_groups[0]["lr"] = 0.0
    with pytest.warns(UserWarning, match=r"group 0's lr changed from 0.01 to 0.0 after this step"):
        opt.step()
    opt.zero_grad()
    ref = train(m := mlp(), torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True), steps=1)
    assert_bitwise([p.detach() for p in model.parameters()], ref, "the step used the old lr")


def test_a_load_between_backward_and_step_after_updates_started_is_refused_unchanged():
    """A fresh user's finding: load_state_dict() between a declared backward and step() was
    taken, the updated params kept their new weights, and step() matched neither run. It is
    refused (state_dict() is too) with nothing changed; after step() it loads."""
    model = mlp()
    opt = make_opt(model, 1.0, **MODES["backward"])
    train(model, opt, steps=1)
    saved = opt.state_dict()
    model(batch(1)).pow(2).mean().backward()
    assert opt.debug.step is not None and opt.debug.step.fed
    with pytest.raises(RuntimeError, match=r"load_state_dict\(\) between backward and step"):
        opt.load_state_dict(saved)
    opt.step()  # the step goes on, as if no load was tried
    opt.zero_grad()
    ref = train(m := mlp(), torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True), steps=2)
    assert_bitwise(
        [p.detach() for p in model.parameters()], ref, "the refused load changed nothing"
    )
    opt.load_state_dict(saved)  # between steps: taken


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward sleeps: the grads before it in backward order are announced
    ``delay_s`` before those after it."""

    @staticmethod
    def forward(ctx, x, delay_s):
        ctx.delay_s = delay_s
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.delay_s)
        return grad, None


def test_stats_split_the_worker_time_into_kernel_launches_and_feed_waits():
    """opt.stats: ``feed_wait_ms`` is the worker's wait for buckets backward has not announced
    yet (here a 0.2 s pause inside backward, between the last layer's bucket and the first's),
    ``launch_ms`` its time queuing copies; step mode feeds every bucket at once."""
    torch.manual_seed(0)
    first, last = torch.nn.Linear(48, 48), torch.nn.Linear(48, 48)
    params = list(first.parameters()) + list(last.parameters())
    for overlap, kw in (("backward", dict(grads_final=True)), ("step", {})):
        opt = HybridAdamW(params, lr=1e-2, min_offload_numel=1, bucket_nbytes=4 * 48 * 48,
                          overlap=overlap, **kw)  # fmt: skip
        x = torch.randn(8, 48)
        last(_SlowBackward.apply(first(x), 0.2)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        s = opt.stats
        assert s["buckets"] >= 2 and s["launch_ms"] >= 0.0
        if overlap == "backward":
            assert 150.0 <= s["feed_wait_ms"] <= s["worker_ms"], s
        else:
            assert s["feed_wait_ms"] < 100.0, s
        assert s["cpu_update_ms"] + s["feed_wait_ms"] <= s["worker_ms"] + 1.0
        opt.close()


@pytest.mark.parametrize(
    "kw",
    [dict(overlap="delayed"), dict(overlap="backward", grads_final=True, wait="module")],
    ids=["delayed", "backward-module"],
)
@pytest.mark.slow
def test_stats_step_ms_is_the_time_inside_step_when_the_step_ends_later(kw):
    """Found by a fresh user: with overlap="delayed" or wait="module" the step completes at the
    next step() or synchronize(), and step_ms counted the caller's time in between (0.3 s of
    sleep here) instead of step()'s own."""
    model = mlp()
    opt = make_opt(model, 1.0, **kw)
    for step in range(3):
        model(batch(step)).pow(2).mean().backward()
        t = time.perf_counter()
        opt.step()
        inside = (time.perf_counter() - t) * 1e3
        opt.zero_grad()
        time.sleep(0.3)  # the next forward and backward, as far as step() can tell
        if step:
            assert opt.stats["step_ms"] < 150.0, opt.stats  # the step before: its step() alone
    opt.synchronize()
    assert opt.stats["step_ms"] <= inside + 1.0
    opt.close()


def test_stats_keys_exist_when_nothing_was_offloaded():
    """Found by a fresh user: at fraction 0 opt.stats had no ``buckets`` or ``worker_ms``."""
    model = mlp()
    opt = make_opt(model, 0.0)
    model(batch(0)).pow(2).mean().backward()
    opt.step()
    assert opt.stats["buckets"] == 0 and opt.stats["worker_ms"] == 0.0
    opt.close()


@pytest.mark.parametrize("mode", ["step", "backward", "delayed"])
def test_stats_count_no_link_bytes_without_cuda(mode):
    """A new user's finding: on a CPU-only run opt.stats gave d2h_nbytes and h2d_nbytes of
    every bucket, "bytes over the link", where no copy crosses one (they are host to host,
    and d2h_ms / h2d_ms were 0 already)."""
    model = mlp()
    opt = make_opt(model, 1.0, **MODES.get(mode, dict(overlap=mode)))
    if mode == "delayed":
        opt.watch(model)
    for step in range(2):
        model(batch(step)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    s = opt.stats
    assert s["buckets"] == len(opt.buckets) > 0
    assert (s["d2h_nbytes"], s["h2d_nbytes"], s["d2h_ms"], s["h2d_ms"]) == (0, 0, 0.0, 0.0)
    opt.close()


def test_state_dict_after_an_unfinished_backward_names_the_way_out():
    """A fresh user: state_dict() after a backward that failed (or was interrupted) once its
    updates started said "call state_dict() after step()", and step() then refused the step."""
    model = mlp()
    opt = make_opt(model, 1.0, **MODES["backward"])
    x = FailInBackward.apply(model[0](batch(0)))
    with pytest.raises(RuntimeError, match="backward failed here"):
        model[1:](x).pow(2).mean().backward()
    opt.debug.step.run.wait_h2d_queued(next(iter(opt.debug.step.fed)), 10)  # an update ran
    with pytest.raises(RuntimeError, match="has not finished.*discard_failed_step"):
        opt.state_dict()
    opt.discard_failed_step()
    opt.state_dict()
    opt.close()


@pytest.mark.parametrize("recover", ["load", "discard"])
def test_a_step_refused_for_an_edited_grad_leaves_no_run_behind(recover):
    """A fresh user's finding: after step() refused a grad edited once its update started
    (declared backward mode), the next step() waited forever, even after load_state_dict() or
    discard_failed_step(): the refused step's run stayed open on the worker, and the next run
    queued behind it. timeout_s turns such a hang into an error here."""
    model = mlp()
    opt = make_opt(model, 1.0, timeout_s=10, **MODES["backward"])
    model(batch(0)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    good = opt.state_dict()
    model(batch(1)).pow(2).mean().backward()
    with torch.no_grad():
        for p in model.parameters():
            p.grad.mul_(2)
    with pytest.raises(RuntimeError, match="changed after its bucket's update started"):
        opt.step()
    opt.load_state_dict(good) if recover == "load" else opt.discard_failed_step()
    opt.zero_grad()
    model(batch(2)).pow(2).mean().backward()
    t = time.perf_counter()
    opt.step()
    assert time.perf_counter() - t < 5.0
    opt.close()


@pytest.mark.parametrize("overlap", ["step", "backward"])
def test_a_step_holds_no_grad_once_its_copies_landed(overlap):
    """With wait="module" a step stays in flight until the next forward has waited for every
    bucket; the grads it copied must not be held that long: once their D2H landed, dropping
    p.grad (zero_grad) gives their memory back, before the next forward and backward."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    opts = dict(grads_final=True) if overlap == "backward" else {}
    opt = HybridAdamW(model.parameters(), lr=1e-3, offload_fraction=1.0, min_offload_numel=1,
                      overlap=overlap, wait="module", **opts)  # fmt: skip
    opt.watch(model)
    for _ in range(2):
        model(torch.randn(8, 64)).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    st = opt.debug.inflight
    assert st is not None and st.run is not None  # still in flight: the next forward waits
    st.run.wait(10)
    assert st.run.fed and all(w.grads == [] for w in st.run.fed)
    opt.close()


@pytest.mark.parametrize(
    "kw", [dict(grads_final=True), dict(max_grad_norm=1.0)], ids=["grads_final", "max_grad_norm"]
)
def test_zeroing_grads_to_skip_a_step_after_updates_began_is_refused(kw):
    """A fresh user's finding: backward, then ``zero_grad()`` to skip the step (a non-finite
    loss), then ``step()``: in declared backward mode the updates had begun, so the weights
    changed anyway, silently. ``opt.zero_grad()`` now refuses there and changes nothing (the
    step then finishes as if it had not been called); a drop the optimizer cannot see
    (``model.zero_grad()``) is named at ``step()``, which then refuses as after an edit."""
    model, ref_model = mlp(), mlp()
    opt = make_opt(model, 1.0, overlap="backward", **kw)
    ref = make_opt(ref_model, 1.0, **({"max_grad_norm": 1.0} if "max_grad_norm" in kw else {}))
    for m in (model, ref_model):
        m(batch(0)).pow(2).mean().backward()
    grads = [p.grad for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"zero_grad\(\) between backward and step\(\).*nothing was changed"):  # fmt: skip
        opt.zero_grad()
    assert all(p.grad is g for p, g in zip(model.parameters(), grads, strict=True))
    opt.step()
    ref.step()
    assert_bitwise(list(model.parameters()), list(ref_model.parameters()))
    # The same drop behind the optimizer's back: named at step(), which then refuses.
    for m in (model, ref_model):
        m(batch(1)).pow(2).mean().backward()
    model.zero_grad(set_to_none=True)
    with pytest.raises(RuntimeError, match=r"set to None after their buckets' updates started"):
        opt.step()
    with pytest.raises(RuntimeError, match="discard_failed_step"):
        opt.step()
    opt.close()
    ref.close()
