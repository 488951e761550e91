"""Compressed optimizer state through the whole optimizer (state_dtype=, master_weights="bf16-sr"):
the same bits at every fraction and in every mode (the CPU kernel runs every param here), the
math of the plain-torch reference, checkpoints that torch loads and that resume bitwise, the
bytes the placement counts, and the refusals."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from oracle import groups_of, hybrid, make_params, seeded_grads

from offloadopt import HybridAdamW, HybridSGD
from offloadopt.kernels import reference

SETTINGS = [
    pytest.param(dict(state_dtype="bf16"), torch.float32, id="bf16-moments"),
    pytest.param(dict(state_dtype="int8"), torch.float32, id="int8-moments"),
    pytest.param(dict(state_dtype="int8"), torch.bfloat16, id="int8-moments-bf16-params"),
    pytest.param(dict(master_weights="bf16-sr"), torch.bfloat16, id="bf16-sr-master"),
    pytest.param(
        dict(master_weights="bf16-sr", state_dtype="int8"), torch.bfloat16, id="bf16-sr-int8"
    ),  # fmt: skip
]


def run(params, steps, start=0, opt=None, **kw):
    opt = opt or hybrid(params, kw.pop("fraction", 1.0), **kw)
    for step in range(start, start + steps):
        for p, g in zip(params, seeded_grads(params, step), strict=True):
            p.grad = g
        opt.step()
    return opt


def zeros_state(n: int, moments: str) -> dict:
    """The reference's state arguments for one fresh param of ``n`` elements."""
    if moments == "int8":
        blocks = -(-n // 256)
        return dict(exp_avgs=[torch.zeros(n, dtype=torch.uint8)],
                    exp_avg_sqs=[torch.zeros(n, dtype=torch.uint8)],
                    exp_avg_scales=[torch.zeros(blocks)], exp_avg_sq_scales=[torch.zeros(blocks)])  # fmt: skip
    dtype = torch.bfloat16 if moments == "bf16" else torch.float32
    return dict(exp_avgs=[torch.zeros(n, dtype=dtype)], exp_avg_sqs=[torch.zeros(n, dtype=dtype)],
                exp_avg_scales=[], exp_avg_sq_scales=[])  # fmt: skip


def state_of(opt, params):
    return [{k: v.clone() for k, v in opt.state[p].items()} for p in params]


def assert_same(a, b, what=""):
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if isinstance(x, dict):
            assert x.keys() == y.keys(), (what, i, x.keys(), y.keys())
            for k in x:
                torch.testing.assert_close(x[k], y[k], rtol=0, atol=0, msg=f"{what} {i} {k}")
        else:
            torch.testing.assert_close(x, y, rtol=0, atol=0, msg=f"{what} param {i}")


@pytest.mark.parametrize("kw,dtype", SETTINGS)
def test_every_fraction_gives_the_same_bits(kw, dtype):
    results = []
    for fraction in (0.0, 0.5, 1.0):
        params = make_params(dtype)
        opt = run(params, 6, fraction=fraction, **kw)
        results.append(([p.detach().clone() for p in params], state_of(opt, params)))
    for w, s in results[1:]:
        assert_same(w, results[0][0], "weights")
        assert_same(s, results[0][1], "state")


def test_buckets_cutting_params_give_the_same_bits():
    whole, cut = make_params(), make_params()
    a = run(whole, 5, state_dtype="int8")
    b = run(cut, 5, state_dtype="int8", bucket_nbytes=1024)  # 256 fp32 elements a bucket
    cuts = [len(r.buckets) for r in b.debug.records.values() if r.offloaded]
    assert max(cuts) > 1  # a param cut in several buckets
    assert_same([p.detach() for p in cut], [p.detach() for p in whole])
    assert_same(state_of(b, cut), state_of(a, whole))


@pytest.mark.parametrize(
    "sizes,nbytes", [((100, 257), 1028), ((513, 258, 300), 1032), ((300, 9), 1200)]
)
def test_buckets_too_small_for_the_padding_before_a_param_give_the_same_bits(sizes, nbytes):
    """A user's find: int8's 256-element alignment left some tiny buckets (1028 bytes: 257 fp32
    elements) room for only the padding before the next param, and that padding became a bucket
    with no segment: IndexError in the constructor."""
    whole = [
        torch.nn.Parameter(torch.randn(n, generator=torch.Generator().manual_seed(n)))
        for n in sizes
    ]
    cut = [torch.nn.Parameter(p.detach().clone()) for p in whole]
    a = run(whole, 3, state_dtype="int8")
    b = run(cut, 3, state_dtype="int8", bucket_nbytes=nbytes)
    assert all(bk.segments for r in b.debug.records.values() if r.offloaded for bk in r.buckets)
    assert_same([p.detach() for p in cut], [p.detach() for p in whole])
    assert_same(state_of(b, cut), state_of(a, whole))


def test_backward_mode_gives_the_bits_of_step_mode():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    twin = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    twin.load_state_dict(model.state_dict())
    kw = dict(min_offload_numel=64, state_dtype="int8", lr=1e-2)
    a = HybridAdamW(model.parameters(), **kw)
    b = HybridAdamW(twin.parameters(), overlap="backward", grads_final=True, **kw)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(3))
    for _ in range(4):
        for m, opt in ((model, a), (twin, b)):
            m(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    assert_same([p.detach() for p in twin.parameters()], [p.detach() for p in model.parameters()])


@pytest.mark.parametrize("kw,dtype", SETTINGS)
def test_the_update_is_the_reference_math(kw, dtype):
    """HybridAdamW against a loop over kernels.reference (plain torch ops), param by param: the
    same representation and rounding, so only the order of fp32 operations may differ."""
    params, ref_params = make_params(dtype), make_params(dtype)
    run(params, 8, **kw)
    groups = groups_of(ref_params)
    moments = kw.get("state_dtype", "fp32")
    sr = kw.get("master_weights") == "bf16-sr"
    masters = [p.detach().clone() if sr or dtype == torch.float32 else p.detach().float()
               for p in ref_params]  # fmt: skip
    states = {}
    for step in range(8):
        grads = seeded_grads(ref_params, step)
        for g in groups:
            hyper = {**HybridAdamW([torch.zeros(1, requires_grad=True)]).defaults, **g}
            for p in g["params"]:
                i = next(k for k, q in enumerate(ref_params) if q is p)
                n = p.numel()
                st = states.setdefault(i, zeros_state(n, moments))
                reference.adam_step(
                    masters=[masters[i].view(-1)], grads=[grads[i].view(-1)], **st,
                    weights_out=[], steps=[float(step + 1)], salts=[i], offsets=[0],
                    lr=hyper["lr"], beta1=hyper["betas"][0], beta2=hyper["betas"][1],
                    weight_decay=hyper["weight_decay"], eps=hyper["eps"], maximize=False,
                    decoupled=True, grad_scale=None, moments={"fp32": 0, "bf16": 1, "int8": 2}[moments],
                    master_sr=sr and masters[i].dtype == torch.bfloat16,
                )  # fmt: skip
    for i, (p, m) in enumerate(zip(params, masters, strict=True)):
        tol = (
            dict(rtol=2e-2, atol=2e-2) if m.dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-5)
        )
        torch.testing.assert_close(p.detach().float(), m.to(p.dtype).float(), **tol,
                                   msg=lambda s, i=i: f"param {i}: {s}")  # fmt: skip


@pytest.mark.parametrize("kw,dtype", SETTINGS)
def test_a_checkpoint_resumes_bitwise_and_torch_loads_it(kw, dtype):
    whole = make_params(dtype)
    a = run(whole, 8, **kw)
    first = make_params(dtype)
    b = run(first, 4, **kw)
    sd = b.state_dict()
    for entry in sd["state"].values():  # torch's keys, fp32, shaped like the param
        assert entry["exp_avg"].dtype == entry["exp_avg_sq"].dtype == torch.float32
    weights = [p.detach().clone() for p in first]
    del b
    second = make_params(dtype)
    with torch.no_grad():
        for p, w in zip(second, weights, strict=True):
            p.copy_(w)
    c = hybrid(second, 1.0, **kw)
    c.load_state_dict(torch.load(_saved(sd), weights_only=True))
    run(second, 4, start=4, opt=c)
    assert_same([p.detach() for p in second], [p.detach() for p in whole])
    assert_same(state_of(c, second), state_of(a, whole))
    theirs = torch.optim.AdamW(groups_of([p.detach().float().requires_grad_() for p in first]),
                               fused=True)  # fmt: skip
    theirs.load_state_dict(sd)


def _saved(sd):
    import io

    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return buf


def test_a_torch_checkpoint_loads_into_int8_moments():
    ref_params, params = make_params(), make_params()
    ref = torch.optim.AdamW(groups_of(ref_params), fused=True)
    for step in range(3):
        for p, g in zip(ref_params, seeded_grads(ref_params, step), strict=True):
            p.grad = g
        ref.step()
    opt = hybrid(params, 1.0, state_dtype="int8")
    opt.load_state_dict(ref.state_dict())
    back = opt.state_dict()
    for i, p in enumerate(ref_params):
        theirs, mine = ref.state[p], back["state"][i]
        for k, rtol in (("exp_avg", 1 / 16), ("exp_avg_sq", 1 / 16)):
            scale = theirs[k].abs().max()
            err = (mine[k] - theirs[k]).abs()
            assert (err <= rtol * theirs[k].abs() + 2**-13 * scale).all(), (i, k, err.max())


def test_the_placement_counts_the_compressed_bytes():
    params = make_params()
    numel = sum(p.numel() for p in params if p.numel() >= 64)
    full = hybrid(params, 1.0)
    int8 = hybrid(make_params(), 1.0, state_dtype="int8")
    bf16 = hybrid(make_params(), 1.0, state_dtype="bf16")
    size = {name: sum(pl.state_nbytes for pl in o.placement if pl.offloaded)
            for name, o in (("fp32", full), ("int8", int8), ("bf16", bf16))}  # fmt: skip
    assert size["fp32"] == 8 * numel
    assert size["bf16"] == 4 * numel
    assert 2 * numel < size["int8"] < 2.1 * numel


def test_refusals_name_the_value():
    p = [torch.nn.Parameter(torch.zeros(4))]
    with pytest.raises(ValueError, match="state_dtype: 'int4'"):
        HybridAdamW(p, state_dtype="int4")
    with pytest.raises(ValueError, match="HybridSGD keeps"):
        HybridSGD(p, lr=0.1, state_dtype="bf16")
    with pytest.raises(ValueError, match="master_weights=False"):
        HybridAdamW(p, state_dtype="int8", master_weights=False)
    with pytest.raises(ValueError, match="master_weights: 'bf16'"):
        HybridAdamW(p, master_weights="bf16")


def test_a_missing_compiler_fails_at_construction(monkeypatch):
    from offloadopt import kernels

    def fail():
        raise kernels.KernelBuildError("offloadopt: no compiler (install g++)")

    monkeypatch.setattr(kernels, "load", fail)
    with pytest.raises(RuntimeError, match="install g"):
        HybridAdamW([torch.nn.Parameter(torch.zeros(4))], state_dtype="bf16")
    HybridAdamW([torch.nn.Parameter(torch.zeros(4))])  # torch's representation needs none


def test_opt_state_assignment_round_trips_int8_state():
    params = make_params()
    opt = run(params, 3, state_dtype="int8")
    snapshot = {p: {k: v.clone() for k, v in opt.state[p].items()} for p in params}
    run(params, 2, start=3, opt=opt)
    opt.state = snapshot  # the scales have one value per block, not per element
    for p in params:
        for k, v in snapshot[p].items():
            torch.testing.assert_close(opt.state[p][k], v, rtol=0, atol=0)


def test_assigning_torchs_moment_keys_encodes_them_into_the_int8_state():
    """opt.state[p]["exp_avg"] = t (as Lightning and users do) under int8 state: the value goes
    into the codes and scales, so state_dict() and the next step use it; no stray fp32 key."""
    from offloadopt.kernels import formats

    params = make_params()
    opt = run(params, 2, state_dtype="int8")
    p = params[0]
    m = torch.randn(p.shape) * 1e-3
    opt.state[p]["exp_avg"] = m
    opt.state[p]["exp_avg_sq"] = torch.zeros(p.shape)
    assert "exp_avg" not in opt.state[p] and "exp_avg_sq" not in opt.state[p]
    codes, scales = formats.encode_m(m.reshape(-1))
    assert torch.equal(opt.state[p]["exp_avg_q"].reshape(-1), codes)
    assert torch.equal(opt.state[p]["exp_avg_scale"], scales)
    saved = opt.state_dict()["state"][0]
    torch.testing.assert_close(saved["exp_avg"], formats.decode_m(codes, scales).reshape(p.shape),
                               rtol=0, atol=0)  # fmt: skip
    assert int(saved["exp_avg_sq"].count_nonzero()) == 0
    with pytest.raises(ValueError, match=r"'exp_avg_q' has shape"):
        opt.state[p]["exp_avg"] = torch.zeros(3)
    with pytest.raises(TypeError, match="assign a tensor"):
        opt.state[p]["exp_avg"] = 0.0


def test_reading_torchs_moment_keys_under_int8_state_says_how_to_read_them():
    """A user's find: opt.state[p]["exp_avg"] under int8 state was a bare KeyError. It is still a
    KeyError (the key is not there: no decoded copy whose in-place edits would be lost), and it
    names the decode that gives state_dict()'s fp32 values."""
    from offloadopt.kernels import formats

    params = make_params()
    opt = run(params, 2, state_dtype="int8")
    p = params[0]
    st = opt.state[p]
    saved = opt.state_dict()["state"][0]
    for key, decode in (("exp_avg", formats.decode_m), ("exp_avg_sq", formats.decode_v)):
        with pytest.raises(
            KeyError, match=rf"formats\.{decode.__name__}\(state\['{key}_q'\]\.flatten\(\)"
        ):
            st[key]
        value = decode(st[f"{key}_q"].flatten(), st[f"{key}_scale"])  # the message's recipe
        assert torch.equal(value.reshape(p.shape), saved[key])
        assert st.get(key) is None and key not in st
    with pytest.raises(KeyError, match="^'nope'$"):
        st["nope"]


def test_a_value_that_would_wrap_in_the_int8_codes_is_refused_and_changes_nothing():
    """A fresh user's finding (issue 44): float values assigned to the codes were accepted and
    wrapped (300.0 became 44, -1 became 255, NaN 0). Refused now, naming torch's key instead;
    through a whole entry and ``opt.state = ...`` too, before anything is cleared."""
    params = make_params()
    opt = run(params, 2, state_dtype="int8")
    p = params[0]
    before = {q: {k: v.clone() for k, v in opt.state[q].items()} for q in params}
    for bad in (torch.full(p.shape, 300.0), torch.full(p.shape, -1, dtype=torch.int64), 300.0):
        with pytest.raises(TypeError, match=r"'exp_avg_q'\] = .*would wrap.*'exp_avg'"):
            opt.state[p]["exp_avg_q"] = bad
    with pytest.raises(TypeError, match="would wrap"):
        opt.state[p] = {**before[p], "exp_avg_sq_q": before[p]["exp_avg_sq_q"].float()}
    with pytest.raises(TypeError, match="would wrap"):
        opt.state = {**before, p: {**before[p], "exp_avg_q": before[p]["exp_avg_q"].float()}}
    for q in params:
        for k, v in before[q].items():
            torch.testing.assert_close(opt.state[q][k], v, rtol=0, atol=0)
    opt.state[p]["exp_avg_q"] = before[p]["exp_avg_q"].clone()  # uint8 codes: taken as they are


def test_the_documented_exp_avg_sq_overflow_threshold_under_int8():
    """docs/compressed-state.md said |g| above 1.8e19 (where g * g overflows); the update takes
    (1 - beta2) * g first, so exp_avg_sq stays finite up to sqrt(3.4e38 / (1 - beta2)), about
    5.83e20 with beta2 0.999 (issue 44), and its block's weights turn NaN above it."""
    text = (Path(__file__).parents[1] / "docs" / "compressed-state.md").read_text()
    assert "above about 5.8e20 with the default betas" in text
    for g, finite in ((5.8e20, True), (5.9e20, False)):
        p = torch.nn.Parameter(torch.zeros(512))
        opt = HybridAdamW([p], state_dtype="int8", offload_fraction=1.0, min_offload_numel=1)
        p.grad = torch.full((512,), g)
        opt.step()
        assert bool(opt.state_dict()["state"][0]["exp_avg_sq"].isfinite().all()) is finite, g
        p.grad = torch.ones(512)
        opt.step()
        assert bool(p.isfinite().all()) is finite, g
        opt.close()


def test_fsdp2_params_are_refused_with_compressed_state(monkeypatch):
    from offloadopt.place import placer

    monkeypatch.setattr(placer, "is_dtensor", lambda p: True)
    with pytest.raises(NotImplementedError, match=r"state \(state_dtype='int8'\) with FSDP2"):
        HybridAdamW([torch.nn.Parameter(torch.zeros(4))], state_dtype="int8")
    with pytest.raises(NotImplementedError, match=r"state \(master_weights='bf16-sr'\) with FSDP2"):
        HybridAdamW([torch.nn.Parameter(torch.zeros(4).bfloat16())], master_weights="bf16-sr")


@pytest.mark.parametrize(
    "dtype, kw, match",
    [
        (torch.float16, dict(master_weights="bf16-sr"), "torch.float16"),
        (torch.float64, dict(state_dtype="int8"), "torch.float64"),
        (torch.float64, dict(master_weights="bf16-sr"), "torch.float64"),
    ],
)
def test_params_the_kernel_cannot_update_are_refused_when_added(dtype, kw, match):
    # Found by trying it: these were accepted, and the first step() failed in the kernel
    # (on the worker, for offloaded params).
    ok = torch.nn.Parameter(torch.zeros(8, dtype=torch.bfloat16))
    bad = torch.nn.Parameter(torch.zeros(8, dtype=dtype))
    with pytest.raises(ValueError, match=match):
        HybridAdamW([ok, bad], **kw)
    opt = HybridAdamW([ok], **kw)
    with pytest.raises(ValueError, match=match):
        opt.add_param_group({"params": [bad]})
    assert len(opt.param_groups) == 1
    opt.close()


@pytest.mark.parametrize("fraction", [0.0, 1.0])
@pytest.mark.parametrize(
    "start, cast, kw",
    [
        (torch.float32, torch.float64, dict(state_dtype="int8")),
        (torch.float32, torch.float64, dict(state_dtype="bf16")),
        (torch.bfloat16, torch.float16, dict(master_weights="bf16-sr")),
        (torch.bfloat16, torch.float64, dict(master_weights="bf16-sr", state_dtype="int8")),
    ],
)
def test_a_cast_to_a_dtype_the_kernel_cannot_update_is_refused_before_anything_changes(
    fraction, start, cast, kw
):
    # A user's finding: a model cast after the optimizer was built, to a dtype the
    # construction refuses, was placed again at step() in its new dtype; the kernel failed
    # ("masters[0] has dtype Double; expected float32 (as masters[0])", no param named) with
    # the new dtype's state made, so casting the model back was refused too. A load from a
    # torch checkpoint failed part-way and left the optimizer refusing every step.
    params = [torch.nn.Parameter(torch.randn(300, generator=torch.Generator().manual_seed(i)).to(start))
              for i in range(2)]  # fmt: skip
    opt = HybridAdamW(params, offload_fraction=fraction, min_offload_numel=64, **kw)
    for p in params:
        p.data = p.data.to(cast)  # as model.to(cast) does
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in params]
    match = rf"param group 0, param 0 \(group0\.param0, cast from {start} .*is {cast}.*cast the model back to {start}"
    with pytest.raises(ValueError, match=match):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True)) and not opt.state
    ref = torch.optim.AdamW([torch.nn.Parameter(p.detach().clone()) for p in params], fused=True)
    for q in ref.param_groups[0]["params"]:
        q.grad = torch.ones_like(q)
    ref.step()
    with pytest.raises(ValueError, match=match):  # refused before the load changes anything
        opt.load_state_dict(ref.state_dict())
    assert not opt.state
    for p in params:  # cast back: steps as one built now would
        p.data, p.grad = p.data.to(start), torch.ones_like(p, dtype=start)
    opt.step()
    assert all(int(opt.state[p]["step"]) == 1 for p in params)
    opt.close()


@pytest.mark.parametrize("fraction", [0.0, 1.0])
@pytest.mark.parametrize("kw", [dict(state_dtype="int8"), dict(master_weights="bf16-sr")])
def test_a_grad_in_another_dtype_than_its_param_is_refused_at_every_fraction(fraction, kw):
    # A user's finding: with p.grad_dtype = torch.float32 on a bf16 param, an offloaded grad
    # crossed the link in bf16 while one on the device was used whole: the bits depended on
    # the fraction (torch's fused AdamW refuses such a grad).
    p = torch.nn.Parameter(torch.randn(300, generator=torch.Generator().manual_seed(0)).bfloat16())
    try:
        p.grad_dtype = torch.float32
    except (AttributeError, TypeError):
        pytest.skip("this torch has no Tensor.grad_dtype (a grad always has its param's dtype)")
    opt = HybridAdamW([p], offload_fraction=fraction, min_offload_numel=64, **kw)
    p.grad = torch.ones(300)
    before = p.detach().clone()
    with pytest.raises(
        RuntimeError,
        match=r"the grad of group0\.param0 is torch\.float32, the param torch\.bfloat16",
    ):
        opt.step()
    assert torch.equal(p, before) and not opt.state
    p.grad_dtype = None
    p.grad = torch.ones(300, dtype=torch.bfloat16)
    opt.step()
    assert int(opt.state[p]["step"]) == 1
    opt.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_codes_that_no_longer_match_the_moments_give_way_to_them(dtype):
    # int8 checkpoint -> torch.optim.AdamW (which casts the codes to the param's dtype and
    # keeps them), a few steps, its checkpoint -> int8 again: refused ("'exp_avg_q' is
    # torch.float32"), or with uint8 codes the stale codes won over torch's new moments.
    params = make_params(dtype)
    sd = run(params, 2, state_dtype="int8").state_dict()
    theirs_params = [p.detach().clone().requires_grad_() for p in params]
    theirs = torch.optim.AdamW(groups_of(theirs_params), fused=True)
    theirs.load_state_dict(torch.load(_saved(sd), weights_only=True))
    for step in range(2, 5):
        for p, g in zip(theirs_params, seeded_grads(theirs_params, step), strict=True):
            p.grad = g.to(p.dtype)
        theirs.step()
    later = torch.load(_saved(theirs.state_dict()), weights_only=True)
    stripped = {**later, "state": {i: {k: v for k, v in e.items() if not k.endswith(("_q", "_scale"))}
                                   for i, e in later["state"].items()}}  # fmt: skip
    edited = {
        **sd,
        "state": {i: {**e, "exp_avg": e["exp_avg"] * 2} for i, e in sd["state"].items()},
    }
    for ckpt, clean in ((later, stripped), (edited, None)):
        a = hybrid(make_params(dtype), 1.0, state_dtype="int8")
        a.load_state_dict(ckpt)
        if clean is None:  # uint8 codes beside moments they do not encode: the moments win
            clean = {**ckpt, "state": {i: {k: v for k, v in e.items() if not k.endswith(("_q", "_scale"))}
                                       for i, e in ckpt["state"].items()}}  # fmt: skip
        b = hybrid(make_params(dtype), 1.0, state_dtype="int8")
        b.load_state_dict(clean)
        for i, (x, y) in enumerate(
            zip(a.state_dict()["state"].values(), b.state_dict()["state"].values(), strict=False)
        ):
            for k in ("exp_avg_q", "exp_avg_scale", "exp_avg_sq_q", "exp_avg_sq_scale"):
                assert torch.equal(x[k], y[k]), (i, k)


def test_a_group_key_for_the_representation_is_refused_not_ignored():
    with pytest.raises(ValueError, match="state_dtype='int4'.*per optimizer"):
        HybridAdamW([{"params": [torch.nn.Parameter(torch.zeros(4))], "state_dtype": "int4"}])
    opt = HybridAdamW([torch.nn.Parameter(torch.zeros(4))], state_dtype="int8")
    with pytest.raises(ValueError, match="master_weights"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(4))],
                             "master_weights": "bf16-sr"})  # fmt: skip
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("kw,dtype", SETTINGS[1:2] + SETTINGS[4:])
def test_set_offload_fraction_moves_compressed_state_without_loss(kw, dtype):
    steady, moved = make_params(dtype), make_params(dtype)
    run(steady, 6, **kw)
    opt = run(moved, 3, **kw)
    opt.set_offload_fraction(0.5)  # the state moves between the host arenas and the device
    run(moved, 3, start=3, opt=opt)
    assert any(not r.offloaded for p, r in opt.debug.records.items() if p.numel() >= 64)
    assert_same([p.detach() for p in moved], [p.detach() for p in steady])


def test_bf16_sr_without_a_bf16_param_says_it_does_nothing():
    """master_weights='bf16-sr' acts on bf16 params only: on an fp32 model it is a no-op, which
    the user hears about once, at construction; with a bf16 param there is nothing to say."""
    fp32 = [torch.nn.Parameter(torch.randn(300))]
    with pytest.warns(UserWarning, match="master_weights='bf16-sr' has no bf16 param to act on"):
        HybridAdamW(fp32, lr=1e-2, master_weights="bf16-sr")
    mixed = [torch.nn.Parameter(torch.randn(300)), torch.nn.Parameter(torch.randn(8).bfloat16())]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        HybridAdamW(mixed, lr=1e-2, master_weights="bf16-sr")


def _conv_and_mixed(fraction, kind):
    torch.manual_seed(0)
    if kind == "channels-last-bf16":
        m = torch.nn.Conv2d(16, 32, 3).to(torch.bfloat16).to(memory_format=torch.channels_last)
        x = torch.randn(2, 16, 8, 8).to(torch.bfloat16).to(memory_format=torch.channels_last)
    else:  # fp16 and bf16 params in one group, both with fp32 masters
        m = torch.nn.Sequential(torch.nn.Linear(48, 40).half(), torch.nn.Linear(40, 8))
        m[1].to(torch.bfloat16)
        x = torch.randn(4, 48).half()
    opt = HybridAdamW(m.parameters(), lr=1e-2, state_dtype="int8", offload_fraction=fraction,
                      min_offload_numel=1)  # fmt: skip
    for _ in range(3):
        out = m(x) if kind != "fp16-and-bf16" else m[1](m[0](x).to(torch.bfloat16))
        out.float().square().mean().backward()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a non-contiguous param stays on the device
            opt.step()
        opt.zero_grad()
    opt.synchronize()
    return [p.detach().clone() for p in m.parameters()]


@pytest.mark.parametrize("kind", ["channels-last-bf16", "fp16-and-bf16"])
def test_params_the_flat_kernels_cannot_walk_directly_still_update(kind):
    """A fresh user's crashes under int8 state with fp32 masters: a channels_last bf16 conv
    weight (its fp32 master kept the param's strides, which the flat kernels cannot walk) and
    fp16 params resident on the device (their fp16 grads went to the one-call path, which
    reads fp32 or bf16 grads only). Every fraction gives the same bits."""
    results = [_conv_and_mixed(f, kind) for f in (0.0, 0.5, 1.0)]
    for other in results[1:]:
        assert_same(other, results[0], kind)


def test_fsdp2_refusal_gives_each_settings_own_reason():
    """A user's find: FSDP2 with master_weights='bf16-sr' was refused for "per-block scales",
    which bf16-sr does not have, with an unexplained count. Each setting now names its own
    reason, and the count says what it counts."""
    from offloadopt.shards import refuse_sharded

    shards = [torch.zeros(1)] * 4
    with pytest.raises(NotImplementedError) as sr:
        refuse_sharded(shards, "fp32", True)
    msg = str(sr.value)
    assert "master_weights='bf16-sr'" in msg and "per-block scales" not in msg
    assert "element's index in the whole tensor" in msg and "(4 of the params are DTensor" in msg
    with pytest.raises(NotImplementedError, match="int8's per-block scales"):
        refuse_sharded(shards, "int8", False)
    with pytest.raises(NotImplementedError) as both:
        refuse_sharded(shards, "bf16", True)
    assert str(both.value).count("which a shard does not know") == 1  # the reason once
    refuse_sharded([], "int8", True)  # nothing sharded: nothing refused
