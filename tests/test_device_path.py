"""The device path of the compressed-state update: kernels.reference.adam_step_flat (one pass
over all tensors of a call) against the per-tensor reference adam_step, bitwise, in every mode;
kernels.adam.device_step's passes; and the optimizer at offload fraction 0 on the reference
path against the C++ kernel."""

from __future__ import annotations

import pytest
import torch
from oracle import make_params, seeded_grads
from test_kernels import assert_bitwise, clone_all, kcall, make_mode

from offloadopt import kernels
from offloadopt.kernels import adam, reference

SIZES = [1, 255, 256, 257, 1000, 70_000]


@pytest.fixture(autouse=True)
def _one_thread():
    """One torch thread unless a test sets more: the results do not depend on it (checked
    below), and on a shared 2-core host two threads per op made the file several times
    slower."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


STEPS = [1.0, 2.0, 7.0, 1000.0, 3.0, 12.0]
SALTS = [1, 2, 3, 2**40 + 5, 2**63 + 11, 0]
# the third tensor's random counter crosses 2^32 (mid-block where the blocks allow it)
OFFSETS = [0, 256, 2**32 - 100, 512, 0, 2**20]


def call_kwargs(moments: int, master_bf16: bool, **hp) -> dict:
    offsets = [o // 256 * 256 for o in OFFSETS] if moments == 2 else OFFSETS
    kw = dict(steps=STEPS, salts=SALTS, offsets=offsets, moments=moments, master_sr=master_bf16)
    return {**kw, **hp}


def same_bits(x: torch.Tensor, y: torch.Tensor, what: str) -> None:
    if x.dtype == torch.uint8:
        diff = (x != y).nonzero().flatten()
        assert diff.numel() == 0, f"{what}: codes differ at {diff[:5].tolist()}"
    else:
        assert_bitwise(x.reshape(-1), y.reshape(-1), what)


def assert_lists_bitwise(a, b, what: str) -> None:
    for k, (la, lb) in enumerate(zip(a, b, strict=True)):
        for i, (x, y) in enumerate(zip(la, lb, strict=True)):
            same_bits(x, y, f"{what}: list {k} tensor {i}")


# (master bf16, moments, weights_out); weights_out goes with fp32 masters only
MODES = [(False, 0, True), (False, 1, False), (False, 1, True), (True, 0, False),
         (True, 1, False), (False, 2, False), (False, 2, True), (True, 2, False)]  # fmt: skip
HYPER = [dict(decoupled=True, maximize=False, grad_scale=None, weight_decay=0.1),
         dict(decoupled=False, maximize=True, grad_scale=3.0, weight_decay=0.01),
         dict(decoupled=True, maximize=True, grad_scale=0.5, weight_decay=0.0)]  # fmt: skip


@pytest.mark.parametrize("hp", HYPER, ids=["adamw", "adam-max-scaled", "no-wd"])
@pytest.mark.parametrize("master_bf16,moments,wout", MODES)
def test_flat_is_bitwise_the_per_tensor_reference(master_bf16, moments, wout, hp):
    a = make_mode(SIZES, 4, master_bf16, moments)
    b = clone_all(a)
    wa = [torch.zeros(n, dtype=torch.bfloat16) for n in SIZES] if wout else []
    wb = [w.clone() for w in wa]
    kw = call_kwargs(moments, master_bf16, **hp)
    for _ in range(2):  # the second step reads the first's rounded / encoded state
        kcall(reference.adam_step, *a[:4], sms=a[4], svs=a[5], wout=wa, **kw)
        kcall(reference.adam_step_flat, *b[:4], sms=b[4], svs=b[5], wout=wb, **kw)
        kw["steps"] = [s + 1 for s in kw["steps"]]
    assert_lists_bitwise([*a, wa], [*b, wb], "flat vs per tensor")
    before = make_mode(SIZES, 4, master_bf16, moments)[0]
    assert not torch.equal(b[0][-1], before[-1])  # it stepped


@pytest.mark.parametrize("master_bf16,moments", [(False, 2), (True, 2), (True, 1)])
def test_a_non_finite_grad_spoils_its_own_block_only(master_bf16, moments):
    """A NaN in the grad of one tensor's last (partial) block, and a grad of 1e30 in another's
    (its exp_avg stays finite, its exp_avg_sq overflows): those blocks' two scales are NaN and
    their codes 0; the tensor beside them, and their other blocks, get the bits of a call
    without them; the per-tensor reference gets the same bits."""
    sizes = [300, 600, 257]
    clean = make_mode(sizes, 8, master_bf16, moments)
    a, b = clone_all(clean), clone_all(clean)
    b[1][1][520] = float("nan")  # tensor 1, block 2 (elements 512..599)
    b[1][0][290] = 1e30  # tensor 0, block 1 (elements 256..299): v = g*g = inf
    kw = call_kwargs(moments, master_bf16, steps=[2.0, 3.0, 4.0], salts=[5, 6, 7],
                     offsets=[0, 0, 0])  # fmt: skip
    ref = clone_all(b)
    kcall(reference.adam_step_flat, *a[:4], sms=a[4], svs=a[5], **kw)
    kcall(reference.adam_step_flat, *b[:4], sms=b[4], svs=b[5], **kw)
    kcall(reference.adam_step, *ref[:4], sms=ref[4], svs=ref[5], **kw)
    assert_lists_bitwise(b, ref, "flat vs per tensor with non-finite blocks")
    for k in (k for k in range(len(a)) if a[k]):  # the scales lists are empty but for int8
        same_bits(a[k][2], b[k][2], f"list {k} tensor 2 beside the non-finite blocks")
        if k < 4:
            same_bits(a[k][1][:512], b[k][1][:512], f"list {k} blocks before the NaN")
            same_bits(a[k][0][:256], b[k][0][:256], f"list {k} block before the overflow")
    if moments == 2:
        for t, blk in ((1, 2), (0, 1)):
            assert torch.isnan(b[4][t][blk]) and torch.isnan(b[5][t][blk]), (t, blk)
            assert not torch.isnan(b[4][t][:blk]).any()
            assert int(b[2][t][blk * 256 :].max()) == 0 and int(b[3][t][blk * 256 :].max()) == 0
    assert torch.isnan(b[0][1][520].float())


def test_an_empty_call_does_nothing_and_bad_lists_are_refused():
    reference.adam_step_flat([], [], [], [], [], [], [], [], [], [], **_hp())
    adam.device_step(**_args([], [], [], []))
    one = [torch.ones(8)]
    with pytest.raises(ValueError, match="grads has 0 entries"):
        reference.adam_step_flat(one, [], one, one, [], [], [], [1.0], [0], [0], **_hp())
    with pytest.raises(ValueError, match=r"exp_avgs\[0\] is \(9,\)"):
        reference.adam_step_flat(one, one, [torch.ones(9)], one, [], [], [], [1.0], [0], [0],
                                 **_hp())  # fmt: skip
    with pytest.raises(ValueError, match="masters\\[1\\] is torch.bfloat16"):
        two = [torch.ones(8), torch.ones(8, dtype=torch.bfloat16)]
        reference.adam_step_flat(two, two, two, two, [], [], [], [1.0] * 2, [0] * 2, [0] * 2,
                                 **_hp())  # fmt: skip
    with pytest.raises(ValueError, match="max_numel=100"):
        adam.device_step(max_numel=100, **_args(one, one, one, one))


def _hp(**kw) -> dict:
    h = dict(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.1, eps=1e-8, maximize=False,
             decoupled=True, grad_scale=None, moments=0, master_sr=False)  # fmt: skip
    return {**h, **kw}


def _args(masters, grads, ms, vs, sms=(), svs=(), wout=(), **kw) -> dict:
    t = len(masters)
    return dict(masters=list(masters), grads=list(grads), exp_avgs=list(ms), exp_avg_sqs=list(vs),
                exp_avg_scales=list(sms), exp_avg_sq_scales=list(svs), weights_out=list(wout),
                steps=kw.pop("steps", STEPS[:t]), salts=kw.pop("salts", SALTS[:t]),
                offsets=kw.pop("offsets", [0] * t), **_hp(**kw))  # fmt: skip


@pytest.mark.parametrize("master_bf16,moments", [(False, 2), (True, 2), (True, 1), (False, 0)])
def test_passes_cut_anywhere_give_the_bits_of_one_pass(master_bf16, moments):
    """device_step in passes of 512 and 1,024 elements (70,000 and 1,000 elements cut, the
    offsets and scales following) at 1 and 2 threads: the bits of one pass."""
    whole = make_mode(SIZES, 2, master_bf16, moments)
    results = []
    old = torch.get_num_threads()
    try:
        for max_numel, threads in ((2**27, 2), (512, 2), (1024, 1), (2**16, 1)):
            torch.set_num_threads(threads)
            x = clone_all(whole)
            wout = [torch.zeros(n, dtype=torch.bfloat16) for n in SIZES] if not master_bf16 else []
            kw = call_kwargs(moments, master_bf16)
            adam.device_step(max_numel=max_numel, **_args(*x[:4], x[4], x[5], wout, **kw))
            results.append([*x, wout])
    finally:
        torch.set_num_threads(old)
    for r in results[1:]:
        assert_lists_bitwise(results[0], r, "passes")


def test_device_step_passes_stay_under_the_limit(monkeypatch):
    seen = []
    real = reference.adam_step_flat

    def spy(**kw):
        seen.append(sum(-(-t.numel() // 256) * 256 for t in kw["masters"]))
        real(**kw)

    monkeypatch.setattr(reference, "adam_step_flat", spy)
    x = make_mode(SIZES, 1, False, 2)
    adam.device_step(max_numel=1024, **_args(*x[:4], x[4], x[5], moments=2))
    assert max(seen) <= 1024 and sum(seen) >= sum(SIZES) and len(seen) > 70


# --- through the optimizer: the reference path at fraction 0 against the kernel --------------

SETTINGS = [
    pytest.param(dict(state_dtype="int8"), torch.float32, id="int8-moments"),
    pytest.param(dict(state_dtype="bf16"), torch.float32, id="bf16-moments"),
    pytest.param(
        dict(master_weights="bf16-sr", state_dtype="int8"), torch.bfloat16, id="bf16-sr-int8"
    ),
]


def _train(params, fraction, steps=4, **kw):
    from oracle import hybrid

    opt = hybrid(params, fraction, **kw)
    for step in range(steps):
        for p, g in zip(params, seeded_grads(params, step), strict=True):
            p.grad = g
        opt.step()
    return opt


@pytest.mark.parametrize("kw,dtype", SETTINGS)
def test_the_device_path_on_cpu_tensors_matches_the_kernel(monkeypatch, kw, dtype):
    """HybridAdamW at offload fraction 0 with the device path forced on (CPU tensors run
    reference.adam_step_flat instead of the C++ kernel) against fraction 1 (the kernel):
    equal up to the order of fp32 operations (the tolerances of test_kernels); and the same
    bits as the per-tensor reference on that path."""
    import offloadopt.step.update as update

    calls = []
    real_device_step = adam.device_step

    def counted(**k):
        calls.append(len(k["masters"]))
        real_device_step(**k)

    def forced(*args, **k):
        return adam.adam_update(*args, use_kernel=False, **k)

    kernel_params = make_params(dtype)
    _train(kernel_params, 1.0, **kw)
    monkeypatch.setattr(update, "adam_update", forced)
    monkeypatch.setattr(adam, "device_step", counted)
    flat_params = make_params(dtype)
    flat_opt = _train(flat_params, 0.0, **kw)
    assert sum(calls) >= 4 * len(flat_params)  # every param, every step, on the flat path
    monkeypatch.setattr(adam, "device_step", _per_tensor_device_step)
    ref_params = make_params(dtype)
    ref_opt = _train(ref_params, 0.0, **kw)
    for i, (p, q, r) in enumerate(zip(kernel_params, flat_params, ref_params, strict=True)):
        same_bits(q.detach(), r.detach(), f"param {i}: flat vs per tensor")
        for key, t in flat_opt.state[q].items():
            same_bits(t, ref_opt.state[r][key], f"param {i} {key}: flat vs per tensor")
        if dtype == torch.bfloat16:
            d = (q.detach().float() - p.detach().float()).abs()
            assert float((d > 2e-2 * p.detach().float().abs() + 2e-2).float().mean()) == 0.0
        else:
            torch.testing.assert_close(q.detach(), p.detach(), rtol=1e-4, atol=1e-5,
                                       msg=lambda s, i=i: f"param {i}: {s}")  # fmt: skip


def _per_tensor_device_step(*, max_numel=None, **args):
    reference.adam_step(**args)


def test_the_cpu_default_is_still_the_kernel(monkeypatch):
    """adam_update without use_kernel sends CPU tensors to the C++ kernel, not the device
    path."""
    called = []
    monkeypatch.setattr(adam, "device_step", lambda **kw: called.append(1))
    params = make_params()
    _train(params, 0.0, steps=1, state_dtype="int8")
    assert not called and kernels.available()


@pytest.mark.slow
def test_the_benchmark_runs_at_a_tiny_size():
    """benchmarks/device_path.py as a user runs it (a program: no test imports a benchmark)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "device_path.py"
    argv = ["--scale", "2000", "--repeats", "1", "--threads", "1", "--per-tensor"]
    r = subprocess.run([sys.executable, str(script), *argv], capture_output=True, text=True,
                       timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout
    assert "per tensor" in out and "flat, eager" in out and "cpu" in out, out


def assert_near_eager(eager, compiled, moments: int, what: str) -> None:
    """The compiled pass against the eager one (lists as make_mode's plus weights_out): fp32
    values within a few ulps, bf16 values within one bf16 step (the compiler fuses
    multiply-adds, so a stochastic rounding can land on the other neighbour), int8 moments
    within one code step of their block's scale after decoding, and nearly every element
    bitwise equal."""
    from offloadopt.kernels import formats

    def near(x, y, rtol, atol, name):
        torch.testing.assert_close(y.float(), x.float(), rtol=rtol, atol=atol, equal_nan=True,
                                   msg=lambda m: f"{what}: {name}: {m}")  # fmt: skip

    (pa, _, ma, va, sma, sva, wa), (pb, _, mb, vb, smb, svb, wb) = eager, compiled
    total = differ = 0
    for i in range(len(pa)):
        bf16 = pa[i].dtype == torch.bfloat16
        near(pa[i], pb[i], 2**-7 if bf16 else 1e-6, 1e-9, f"master {i}")
        if wa:
            near(wa[i], wb[i], 2**-7, 1e-9, f"weights_out {i}")
        if moments == 2:
            dm_a, dm_b = formats.decode_m(ma[i], sma[i]), formats.decode_m(mb[i], smb[i])
            dv_a, dv_b = formats.decode_v(va[i], sva[i]), formats.decode_v(vb[i], svb[i])
            near(sma[i], smb[i], 1e-5, 1e-12, f"exp_avg scales {i}")
            near(sva[i], svb[i], 1e-5, 1e-12, f"exp_avg_sq scales {i}")
            step_m = sma[i].repeat_interleave(256)[: dm_a.numel()] / 8 + 1e-12
            step_y = sva[i].repeat_interleave(256)[: dv_a.numel()] / 16 + 1e-12
            assert bool(((dm_a - dm_b).abs() <= step_m).all()), f"{what}: exp_avg {i}"
            assert bool(((dv_a.sqrt() - dv_b.sqrt()).abs() <= step_y).all()), (
                f"{what}: exp_avg_sq {i}"
            )
        else:
            rtol = 2**-7 if ma[i].dtype == torch.bfloat16 else 1e-6
            near(ma[i], mb[i], rtol, 1e-9, f"exp_avg {i}")
            near(va[i], vb[i], rtol, 1e-12, f"exp_avg_sq {i}")
        for x, y in ((pa[i], pb[i]), (ma[i], mb[i]), (va[i], vb[i])):
            total += x.numel()
            differ += int((x != y).sum()) if x.dtype == torch.uint8 else int(
                (x.view(torch.int16 if x.element_size() == 2 else torch.int32)
                 != y.view(torch.int16 if y.element_size() == 2 else torch.int32)).sum())  # fmt: skip
    assert differ <= 0.4 * total, f"{what}: {differ} of {total} elements differ"


@pytest.mark.slow
@pytest.mark.parametrize("master_bf16,moments,wout", [(True, 1, False), (False, 2, True)])
def test_the_compiled_pass_lands_near_the_eager_one(master_bf16, moments, wout):
    """reference.adam_step_flat(compiled=True) (torch.compile of the elementwise part: the
    default on CUDA, tests/cuda/test_device_path_cuda.py) over two steps, on the CPU: within
    assert_near_eager's tolerance of the eager pass, with a loss scale and a new lr on the
    second step. Every mode: on the GPU host."""
    import functools

    a = make_mode(SIZES, 4, master_bf16, moments)
    b = clone_all(a)
    wa = [torch.zeros(n, dtype=torch.bfloat16) for n in SIZES] if wout else []
    wb = [w.clone() for w in wa]
    kw = call_kwargs(moments, master_bf16, **HYPER[0])
    compiled = functools.partial(reference.adam_step_flat, compiled=True)
    for lr, scale in ((1e-3, None), (3e-4, 2.0)):
        kcall(reference.adam_step_flat, *a[:4], sms=a[4], svs=a[5], wout=wa, lr=lr,
              **{**kw, "grad_scale": scale})  # fmt: skip
        kcall(compiled, *b[:4], sms=b[4], svs=b[5], wout=wb, lr=lr, **{**kw, "grad_scale": scale})
        kw["steps"] = [s + 1 for s in kw["steps"]]
    assert_near_eager([*a, wa], [*b, wb], moments, "compiled vs eager")
    assert not torch.equal(b[0][-1], make_mode(SIZES, 4, master_bf16, moments)[0][-1])


@pytest.mark.slow
def test_the_compiled_pass_decays_by_a_factor_of_zero():
    """lr x weight_decay = 1: AdamW's decoupled decay multiplies the weights by 0 before the
    update. The compiled pass took the factor as ``wd_factor or 1.0``, so a factor of 0 left
    the weights undecayed; the eager pass decayed them."""
    import functools

    a = make_mode(SIZES, 4, False, 2)
    b = clone_all(a)
    kw = call_kwargs(2, False, **{**HYPER[0], "weight_decay": 2.0})
    compiled = functools.partial(reference.adam_step_flat, compiled=True)
    kcall(reference.adam_step_flat, *a[:4], sms=a[4], svs=a[5], wout=[], lr=0.5, **kw)
    kcall(compiled, *b[:4], sms=b[4], svs=b[5], wout=[], lr=0.5, **kw)
    # at lr 0.5 the weights are the update alone (about lr in size), so the two passes'
    # rounding differs by more than assert_near_eager's tolerance for lr 1e-3; undecayed,
    # they differed by the old weights (11x here)
    for x, y in zip(a[0], b[0], strict=True):
        torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-6)


def test_the_device_step_setting_is_read_from_the_environment(monkeypatch):
    """OFFLOADOPT_DEVICE_STEP: the flat buffers' pass (device_step_mode) and the per-tensor
    path (compile_device_step); by default Triton's kernel on CUDA where it can run, else the
    compiled pass; a bad value is refused by both."""
    from offloadopt.kernels import flat_triton

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    monkeypatch.delenv("OFFLOADOPT_DEVICE_STEP", raising=False)
    for can in (True, False):
        monkeypatch.setattr(flat_triton, "available", lambda device, can=can: can)
        assert adam.device_step_mode(cuda) == ("triton" if can else "compiled")
        assert adam.device_step_mode(cpu) == "eager"
    assert adam.compile_device_step(cuda)
    assert not adam.compile_device_step(cpu)
    monkeypatch.setenv("OFFLOADOPT_DEVICE_STEP", "compiled")
    assert adam.device_step_mode(cuda) == "compiled" and adam.device_step_mode(cpu) == "eager"
    monkeypatch.setenv("OFFLOADOPT_DEVICE_STEP", "triton")
    with pytest.raises(RuntimeError, match="triton cannot run on cuda:0"):
        adam.device_step_mode(cuda)
    assert adam.compile_device_step(cuda)  # the per-tensor path: compiled
    monkeypatch.setattr(flat_triton, "available", lambda device: True)
    assert adam.device_step_mode(cuda) == adam.device_step_mode(cpu) == "triton"
    monkeypatch.setenv("OFFLOADOPT_DEVICE_STEP", "eager")
    assert adam.device_step_mode(cuda) == "eager"
    assert not adam.compile_device_step(cuda)
    monkeypatch.setenv("OFFLOADOPT_DEVICE_STEP", "fast")
    for fn in (adam.compile_device_step, adam.device_step_mode):
        with pytest.raises(ValueError, match="OFFLOADOPT_DEVICE_STEP='fast'; expected 'triton'"):
            fn(cuda)


def test_mastered_params_update_in_one_call_with_bf16_grads_and_weights_out(monkeypatch):
    """Device-resident bf16 params with fp32 masters under int8 state: one update call per
    group, whatever bucket_nbytes (it chunked by it: GPT-2 1.5B's device update took about
    115 ms more than torch's on the GPU host), with the bf16 grads as they are (no fp32 copies)
    and the params themselves as weights_out; the same bits as the chunked fp32-grad path,
    which a clip factor still takes."""
    import offloadopt.step.update as update

    seen = []
    real = adam.adam_update

    def spy(*args, **k):
        grads = args[3]
        seen.append((len(grads), {g.dtype for g in grads}, k.get("weights_out") is not None))
        return real(*args, **k)

    monkeypatch.setattr(update, "adam_update", spy)
    one = make_params(torch.bfloat16)
    _train(one, 0.0, state_dtype="int8", bucket_nbytes=1024)
    groups = 3  # oracle.groups_of
    assert len(seen) == 4 * groups  # one call per group and step
    assert all(dtypes == {torch.bfloat16} and out for _, dtypes, out in seen)
    # the chunked path (a clip factor of exactly 1: max_grad_norm far above the norm)
    seen.clear()
    chunked = make_params(torch.bfloat16)
    _train(chunked, 0.0, state_dtype="int8", bucket_nbytes=1024, max_grad_norm=1e9)
    assert len(seen) > 4 * groups and all(d == {torch.float32} for _, d, _ in seen)
    for p, q in zip(one, chunked, strict=True):
        same_bits(p.detach(), q.detach(), "one call vs chunked")


def test_a_bad_device_step_is_refused_at_construction_on_any_device(monkeypatch):
    # a new user's finding: OFFLOADOPT_DEVICE_STEP=bogus was ignored on the CPU (and on CUDA
    # surfaced only at the first step)
    from offloadopt import HybridAdamW

    monkeypatch.setenv("OFFLOADOPT_DEVICE_STEP", "bogus")
    p = torch.nn.Parameter(torch.zeros(8))
    with pytest.raises(ValueError, match="OFFLOADOPT_DEVICE_STEP='bogus'; expected 'triton', "):
        HybridAdamW([p], state_dtype="int8")
