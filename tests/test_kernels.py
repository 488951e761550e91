"""offloadopt.kernels: the fused CPU Adam/AdamW kernel for compressed optimizer state against
torch's fused kernel (bitwise, all-fp32 mode) and against the plain-torch reference (bf16 and
int8 state), the int8 block formats, and the kernel's input checks. The extension is built once
per session (about a minute the first time; a missing compiler fails these tests)."""

from __future__ import annotations

import itertools
import os
import re
from pathlib import Path

import pytest
import torch

from offloadopt import kernels
from offloadopt.kernels import formats, reference
from offloadopt.kernels.rounding import DRAW_MASTER, master_bits, sr_bits, sr_key

SIZES = [1, 2, 3, 5, 7, 8, 9, 15, 16, 17, 31, 33, 63, 64, 65, 100, 255, 256, 257, 1000, 1023, 4099]


@pytest.fixture(scope="module")
def mod():
    return kernels.load()


def rand_state(sizes, seed=0, mdtype=torch.float32, gdtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in sizes:
        p = torch.randn(n, generator=gen).to(mdtype)
        g = (torch.randn(n, generator=gen) * 0.1).to(gdtype)
        m = torch.randn(n, generator=gen) * 0.01
        v = torch.rand(n, generator=gen) * 1e-3
        out.append((p, g, m, v))
    return out


HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.1, eps=1e-8, maximize=False,
          decoupled=True, grad_scale=None)  # fmt: skip


def kcall(fn, masters, grads, ms, vs, *, sms=(), svs=(), wout=(), steps=None, salts=None,
          offsets=None, moments=0, master_sr=False, flush_denormal=False, backups=(), **hp):  # fmt: skip
    t = len(masters)
    h = dict(HP, **hp)
    fn(list(masters), list(grads), list(ms), list(vs), list(sms), list(svs), list(wout),
       steps if steps is not None else [1.0] * t, salts if salts is not None else [7] * t,
       offsets if offsets is not None else [0] * t, h["lr"], h["beta1"], h["beta2"],
       h["weight_decay"], h["eps"], h["maximize"], h["decoupled"], h["grad_scale"], moments,
       master_sr, kernels.torch_vec_size(), flush_denormal,
       **({"backups": list(backups)} if backups else {}))  # fmt: skip


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def assert_bitwise(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    bad = (bits(a) != bits(b)).nonzero().flatten()
    assert bad.numel() == 0, (
        f"{what}: {bad.numel()}/{a.numel()} differ, first at {bad[:5].tolist()}"
    )


# --- all-fp32 mode: bitwise parity with torch._fused_adam(w)_ -----------------------------

CASES = list(itertools.product([True, False], [0.0, 0.1], [False, True], [None, 3.0],
                               [1.0, 1000.0], [torch.float32, torch.bfloat16]))  # fmt: skip


@pytest.mark.parametrize("decoupled,wd,maximize,gs,step,gdtype", CASES)
def test_fp32_mode_is_bitwise_torch_fused(mod, decoupled, wd, maximize, gs, step, gdtype):
    state = rand_state(SIZES, seed=int(step) + int(wd * 10), gdtype=gdtype)
    beta1 = 0.3 if maximize else 0.9  # 1 - beta1 >= 0.5: the lerp's other branch
    hp = dict(lr=2e-3, beta1=beta1, beta2=0.999, weight_decay=wd, eps=1e-8, maximize=maximize)
    tp, tg, tm, tv = ([s[k].float().clone() for s in state] for k in range(4))
    fused = torch._fused_adamw_ if decoupled else torch._fused_adam_
    fused(tp, tg, tm, tv, [], [torch.tensor(step)] * len(tp), amsgrad=False, **hp,
          grad_scale=None if gs is None else torch.tensor(gs), found_inf=None)  # fmt: skip
    kp, kg, km, kv = ([s[k].clone() for s in state] for k in range(4))
    wout = [torch.empty(p.numel(), dtype=torch.bfloat16) for p in kp]
    kcall(mod.adam_step, kp, kg, km, kv, wout=wout, steps=[step] * len(kp), decoupled=decoupled,
          grad_scale=gs, **hp)  # fmt: skip
    for i, n in enumerate(SIZES):
        assert_bitwise(kp[i], tp[i], f"param n={n}")
        assert_bitwise(km[i], tm[i], f"exp_avg n={n}")
        assert_bitwise(kv[i], tv[i], f"exp_avg_sq n={n}")
        assert_bitwise(wout[i], tp[i].to(torch.bfloat16), f"weights_out n={n}")
        assert_bitwise(kg[i], state[i][1], f"grad n={n} (read only)")


def test_fp32_mode_parity_holds_over_steps_and_with_threads(mod):
    """Three steps in a row on long tensors (one over a loop run of 4,096 blocks) and short
    ones, at 1 and 2 threads."""
    sizes = [70_001, 13, 4096, 24, 1_100_007]
    for threads in (1, 2):
        old = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            state = rand_state(sizes, seed=threads)
            tp, tg, tm, tv = ([s[k].clone() for s in state] for k in range(4))
            kp, kg, km, kv = ([s[k].clone() for s in state] for k in range(4))
            for step in (1.0, 2.0, 3.0):
                torch._fused_adamw_(tp, [g.clone() for g in tg], tm, tv, [],
                                    [torch.tensor(step)] * 5, amsgrad=False, lr=1e-3, beta1=0.9,
                                    beta2=0.95, weight_decay=0.1, eps=1e-8, maximize=False)  # fmt: skip
                kcall(mod.adam_step, kp, kg, km, kv, steps=[step] * 5, beta2=0.95)
            for i in range(5):
                assert_bitwise(kp[i], tp[i], f"threads={threads} param {i}")
                assert_bitwise(kv[i], tv[i], f"threads={threads} exp_avg_sq {i}")
        finally:
            torch.set_num_threads(old)


def test_reference_fp32_mode_is_close_to_torch():
    state = rand_state([5000], seed=3)
    tp, tg, tm, tv = ([s[k].clone() for s in state] for k in range(4))
    rp, rg, rm, rv = ([s[k].clone() for s in state] for k in range(4))
    torch._fused_adamw_(tp, tg, tm, tv, [], [torch.tensor(5.0)], amsgrad=False, lr=1e-3,
                        beta1=0.9, beta2=0.999, weight_decay=0.1, eps=1e-8, maximize=False)  # fmt: skip
    kcall(reference.adam_step, rp, rg, rm, rv, steps=[5.0])
    torch.testing.assert_close(rp[0], tp[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(rm[0], tm[0], rtol=1e-6, atol=0)
    torch.testing.assert_close(rv[0], tv[0], rtol=1e-6, atol=0)


# --- bf16 state and bf16 masters (stochastic rounding) vs the reference ---------------------


def ulp_diff_bf16(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (bits(a).to(torch.int32) - bits(b).to(torch.int32)).abs()


def assert_bf16_near(a, b, what):
    """Equal, except at most 0.1% of elements 1 bf16 ulp apart: the kernel and the reference
    draw the same random bits but may differ by an fp32 ulp before rounding (FMA vs separate
    ops), which moves the rounded result only when the fp32 value sits that close to the
    random threshold."""
    d = ulp_diff_bf16(a, b)
    assert int(d.max()) <= 1, f"{what}: max bf16 ulp difference {int(d.max())}"
    assert int((d != 0).sum()) <= max(1, a.numel() // 1000), f"{what}: {int((d != 0).sum())} differ"


def make_mode(sizes, seed, master_bf16, moments, gdtype=torch.bfloat16):
    state = rand_state(sizes, seed=seed, gdtype=gdtype)
    masters = [s[0].to(torch.bfloat16) if master_bf16 else s[0].clone() for s in state]
    grads = [s[1] for s in state]
    if moments == 0:
        ms, vs, sms, svs = [s[2].clone() for s in state], [s[3].clone() for s in state], [], []
    elif moments == 1:
        ms = [s[2].to(torch.bfloat16) for s in state]
        vs = [s[3].to(torch.bfloat16) for s in state]
        sms, svs = [], []
    else:
        enc_m = [formats.encode_m(s[2]) for s in state]
        enc_v = [formats.encode_v(s[3]) for s in state]
        ms, sms = [c for c, _ in enc_m], [s for _, s in enc_m]
        vs, svs = [c for c, _ in enc_v], [s for _, s in enc_v]
    return masters, grads, ms, vs, sms, svs


def clone_all(x):
    return [[t.clone() for t in lst] for lst in x]


MODES = [(False, 1), (True, 0), (True, 1), (False, 2), (True, 2)]


@pytest.mark.parametrize("master_bf16,moments", MODES)
def test_kernel_matches_reference(mod, master_bf16, moments):
    sizes = [3000, 256, 600, 1]
    a = make_mode(sizes, 11, master_bf16, moments)
    b = clone_all(a)
    # the third tensor's random counter crosses 2^32 mid-block (offset not a block multiple)
    offsets = [0, 256, 2**32 - 100 if moments != 2 else 2**32 - 256, 512]
    kw = dict(steps=[3.0, 3.0, 4.0, 9.0], salts=[1, 2, 3, 2**40 + 5], offsets=offsets,
              moments=moments, master_sr=master_bf16, weight_decay=0.01)  # fmt: skip
    kcall(mod.adam_step, a[0], a[1], a[2], a[3], sms=a[4], svs=a[5], **kw)
    kcall(reference.adam_step, b[0], b[1], b[2], b[3], sms=b[4], svs=b[5], **kw)
    for i in range(len(sizes)):
        if master_bf16:
            assert_bf16_near(a[0][i], b[0][i], f"master {i}")
        else:  # fp32 master: fp32 op order only (a few fp32 ulps after the int8 state)
            torch.testing.assert_close(a[0][i], b[0][i], rtol=2e-6, atol=1e-7)
        if moments == 1:
            assert_bf16_near(a[2][i], b[2][i], f"exp_avg {i}")
            assert_bf16_near(a[3][i], b[3][i], f"exp_avg_sq {i}")
        elif moments == 2:
            for k, name in ((2, "exp_avg"), (3, "exp_avg_sq")):
                ca, cb = a[k][i].to(torch.int32), b[k][i].to(torch.int32)
                eq = (ca == cb).float().mean().item()
                assert eq >= 0.999, f"{name} codes {i}: only {eq:.4%} equal"
                assert int(((ca & 0x7F) - (cb & 0x7F)).abs().max()) <= 1, f"{name} codes {i}"
            torch.testing.assert_close(a[4][i], b[4][i], rtol=1e-6, atol=0)
            torch.testing.assert_close(a[5][i], b[5][i], rtol=1e-6, atol=0)


@pytest.mark.parametrize("moments", [0, 1, 2])
@pytest.mark.parametrize("beta1", [0.9, 0.3])
def test_weights_out_at_any_alignment_gives_the_same_bits(mod, moments, beta1):
    """weights_out aligned for streaming stores or not (a view one element into a buffer), on
    the plain path (beta1 0.9, which decides the store once per span) and the other one (beta1
    0.3): the same bits in every output."""
    sizes = [4099, 256, 70_001]
    gdtype = torch.float32 if moments == 0 else torch.bfloat16
    base = make_mode(sizes, 5, False, moments, gdtype=gdtype)
    results = []
    for shift in (0, 1, 3):
        x = clone_all(base)
        bufs = [torch.full((n + 8,), -1.0, dtype=torch.bfloat16) for n in sizes]
        wout = [b[shift : shift + n] for b, n in zip(bufs, sizes, strict=True)]
        kcall(mod.adam_step, *x[:4], sms=x[4], svs=x[5], wout=wout, steps=[2.0] * len(sizes),
              moments=moments, beta1=beta1)  # fmt: skip
        for b, n in zip(bufs, sizes, strict=True):  # nothing written outside the view
            assert bool((b[:shift] == -1).all()) and bool((b[shift + n :] == -1).all())
        results.append([t.view(torch.uint8) for lst in x + [wout] for t in lst])
    for shift, r in zip((1, 3), results[1:], strict=True):
        for k, (a, b) in enumerate(zip(results[0], r, strict=True)):
            assert torch.equal(a, b), f"weights_out shifted by {shift}: output #{k} differs"


@pytest.mark.parametrize("moments", [0, 1, 2])
@pytest.mark.parametrize("beta1", [0.9, 0.3])
def test_weights_out_of_non_finite_masters(mod, moments, beta1):
    """NaN (payloads that round past the exponent, 0x7FFFFFFF and its negative, among them) and
    inf in grads and masters, at block starts, ends, mid-pair and in a short end: weights_out
    is NaN (0x7FC0, c10's scalar conversion) exactly where the new master is, and torch's
    .to(bfloat16) elsewhere. The plain path rounds without the NaN case and redoes a block or
    span that had a NaN."""
    sizes = [4099, 256, 70_001, 1000]
    gdtype = torch.float32 if moments == 0 else torch.bfloat16
    payload = torch.tensor([0x7FFFFFFF, -1], dtype=torch.int32).view(torch.float32)
    try:
        for isa in mod.isas():
            mod.set_isa(isa)
            x = make_mode(sizes, 7, False, moments, gdtype=gdtype)
            for j in (0, 17, 255, 256, 600, 999):
                x[1][3][j] = float("nan") if j % 2 else float("inf")
            x[0][2][70_000], x[0][2][5], x[1][0][4098] = float("nan"), float("-inf"), float("nan")
            x[0][0][[300, 301]] = payload  # mid-pair, in the plain path's loop
            x[0][2][[512, 69_999]] = payload
            wout = [torch.empty(n, dtype=torch.bfloat16) for n in sizes]
            kcall(mod.adam_step, *x[:4], sms=x[4], svs=x[5], wout=wout, steps=[2.0] * len(sizes),
                  moments=moments, beta1=beta1)  # fmt: skip
            for i in range(len(sizes)):
                nan = torch.isnan(x[0][i])
                assert nan.any() == (i != 1), f"{isa}: masters {i}"  # the second is all finite
                assert torch.equal(torch.isnan(wout[i]), nan), f"{isa}: weights_out {i}"
                want = x[0][i].to(torch.bfloat16)
                want[nan] = torch.tensor(0x7FC0, dtype=torch.int16).view(torch.bfloat16)
                assert_bitwise(wout[i], want, f"{isa}: weights_out {i}")
    finally:
        mod.set_isa(mod.isas()[0])


@pytest.mark.parametrize("master_bf16,moments", [(False, 0)] + MODES)
def test_result_does_not_depend_on_cuts_or_threads(mod, master_bf16, moments):
    """One 1,024-element tensor vs two 512-element pieces (offsets 0 and 512, scale views),
    at 1 and 2 threads: bitwise equal."""
    whole = make_mode([1024], 5, master_bf16, moments)
    results = []
    for threads, cut in ((2, False), (1, False), (2, True), (1, True)):
        x = clone_all(whole)
        old = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            if cut:
                parts = [[t[0][:512], t[0][512:]] for t in x[:4]]
                sc = [[s[0][:2], s[0][2:]] for s in x[4:]] if moments == 2 else [[], []]
                kcall(mod.adam_step, *parts, sms=sc[0], svs=sc[1], steps=[2.0, 2.0],
                      salts=[9, 9], offsets=[0, 512], moments=moments, master_sr=master_bf16)  # fmt: skip
            else:
                kcall(mod.adam_step, *x[:4], sms=x[4], svs=x[5], steps=[2.0], salts=[9],
                      offsets=[0], moments=moments, master_sr=master_bf16)  # fmt: skip
        finally:
            torch.set_num_threads(old)
        results.append(x)
    for r in results[1:]:
        for lst_a, lst_b in zip(results[0], r, strict=True):
            for ta, tb in zip(lst_a, lst_b, strict=True):
                assert_bitwise(ta, tb, "cut/threads")


@pytest.mark.parametrize("master_bf16,moments", [(False, 0)] + MODES)
def test_result_does_not_depend_on_threads_where_chunks_cut_tensors(mod, master_bf16, moments):
    """Threads claim chunks of 16 blocks from a shared counter (adam_step): with 235 blocks in
    five tensors (two with short last blocks) the chunks end inside tensors and a thread's
    chunks are not neighbours. 1, 2, 3 and 5 threads: bitwise equal, and equal to one call per
    tensor (other cuts: a block dropped or done twice at a chunk's edge shows)."""
    whole = make_mode([20000, 256, 17000, 300, 22000], 8, master_bf16, moments)
    kw = dict(steps=[2.0] * 5, salts=[3, 4, 5, 6, 7], offsets=[0, 20000, 20256, 37256, 37556],
              moments=moments, master_sr=master_bf16, weight_decay=0.01)  # fmt: skip
    results = []
    old = torch.get_num_threads()
    try:
        for threads in (1, 2, 3, 5):
            torch.set_num_threads(threads)
            x = clone_all(whole)
            kcall(mod.adam_step, *x[:4], sms=x[4], svs=x[5], **kw)
            results.append(x)
        torch.set_num_threads(3)
        x = clone_all(whole)  # one tensor a call, 3 threads
        for t in range(5):
            one = {k: [v[t]] for k, v in kw.items() if isinstance(v, list)}
            kcall(mod.adam_step, *[[lst[t]] for lst in x[:4]], sms=x[4][t : t + 1], svs=x[5][t : t + 1],
                  **{**kw, **one})  # fmt: skip
        results.append(x)
    finally:
        torch.set_num_threads(old)
    for r in results[1:]:
        for lst_a, lst_b in zip(results[0], r, strict=True):
            for ta, tb in zip(lst_a, lst_b, strict=True):
                assert_bitwise(ta, tb, "threads")


def test_stochastic_rounding_is_unbiased(mod):
    """A bf16 master at 1.0 gets 200 updates of -1e-4 (well below half a bf16 ulp, 2^-8 at 1.0;
    round to nearest would never move it): the mean over 4,096 elements tracks 1 - 0.02."""
    n, steps = 4096, 200
    p = torch.ones(n, dtype=torch.bfloat16)
    m = torch.zeros(n)
    v = torch.zeros(n)
    g = torch.full((n,), 1.0)
    for s in range(1, steps + 1):
        # lr chosen so the update is exactly lr/bc1 * m/(sqrt(v)/sqrt(bc2)+eps) ~= lr for g=1
        kcall(mod.adam_step, [p], [g], [m], [v], steps=[float(s)], salts=[123], lr=1e-4,
              weight_decay=0.0, eps=0.0, master_sr=True)  # fmt: skip
    mean = p.float().mean().item()
    assert abs(mean - (1 - steps * 1e-4)) < 2e-3, mean
    assert p.float().std().item() > 0  # it did round up and down


def test_one_hash_rounds_two_masters():
    """rounding.master_bits: in each run of 8 elements, element 8k + i (i < 4) takes the low 16
    bits of its own counter's hash and element 8k + 4 + i the high 16 bits of the same hash
    (the kernel's lanes, whatever the offset: here one that is not a multiple of 8)."""
    key = sr_key(7, 3.0, DRAW_MASTER)
    index = torch.arange(64, dtype=torch.int64)
    counter = 2**32 - 21 + index  # crosses 2^32
    got = master_bits(key & 0xFFFFFFFF, key >> 32, counter, index) & 0xFFFF
    own = sr_bits(key, counter)
    for j in range(64):
        want = own[j] & 0xFFFF if j % 8 < 4 else own[j - 4] >> 16
        assert int(got[j]) == int(want), j
    assert len(set(got.tolist())) > 60  # 64 draws of 16 bits: the halves are not repeats


def test_flush_denormal_flushes_in_the_kernel_only(mod):
    tiny = 1e-39  # a denormal fp32
    for flush, expect_zero in ((False, False), (True, True)):
        p = torch.full((64,), tiny)
        z = torch.zeros(64)
        kcall(mod.adam_step, [p], [z.clone()], [z.clone()], [z.clone()], weight_decay=0.5,
              lr=1.0, flush_denormal=flush)  # fmt: skip
        assert bool((p == 0).all()) == expect_zero, (flush, p[:3])
    assert (torch.tensor([tiny]) * 0.5).item() != 0  # the caller's thread state restored


# --- int8 formats ---------------------------------------------------------------------------


def test_formats_round_trip_within_the_stated_error():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(10_000, generator=gen) * torch.exp(torch.randn(10_000, generator=gen))
    codes, scales = formats.encode_m(x)
    y = formats.decode_m(codes, scales)
    s = scales.repeat_interleave(formats.BLOCK)[: x.numel()]
    in_range = x.abs() >= s * 2.0**-14
    rel = ((y - x).abs() / x.abs())[in_range]
    assert rel.max().item() <= 1 / 16 + 1e-6, rel.max().item()
    assert torch.equal(torch.sign(y[in_range]), torch.sign(x[in_range]))
    v = x * x
    cv, sv = formats.encode_v(v)
    yv = formats.decode_v(cv, sv).sqrt()
    sq = sv.repeat_interleave(formats.BLOCK)[: x.numel()]
    ok = v.sqrt() >= sq * 2.0**-14
    relv = ((yv - v.sqrt()).abs() / v.sqrt())[ok]
    assert relv.max().item() <= 1 / 32 + 1e-6, relv.max().item()


def test_formats_zero_absmax_and_idempotence():
    x = torch.randn(700)
    x[[3, 300, 650]] = 0.0
    codes, scales = formats.encode_m(x)
    assert codes[[3, 300, 650]].tolist() == [0, 0, 0]
    y = formats.decode_m(codes, scales)
    for b in range(3):
        blk = x[b * 256 : (b + 1) * 256]
        k = int(blk.abs().argmax())
        assert y[b * 256 + k].abs().item() == scales[b].item()
    c2, s2 = formats.encode_m(y)
    assert torch.equal(formats.decode_m(c2, s2), y)
    v = x * x
    cv, sv = formats.encode_v(v)
    assert cv[[3, 300, 650]].tolist() == [0, 0, 0]
    dv = formats.decode_v(cv, sv)
    cv2, sv2 = formats.encode_v(dv)
    assert torch.equal(formats.decode_v(cv2, sv2), dv)
    # a tiny nonzero v never gets code 0; an all-zero block has scale 0 and codes 0
    w = torch.zeros(512)
    w[0], w[1] = 1.0, 1e-30
    cw, sw = formats.encode_v(w)
    assert cw[1].item() == 0x01 and sw[1].item() == 0 and int(cw[256:].max()) == 0


def test_formats_non_finite_block_gets_a_nan_scale():
    x = torch.randn(600)
    x[300] = float("inf")
    codes, scales = formats.encode_m(x)
    assert torch.isnan(scales[1]) and not torch.isnan(scales[0]) and not torch.isnan(scales[2])
    assert int(codes[256:512].max()) == 0
    assert torch.isnan(formats.decode_m(codes, scales)[256:512]).all()


def test_kernel_int8_non_finite_and_zero_blocks(mod):
    n = 768
    p, g = torch.randn(n), torch.zeros(n)
    g[300] = float("nan")
    ms, vs = torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
    sm, sv = torch.zeros(3), torch.zeros(3)
    kcall(mod.adam_step, [p], [g], [ms], [vs], sms=[sm], svs=[sv], moments=2, weight_decay=0.0)
    assert sm[0].item() == 0 and sv[0].item() == 0 and int(ms[:256].max()) == 0
    assert torch.isnan(sm[1]) and torch.isnan(sv[1]) and int(ms[256:512].max()) == 0
    assert sm[2].item() == 0


# --- input checks -----------------------------------------------------------------------------


def bad_calls():
    f32, bf = torch.float32, torch.bfloat16

    def base():
        return dict(masters=[torch.ones(8)], grads=[torch.ones(8)], ms=[torch.zeros(8)],
                    vs=[torch.zeros(8)])  # fmt: skip

    yield "numel", dict(base(), grads=[torch.ones(9)]), "grads[0]"
    yield "contiguous", dict(base(), grads=[torch.ones(16)[::2]]), "contiguous"
    yield "dtype", dict(base(), ms=[torch.zeros(8, dtype=torch.float64)]), "exp_avgs[0]"
    yield "list length", dict(base(), vs=[torch.zeros(8), torch.zeros(8)]), "exp_avg_sqs"
    yield "master_sr fp32", dict(base(), master_sr=True), "master_sr"
    b = base()
    b["masters"] = [torch.ones(8, dtype=bf)]
    yield "wout bf16", dict(b, master_sr=True, wout=[torch.zeros(8, dtype=bf)]), "weights_out"
    yield "bf16 no sr", dict(b), "master_sr"
    q = dict(base(), ms=[torch.zeros(300, dtype=torch.uint8)], vs=[torch.zeros(300, dtype=torch.uint8)],
             masters=[torch.ones(300)], grads=[torch.ones(300)], moments=2)  # fmt: skip
    yield "scale length", dict(q, sms=[torch.zeros(1)], svs=[torch.zeros(2)]), "exp_avg_scales[0]"
    yield "scales count", dict(q, sms=[], svs=[torch.zeros(2)]), "exp_avg_scales"
    yield "2-D", dict(base(), masters=[torch.ones(2, 4)]), "1-D"
    yield "backups count", dict(base(), backups=[torch.zeros(8)] * 2), "backups has 2 entries"
    yield "backup dtype", dict(base(), backups=[torch.zeros(8, dtype=bf), torch.zeros(8),
                                                torch.zeros(8)]), "backups[0]"  # fmt: skip
    yield "backup numel", dict(base(), backups=[torch.zeros(8), torch.zeros(7), torch.zeros(8)]), "backups[1]"  # fmt: skip
    assert f32  # both dtypes used above


@pytest.mark.parametrize("case", list(bad_calls()), ids=lambda c: c[0])
def test_bad_input_is_refused_before_writing(mod, case):
    _, kw, needle = case
    masters = kw.pop("masters")
    before = [m.clone() for m in masters]
    with pytest.raises((ValueError, RuntimeError), match=re.escape(needle)):
        kcall(mod.adam_step, masters, kw.pop("grads"), kw.pop("ms"), kw.pop("vs"), **kw)
    for a, b in zip(masters, before, strict=True):
        assert torch.equal(a, b)


SPECS = {0: (torch.float32, None), 1: (torch.bfloat16, None), 2: (torch.uint8, 1)}


@pytest.mark.parametrize("stream", [True, False], ids=["streaming-stores", "plain-stores"])
@pytest.mark.parametrize("moments,master_bf16", [(0, False), (1, False), (2, False), (2, True)])
def test_backups_receive_the_pre_step_values_and_change_no_result(
    mod, moments, master_bf16, stream
):
    """The kernel's ``backups`` (speculative updates): each receives the values its tensor held
    before the call, byte for byte, and the update is bitwise the one without backups; sizes
    across a run of 16 blocks, a block and a vector."""
    sizes = [1, 7, 17, 255, 256, 1000, 4096, 4097, 70_001]
    mdt = torch.bfloat16 if master_bf16 else torch.float32

    def fresh():
        gen = torch.Generator().manual_seed(5)
        out = []
        for n in sizes:
            p = torch.randn(n, generator=gen).to(mdt)
            g = torch.randn(n, generator=gen) * 0.1
            if moments == 2:
                m = torch.randint(0, 255, (n,), generator=gen, dtype=torch.uint8)
                v = torch.randint(0, 255, (n,), generator=gen, dtype=torch.uint8)
                sm, sv = torch.rand(kernels.nblocks(n), generator=gen), torch.rand(kernels.nblocks(n), generator=gen)  # fmt: skip
            else:
                dt = SPECS[moments][0]
                m = (torch.randn(n, generator=gen) * 0.01).to(dt)
                v = (torch.rand(n, generator=gen) * 1e-3).to(dt)
                sm = sv = None
            out.append((p, g, m, v, sm, sv))
        return out

    def call(state, backups=()):
        cols = list(zip(*state, strict=True))
        sms, svs = (cols[4], cols[5]) if moments == 2 else ((), ())
        kcall(mod.adam_step, cols[0], cols[1], cols[2], cols[3], sms=sms, svs=svs, steps=[3.0] * len(sizes),
              moments=moments, master_sr=master_bf16, backups=backups)  # fmt: skip

    want, got = fresh(), fresh()
    before = [[t.clone() for t in row if t is not None] for row in got]
    backups = [torch.full_like(t, 3) for row in before for t in ([*row[:1], *row[2:]])]
    call(want)
    mod.set_backup_stream(stream)
    try:
        call(got, backups)
    finally:
        mod.set_backup_stream(True)
    per = 5 if moments == 2 else 3
    for i, n in enumerate(sizes):
        for a, b in zip(got[i], want[i], strict=True):
            if a is not None:
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"n={n} changed"
        pre = [before[i][0], *before[i][2:]]  # master, m, v (, scales), the grad left out
        for k in range(per):
            assert torch.equal(backups[per * i + k].view(torch.uint8), pre[k].view(torch.uint8)), (
                n,
                k,
            )


def test_kernel_uses_every_thread(mod):
    """A parallel region of the extension runs on torch.get_num_threads() threads (built
    without OpenMP, at::parallel_for would run on one)."""
    old = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            assert mod.num_threads_used() == threads
    finally:
        torch.set_num_threads(old)


# --- building ---------------------------------------------------------------------------------


@pytest.mark.parametrize("cxx", ["/nonexistent/g++", "false"])
def test_build_failure_is_one_clear_line(tmp_path, monkeypatch, cxx):
    monkeypatch.setenv("CXX", cxx)
    with pytest.raises(kernels.KernelBuildError) as info:
        kernels._build(tmp_path / "build")
    msg = str(info.value)
    assert "\n" not in msg
    assert "install g++" in msg and "ninja" in msg and "the build said:" in msg
    assert os.environ["CXX"] == cxx


@pytest.mark.slow
def test_a_baton_left_by_a_killed_build_does_not_hang_the_next_one(mod, tmp_path):
    """A build killed part-way leaves torch's baton (``<build dir>/lock``); torch's loader waits
    for it to go, forever. A fresh process that finds one while it holds offloadopt's flock
    removes it and loads the kernel (here from the finished build of this session's tests)."""
    import subprocess
    import sys

    directory = kernels.build_dir()
    (directory / "lock").touch()
    code = "from offloadopt import kernels; kernels.load(); print('loaded')"
    env = {**os.environ, "OFFLOADOPT_KERNEL_DIR": str(directory)}
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=240, env=env)  # fmt: skip
    finally:
        (directory / "lock").unlink(missing_ok=True)
    assert r.returncode == 0 and r.stdout.strip() == "loaded", r.stderr[-2000:]


def test_kernel_int8_encoding_equals_formats_on_ties_and_edges(mod):
    """beta1 = beta2 = 0 and lr = 0 make the new exp_avg = g and exp_avg_sq = g*g exactly
    (sqrt(g*g) == |g|), so the kernel's codes must equal formats' bit for bit on values placed
    on exact rounding ties, just below the smallest code, and on zero."""
    ties_m = [1 + (2 * f + 1) / 16 for f in range(8)]  # halfway between 3-bit mantissas
    ties_v = [1 + (2 * f + 1) / 32 for f in range(16)]  # halfway between 4-bit mantissas
    vals = [1.0]
    for e in (1, 3, 9, 14):
        vals += [t * 2.0**-e for t in ties_m + ties_v]
    vals += [2.0**-15, 2.0**-15 * 1.5, 2.0**-16, 1e-7, 1e-18, 0.0, -0.0, 2.0**-14]
    g = torch.tensor(vals * 3, dtype=torch.float32)
    g = torch.cat([g, -g, g * 3.0])
    n = g.numel()
    cm, cv = torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
    sm, sv = torch.zeros(kernels.nblocks(n)), torch.zeros(kernels.nblocks(n))
    p = torch.zeros(n)
    kcall(mod.adam_step, [p], [g], [cm], [cv], sms=[sm], svs=[sv], moments=2, lr=0.0,
          beta1=0.0, beta2=0.0, weight_decay=0.0)  # fmt: skip
    em, esm = formats.encode_m(g)
    ev, esv = formats.encode_v(g * g)
    assert torch.equal(torch.sqrt(g * g), g.abs())
    assert_bitwise(sm, esm, "exp_avg scales")
    assert_bitwise(sv, esv, "exp_avg_sq scales")
    assert torch.equal(cm, em), (cm != em).nonzero().flatten()[:5]
    assert torch.equal(cv, ev), (cv != ev).nonzero().flatten()[:5]
    # the formats' own choices on these edges
    # (ties round up; the smallest m value is 2^-15 * 9/8, zero below 2^-15 * 17/16, its sign
    # kept; the smallest nonzero v code 0x01, 2^-15 * 17/16)
    tiny = 2.0**-15
    t = [1.0, 1.0625 * 2**-3, 1.1875 * 2**-3, tiny * 1.125, tiny * 1.0625, tiny, tiny / 2, 1e-18]
    one = torch.tensor(t + [0.0])
    c, _ = formats.encode_m(one)
    assert c.tolist() == [15 << 3, (12 << 3) | 1, (12 << 3) | 2, 1, 1, 0, 0, 0, 0]
    c, _ = formats.encode_m(-one)
    assert c.tolist() == [0xF8, 0xE1, 0xE2, 0x81, 0x81, 0x80, 0, 0, 0]
    d = formats.decode_m(c, torch.ones(1))
    assert d.tolist()[3:6] == [-tiny * 1.125, -tiny * 1.125, 0.0] and torch.signbit(d[5])
    assert not d[6:].signbit().any()
    c, _ = formats.encode_v(one * one)
    assert c.tolist() == [15 << 4, (12 << 4) | 1, (12 << 4) | 3, 2, 1, 1, 1, 1, 0]


def test_available_is_false_not_an_exception_when_the_build_fails(monkeypatch):
    def fail():
        raise kernels.KernelBuildError("offloadopt: ... the build said: no compiler")

    monkeypatch.setattr(kernels, "load", fail)
    assert kernels.available() is False


def test_a_compiler_error_is_named_in_the_one_line(tmp_path, monkeypatch):
    bad = tmp_path / "bad.cpp"
    bad.write_text("int broken = ;\n")
    monkeypatch.setattr(kernels, "SOURCE", bad)
    with pytest.raises(kernels.KernelBuildError) as info:
        kernels._build(tmp_path / "build")
    msg = str(info.value)
    assert "\n" not in msg and "bad.cpp" in msg and "error" in msg, msg


@pytest.mark.slow
def test_the_benchmark_runs_at_a_tiny_size(mod):
    """benchmarks/cpu_kernel.py as a user runs it (a program: no test imports a benchmark)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "cpu_kernel.py"
    for extra in ([], ["--paired"]):  # --paired: each mode's calls alternate with torch's
        r = subprocess.run([sys.executable, str(script), "--numel", "5000", "--repeats", "3", *extra],
                           capture_output=True, text=True, timeout=300)  # fmt: skip
        assert r.returncode == 0, r.stderr[-2000:]
        for row in ["torch fused fp32", "ours fp32", "fp32m int8 state", "bf16m int8 state"]:
            assert row in r.stdout, r.stdout
        # the pairs' quartiles: printed with --paired only, one "lo-hi" a mode row
        assert ("x torch lo-hi" in r.stdout) == bool(extra), r.stdout
        assert len(re.findall(r"x +\d+\.\d\d-\d+\.\d\d$", r.stdout, re.M)) == (5 if extra else 0), (
            r.stdout
        )


def test_two_differently_started_processes_reuse_one_build(mod, tmp_path):
    """A finished build is imported as it is, whoever asks: a process started elsewhere, with
    another environment and no compiler at all (CXX names none), loads the build these tests
    made, without a rebuild or its notice (pytest and a script took turns rebuilding it when
    torch's loader ran ninja on every load: a fresh user's finding)."""
    import subprocess
    import sys

    code = ("from offloadopt import kernels; m = kernels.load(); "
            "print(kernels.build_dir(), m.isa())")  # fmt: skip
    env = {
        **os.environ,
        "CXX": "/nonexistent/g++",
        "CXXFLAGS": "-O0",
        "PYTHONDONTWRITEBYTECODE": "1",
    }  # OFFLOADOPT_KERNEL_DIR, where set, is kept: both then use that folder (a fresh user's
    # finding: the test failed when it was set)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240,
                       env=env, cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert "building" not in r.stderr, r.stderr
    assert r.stdout.split() == [str(kernels.build_dir()), mod.isa()]


def test_the_cache_key_names_what_the_build_depends_on(tmp_path, monkeypatch):
    """The same sources at another path share the key (one build per torch version and Python,
    not per checkout); a changed header or torch changes it."""
    mine = kernels.cache_key()
    copy = tmp_path / "adam_cpu.cpp"
    copy.write_bytes(kernels.SOURCE.read_bytes())
    monkeypatch.setattr(kernels, "SOURCE", copy)
    assert kernels.cache_key() == mine
    header = tmp_path / "simd.h"
    header.write_bytes(kernels.HEADERS[0].read_bytes() + b"// changed\n")
    monkeypatch.setattr(kernels, "HEADERS", [header, *kernels.HEADERS[1:]])
    assert kernels.cache_key() != mine
    monkeypatch.undo()
    monkeypatch.setattr(torch, "__version__", torch.__version__ + ".other")
    assert kernels.cache_key() != mine


def test_the_cache_key_hashes_every_header_the_source_includes():
    """Each header adam_cpu.cpp includes from cpu/ is in HEADERS (whose bytes the cache key
    hashes): a header left out would leave a stale build in use after it changed."""
    included = set(re.findall(r'#include "(cpu/[\w.]+)"', kernels.SOURCE.read_text()))
    on_disk = {f"cpu/{p.name}" for p in (kernels.SOURCE.parent / "cpu").glob("*.h")}
    hashed = {f"cpu/{p.name}" for p in kernels.HEADERS}
    assert included == on_disk == hashed, (included, on_disk, hashed)


def test_every_build_says_so_with_its_time(tmp_path, monkeypatch, capsys):
    """The notice shows whenever a build runs (a build over a stale one too), and a finished
    build is only imported."""
    from torch.utils import cpp_extension

    builds = []

    def fake_load(name, build_directory, **_):
        builds.append(name)
        (Path(build_directory) / f"{name}.so").write_bytes(b"")
        return "module"

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    monkeypatch.setattr(kernels, "_import", lambda path, name: ("imported", name))
    directory = tmp_path / "build"
    assert kernels._build(directory) == "module"
    err = capsys.readouterr().err
    assert "building offloadopt's CPU kernel" in err and "built offloadopt's CPU kernel in" in err
    assert kernels._build(directory)[0] == "imported"
    assert capsys.readouterr().err == ""
    (directory / kernels.STAMP).write_text("offloadopt_adam_cpu_0000 built in 1 s\n")  # stale
    assert kernels._build(directory) == "module"
    assert "building offloadopt's CPU kernel" in capsys.readouterr().err
    assert len(builds) == 2


# --- instruction sets ---------------------------------------------------------------------------


def test_every_isa_gives_the_same_bits(mod):
    """The body compiled for each ISA this CPU runs (AVX-512, AVX2, plain C++) gives the same
    bits in every mode, with every option, on sizes that leave ragged vectors and blocks and
    a counter that crosses 2^32 mid-vector; the AVX-512 host runs all three."""
    isas = mod.isas()
    assert isas[-1] == "generic" and mod.isa() == isas[0]
    modes = [(False, 0), *MODES]
    options = [dict(), dict(grad_scale=3.0, maximize=True, decoupled=False),
               dict(weight_decay=0.0, beta1=0.3)]  # fmt: skip
    sizes = SIZES + [70_001]
    try:
        for (master_bf16, moments), opts in itertools.product(modes, options):
            gdtype = torch.bfloat16 if master_bf16 or moments else torch.float32
            base = make_mode(sizes, 3, master_bf16, moments, gdtype=gdtype)
            results = []
            for isa in isas:
                mod.set_isa(isa)
                x = clone_all(base)
                wout = [] if master_bf16 else [torch.empty(n, dtype=torch.bfloat16) for n in sizes]
                kcall(mod.adam_step, *x[:4], sms=x[4], svs=x[5], wout=wout,
                      steps=[3.0] * len(sizes), salts=list(range(len(sizes))),
                      offsets=[2**32 - 40] * len(sizes), moments=moments, master_sr=master_bf16,
                      **opts)  # fmt: skip
                results.append([t.view(torch.uint8) for lst in x + [wout] for t in lst])
            for isa, r in zip(isas[1:], results[1:], strict=True):
                for k, (a, b) in enumerate(zip(results[0], r, strict=True)):
                    assert torch.equal(a, b), (
                        f"{isa} vs {isas[0]}: {master_bf16, moments, opts} #{k}"
                    )
    finally:
        mod.set_isa(isas[0])


def test_an_isa_the_cpu_does_not_run_is_refused(mod):
    with pytest.raises(ValueError, match="'avx1024' is not run by this CPU; it runs: "):
        mod.set_isa("avx1024")
    assert mod.isa() == mod.isas()[0]


def test_int8_a_block_whose_new_exp_avg_is_subnormal_is_a_zero_block_on_every_isa(mod):
    """A block whose new exp_avg absmax is below 2^-126 (1/scale would be inf, t inf or NaN and
    a code's value past 8 bits: AVX2's saturating byte packs once gave 0xFF there, the other
    ISAs the low 8 bits) is a zero block on every ISA, as formats.py's: scale 0, codes 0."""
    n = 512
    gen = torch.Generator().manual_seed(5)
    g = (torch.rand(n, generator=gen) + 0.5) * torch.randn(n, generator=gen).sign()
    g[:256] *= 1e-39  # bf16 denormals, none zero: the first block's new exp_avg is below 2^-128
    g = g.to(torch.bfloat16)

    def step(fn):  # one step from zero moments: the codes and scales of both moments
        x = ([torch.ones(n)], [g.clone()], [torch.zeros(n, dtype=torch.uint8)],
             [torch.zeros(n, dtype=torch.uint8)])  # fmt: skip
        sm, sv = [torch.zeros(2)], [torch.zeros(2)]
        kcall(fn, *x, sms=sm, svs=sv, moments=2, weight_decay=0.0)
        return x[2][0], x[3][0], sm[0], sv[0]

    results = []
    try:
        for isa in mod.isas():
            mod.set_isa(isa)
            results.append(step(mod.adam_step))
    finally:
        mod.set_isa(mod.isas()[0])
    ref = step(reference.adam_step)
    assert ref[2][0].item() == 0 and not ref[0][:256].any() and ref[2][1].item() > 0
    for isa, got in zip(mod.isas(), results, strict=True):
        for a, b in zip(got, ref, strict=True):
            assert torch.equal(a, b), isa


def test_a_block_of_subnormal_moments_is_flushed_not_coded_from_an_infinite_reciprocal(mod):
    """A new user's finding: every |m| of a block below 2^-128 made 1 / scale inf, so each
    nonzero m decoded as +-scale and each zero as 1.5 x scale (the code of t = 0 x inf, NaN).
    Such a block is a zero block (scale 0, codes 0), in the torch form and the kernel alike,
    with flush-to-zero on or off."""
    m = torch.full((300,), 1e-40)
    m[::3], m[1::3], m[256:] = 0.0, -3e-41, 1e-3  # the second block normal
    codes, scales = formats.encode_m(m)
    assert scales[0] == 0 and not codes[:256].any() and scales[1] > 0
    assert torch.equal(formats.decode_m(codes, scales)[:256], torch.zeros(256))
    for flush in (False, True):
        got = []
        for fn in (mod.adam_step, reference.adam_step):
            p, g = torch.ones(300), torch.zeros(300)
            cm, sm = formats.encode_m(m * 2.0**100)  # normal: the step's decay makes it tiny
            cv, sv = formats.encode_v(torch.full((300,), 1e-6))
            sm = sm * 2.0**-100
            kcall(fn, [p], [g], [cm], [cv], sms=[sm], svs=[sv], moments=2, weight_decay=0.0,
                  flush_denormal=flush)  # fmt: skip
            got.append((cm, sm, cv, sv))
        for x, y in zip(*got, strict=True):
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), flush
        assert got[0][1][0] == 0 and not got[0][0][:256].any(), flush
