"""The flat pass as one Triton kernel (offloadopt/kernels/flat_triton.py) under Triton's CPU
interpreter (TRITON_INTERPRET=1), against the eager flat pass (kernels.flat._core_into) on the
same inputs, bit for bit: every representation (fp32, bf16 and int8 moments; fp32 masters with
and without bf16 weights out, bf16-sr masters), maximize, L2 or decoupled weight decay, a loss
scale (a float or a tensor), a large lerp weight, passes in a row with scalars that differ per
param, padded tails, all-zero blocks, blocks with NaN or inf (NaN scales, codes 0), and
through the optimizer. The eager pass here takes a correctly rounded sqrt: torch's CPU fp32
sqrt is one ulp off in about 1 of 6 elements (MKL's vectorized sqrt), where the kernel's, like
torch's CUDA sqrt, is IEEE's. The GPU's bits: tests/cuda/test_device_flat_cuda.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from offloadopt.kernels import flat, flat_triton, reference, torch_forms
from offloadopt.kernels.formats import BLOCK, encode_m, encode_v, nblocks

pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

_TORCH_SQRT = torch.Tensor.sqrt
_FMA_ONCE: list[bool] = []


def _fma_kernel(x_ptr):
    x = tl.load(x_ptr)
    tl.store(x_ptr, tl.fma(x, x, -1.0))


def _interpreter_rounds_fma_once() -> bool:
    """Whether this triton's interpreter computes tl.fma with one rounding (older releases
    multiplied and added in fp32): (1 + 2^-12)^2 - 1 = 2^-11 + 2^-24, or 2^-11."""
    if not _FMA_ONCE:
        from triton.runtime.interpreter import InterpretedFunction

        x = torch.tensor([1 + 2.0**-12])
        InterpretedFunction(_fma_kernel)[(1,)](x)
        _FMA_ONCE.append(float(x) == 2.0**-11 + 2.0**-24)
    return _FMA_ONCE[0]


def _sqrt_rn(self: torch.Tensor) -> torch.Tensor:
    """fp32 sqrt on the CPU correctly rounded (numpy's: the SSE/AVX instruction)."""
    if self.dtype == torch.float32 and self.device.type == "cpu":
        return torch.from_numpy(np.sqrt(self.detach().numpy()))
    return _TORCH_SQRT(self)


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(torch.Tensor, "sqrt", _sqrt_rn)
    if not _interpreter_rounds_fma_once():
        pytest.skip("this triton's interpreter rounds tl.fma twice: it cannot give an fma's bits")


SIZES = [300, 1, 256, 700, 513]  # padded to whole blocks: 2 + 1 + 1 + 3 + 3 = 10 blocks
MODES = [(m, master) for m in (0, 1, 2) for master in ("fp32", "fp32+w", "bf16-sr")]


def make(moments: int, master: str, *, seed=0, steps=(3, 7, 3, 1, 12), g_fp32=False,
         device_flat_counters=False, cuda_div=False, beta1=0.9, beta2=0.999, lr=1e-2):  # fmt: skip
    """A pass over SIZES: its buffers (pads zero, as the optimizer keeps them) and the
    per-block scalars of each param's step, as reference.adam_step_flat makes them.
    ``device_flat_counters``: the counter's base per block in ``it_b`` and ``first_b`` the
    block's own index (step/device_flat.py's layout) instead of the param's first block."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [nblocks(n) for n in SIZES]
    total = sum(blocks) * BLOCK
    keep = torch.zeros(total, dtype=torch.bool)
    first = np.cumsum([0] + blocks[:-1])
    for f, n in zip(first, SIZES, strict=True):
        keep[f * BLOCK : f * BLOCK + n] = True

    def rand(scale: float, dist=torch.randn) -> torch.Tensor:
        return torch.where(keep, dist(total, generator=gen) * scale, 0.0)

    bf16_master = master == "bf16-sr"
    p = rand(1.0).to(torch.bfloat16 if bf16_master else torch.float32)
    g = rand(1e-2).to(torch.float32 if g_fp32 else torch.bfloat16)
    m, v = rand(1e-3), rand(1e-5, torch.rand)
    m_sc = v_sc = None
    if moments == 1:
        m, v = m.to(torch.bfloat16), v.to(torch.bfloat16)
    elif moments == 2:
        (m, m_sc), (v, v_sc) = encode_m(m), encode_v(v)
    w_out = torch.zeros(total, dtype=torch.bfloat16) if master == "fp32+w" else None
    compressed = bf16_master or moments != 0
    fl, it = [], []
    for i, s in enumerate(steps):
        fl.append(reference._step_scalars(lr / (1 - beta1**s), 1 - beta2**s, 1e-8, compressed,
                                          cuda=cuda_div))  # fmt: skip
        keys = [reference.sr_key(1000 + 77 * i, s, d) for d in (0, 1)]
        it.append([5 * BLOCK * i] + [h for k in keys for h in (k & 0xFFFFFFFF, k >> 32)])
    counts = torch.tensor(blocks)
    fl_b = torch.tensor(fl, dtype=torch.float32).repeat_interleave(counts, dim=0)
    it_b = torch.tensor(it, dtype=torch.int64).repeat_interleave(counts, dim=0)
    first_b = torch.tensor(first).repeat_interleave(counts)
    if device_flat_counters:
        it_b[:, 0] += (torch.arange(len(first_b)) - first_b) * BLOCK
        first_b = torch.arange(len(first_b))
    return [p, g, m, m_sc, v, v_sc, w_out, fl_b, it_b, first_b]


def kwargs(moments: int, master: str, *, beta1=0.9, beta2=0.999, wd=0.1, decoupled=True,
           lr=1e-2, **kw) -> dict:  # fmt: skip
    """_core_into's keywords for make()'s pass (``kw``: maximize, grad_scale, cuda_div)."""
    out = dict(wd_factor=reference._f32(1 - lr * wd) if wd and decoupled else None,
               grad_scale=None, k=reference._consts(beta1, beta2, wd, 1e-8), maximize=False,
               decoupled=decoupled, moments=moments, bf16_master=master == "bf16-sr",
               cuda_div=False, compressed=master == "bf16-sr" or moments != 0)  # fmt: skip
    return {**out, **kw}


def clone(bufs: list) -> list:
    return [None if t is None else t.clone() for t in bufs]


def same(a: list, b: list, what: str) -> None:
    """Every output buffer bit for bit (p, g, m, m_sc, v, v_sc, w_out)."""
    names = ["p", "g", "m", "m_sc", "v", "v_sc", "w_out"]
    for name, x, y in zip(names, a[:7], b[:7], strict=True):
        if x is None:
            assert y is None
            continue
        xb, yb = x.view(torch.uint8), y.view(torch.uint8)
        assert torch.equal(xb, yb), f"{what}: {name} differs in {int((xb != yb).sum())} bytes"


def both(bufs: list, kw: dict, passes: int = 1, kernel_kw: dict | None = None) -> tuple:
    """The eager pass and the kernel (with ``kernel_kw`` if given) over copies of ``bufs``,
    ``passes`` times in a row."""
    a, b = bufs, clone(bufs)
    for _ in range(passes):
        flat._core_into(*a, **kw)
        flat_triton.triton_into(*b, **(kernel_kw or kw))
    return a, b


@pytest.mark.parametrize("moments,master", MODES)
def test_every_representation_is_bitwise_the_eager_pass(moments, master):
    a, b = both(make(moments, master), kwargs(moments, master), passes=3)
    same(a, b, f"moments {moments}, {master}")
    assert not torch.equal(a[0], make(moments, master)[0])  # the pass did update


OPTIONS = {
    "maximize": dict(maximize=True),
    "L2": dict(decoupled=False),  # the decay through the grads
    "no decay": dict(wd=0.0),
    "a loss scale": dict(grad_scale=1024.0),
    "scalars by pointer": dict(grad_scale=1024.0, tensors=True),
    "lerp weight 0.7, addcmul value 1": dict(beta1=0.3, beta2=0.0),
    "CUDA's reciprocal": dict(cuda_div=True),  # the denominator's scalar as 1 / sqrt(bc2)
    "fp32 grads, device_flat's counters": dict(g_fp32=True, device_flat_counters=True),
}


@pytest.mark.parametrize("moments,master", [(2, "fp32+w"), (1, "bf16-sr"), (0, "fp32")])
@pytest.mark.parametrize("option", list(OPTIONS))
def test_the_options_are_bitwise_the_eager_pass(moments, master, option):
    opts = dict(OPTIONS[option])
    tensors = opts.pop("tensors", False)
    made = ("g_fp32", "device_flat_counters", "beta1", "beta2", "cuda_div")
    bufs = make(moments, master, **{k: v for k, v in opts.items() if k in made})
    kw = kwargs(moments, master, **{k: v for k, v in opts.items() if k not in made[:2]})
    kernel_kw = None
    if tensors:  # the eager pass takes floats; the kernel reads 0-dim tensors
        kernel_kw = dict(kw, grad_scale=torch.tensor(kw["grad_scale"]),
                         wd_factor=torch.tensor(kw["wd_factor"]))  # fmt: skip
    a, b = both(bufs, kw, passes=2, kernel_kw=kernel_kw)
    same(a, b, f"moments {moments}, {master}, {option}")


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's inf and NaN, interpreting
@pytest.mark.parametrize("master", ["fp32+w", "bf16-sr"])
def test_non_finite_and_zero_blocks_as_the_eager_pass(master):
    """int8: a block with a NaN grad, one with an inf grad (their scales NaN, every code 0,
    their masters NaN), an all-zero block (scale 0, codes 0) and one of subnormal moments
    (whose codes come from t = |m| x inf: the same bit operations on the same bits)."""
    bufs = make(2, master)
    g, m, m_sc, v, v_sc = bufs[1], bufs[2], bufs[3], bufs[4], bufs[5]
    g[5] = float("nan")
    g[BLOCK * 3 + 9] = float("-inf")
    zero = slice(2 * BLOCK, 3 * BLOCK)  # the third param: one whole block
    bufs[0][zero] = 0
    g[zero], m[zero], v[zero], m_sc[2], v_sc[2] = 0, 0, 0, 0.0, 0.0
    m_sc[4] = v_sc[4] = 2.0**-140  # subnormal moments, no grad: 1 / their new absmax is inf
    g[4 * BLOCK : 5 * BLOCK] = 0
    a, b = both(bufs, kwargs(2, master))
    for sc in (a[3], a[5]):
        assert sc[[0, 3]].isnan().all() and not sc[[1, 2, 4]].isnan().any()
        assert sc[2] == 0
    assert a[3][4] == 0 and not a[2][4 * BLOCK : 5 * BLOCK].any()  # subnormal m: flushed
    for codes in (a[2], a[4]):
        assert not codes[: BLOCK * 1].any() and not codes[3 * BLOCK : 4 * BLOCK].any()
    same(a, b, f"non-finite and zero blocks, {master}")


def test_an_empty_pass_and_bad_buffers():
    bufs = make(2, "fp32")
    empty = [t[:0] if t is not None else None for t in bufs]
    flat_triton.triton_into(*empty, **kwargs(2, "fp32"))
    with pytest.raises(ValueError, match="g has 2559 elements"):
        flat_triton.triton_into(*bufs[:1], bufs[1][1:], *bufs[2:], **kwargs(2, "fp32"))
    with pytest.raises(ValueError, match="bf16_master=True"):
        flat_triton.triton_into(*bufs, **kwargs(2, "bf16-sr"))
    with pytest.raises(ValueError, match="weights_out=True"):
        flat_triton.triton_into(*bufs, **kwargs(2, "fp32"), weights_out=True)


def test_available_needs_the_interpreter_off_cuda(monkeypatch):
    assert flat_triton.available(torch.device("cpu"))
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not flat_triton.available(torch.device("cpu"))


def test_the_forms_found_are_torchs():
    """On this CPU's build the vectorized kernels fuse (AVX2/AVX-512, NEON) or do not
    (ATEN_CPU_CAPABILITY=default): the forms found reproduce torch's ops on fresh values."""
    forms = torch_forms.torch_forms(torch.device("cpu"), reference._f32(0.1), reference._f32(0.05))
    gen = torch.Generator().manual_seed(5)
    s, e, g, b = (torch.randn(4096, generator=gen) for _ in range(4))
    w, c = reference._f32(0.1), reference._f32(0.05)
    lerp = torch_forms._fma32(w, e - s, s) if forms["LERP"] == 0 else s + w * (e - s)
    assert torch.equal(torch.lerp(s, e, w), lerp)
    v = torch_forms._fma32(c * g, g, b) if forms["V_FORM"] == 1 else b + c * g * g
    assert forms["V_FORM"] in (0, 1) and torch.equal(b.addcmul(g, g, value=c), v)
    assert forms["GS_RECIP"] == 0  # the CPU divides


def test_an_unknown_form_warns_and_takes_the_nearest(monkeypatch):
    """A torch whose lerp matches no candidate (here: one value nudged by an ulp) does not
    stop the step: the nearest form, and a warning that the bits may differ by a rounding."""
    w, c = reference._f32(0.2), reference._f32(0.01)
    want = torch_forms.torch_forms(torch.device("cpu"), w, c)
    monkeypatch.setattr(torch_forms, "_FORMS", {})
    lerp = torch.lerp

    def nudged(s, e, weight):
        out = lerp(s, e, weight)
        out[7] = out[7].nextafter(torch.tensor(float("inf")))
        return out

    monkeypatch.setattr(torch, "lerp", nudged)
    with pytest.warns(RuntimeWarning, match="lerp matches no known form .1 of 512 values"):
        assert torch_forms.torch_forms(torch.device("cpu"), w, c) == want


def run_optimizer(monkeypatch, how: str, setting: str, **kw):
    import test_device_flat as tdf

    import offloadopt.step.update as update
    from offloadopt.kernels import adam
    from offloadopt.step import device_flat

    monkeypatch.setattr(update, "adam_update",
                        lambda *a, **k: adam.adam_update(*a, use_kernel=False, **k))  # fmt: skip
    monkeypatch.setattr(device_flat, "takes_flat", lambda device: True)
    monkeypatch.setitem(device_flat.FLAT_CHUNK, "cpu", 1024)  # params cut between passes
    monkeypatch.setenv("OFFLOADOPT_DEVICE_STEP", how)
    calls = []
    real = flat.core_into
    monkeypatch.setattr(device_flat, "core_into",
                        lambda *a, **k: (calls.append(k["how"]), real(*a, **k)))  # fmt: skip
    params = tdf.make_params()
    opt = tdf.build(params, setting, **kw.pop("build", {}))
    tdf.train(params, opt, 4, **kw)
    assert set(calls) == {how}
    return params, opt


@pytest.mark.parametrize("setting", ["int8", "sr8", "bf16", "sr-fp32"])
def test_the_optimizer_with_the_triton_pass_is_bitwise_the_eager_one(monkeypatch, setting):
    from test_device_flat import same as same_state

    old = run_optimizer(monkeypatch, "eager", setting)
    new = run_optimizer(monkeypatch, "triton", setting)
    same_state(*old, *new, f"{setting}: triton vs eager")


def test_clipped_under_a_grad_scaler_through_the_optimizer(monkeypatch):
    from test_device_flat import same as same_state

    runs = []
    for how in ("eager", "triton"):
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
        scaler.scale(torch.ones(()))
        runs.append(run_optimizer(monkeypatch, how, "int8", scaler=scaler, bad={2},
                                  build=dict(max_grad_norm=0.5)))  # fmt: skip
    same_state(*runs[0], *runs[1], "int8, clipped under a GradScaler: triton vs eager")


@pytest.mark.slow
def test_the_kernel_compiles_for_an_h100_without_fusing_what_torch_does_not():
    """Every mode compiled for sm_90 on this machine (Triton's own ptxas; no GPU needed): with
    torch's unfused forms the PTX holds no fma (enable_fp_fusion=False), with its fused ones
    two per element (lerp, addcmul) and one more for L2 decay."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kern = flat_triton._kernel(False)
    ptr = {"p_ptr": "fp32", "g_ptr": "i16", "ms_ptr": "fp32", "vs_ptr": "fp32", "w_ptr": "i16",
           "fl_ptr": "fp32", "it_ptr": "i64", "first_ptr": "i64", "wdf": "fp32", "gs": "fp32"}  # fmt: skip
    per_thread = flat_triton.BLOCKS_PER_PROGRAM * BLOCK // (32 * flat_triton.NUM_WARPS)
    for moments, p_bf16, fused in ((2, False, True), (1, True, False), (0, False, True)):
        const = dict(P_BF16=p_bf16, G_BF16=True, MOMENTS=moments, W_OUT=not p_bf16,
                     MAXIMIZE=False, WD=2, WDF=0, GS=2, COMPRESSED=moments != 0, CUDA_DIV=True,
                     LERP=0 if fused else 1, L2_FMA=fused, V_FORM=2 if fused else 3,
                     GS_RECIP=1, BF16_NAN=0x7FFF, BPP=flat_triton.BLOCKS_PER_PROGRAM,
                     BLOCK=BLOCK, fl_s1=1, it_s1=1)  # fmt: skip
        sig = {n: "constexpr" if n in const else "fp32" for n in kern.arg_names}
        sig.update({n: "i32" for n in ("n_blocks", "fl_s0", "it_s0")})
        sig.update({n: "*" + t for n, t in ptr.items()})
        sig["m_ptr"] = sig["v_ptr"] = "*" + ("fp32", "i16", "u8")[moments]
        sig["p_ptr"] = "*i16" if p_bf16 else "*fp32"
        aligned = {(kern.arg_names.index(n),): [["tt.divisibility", 16]] for n in ptr}
        try:  # the signature's format is this triton's (3.9)
            src = ASTSource(fn=kern, signature=sig, constexprs=const, attrs=aligned)
        except (TypeError, AttributeError) as e:
            pytest.skip(f"this triton's ASTSource differs: {e}")
        out = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                             options=dict(num_warps=flat_triton.NUM_WARPS, enable_fp_fusion=False))  # fmt: skip
        ptx = out.asm["ptx"]
        fmas = len(re.findall(r"\bfma\.rn\.f32\b", ptx))
        assert fmas == (3 * per_thread if fused else 0), (moments, p_bf16, fused, fmas)
        assert re.search(r"ld\.global(\.[a-z]+)*\.v4", ptx), "vectorized loads"
        assert "sqrt.rn.f32" in ptx and ".ftz" not in ptx


@pytest.mark.slow
def test_unfused_cpu_kernels_give_the_unfused_forms(tmp_path):
    """ATEN_CPU_CAPABILITY=default (torch's scalar CPU kernels: no fused multiply-add): the
    forms found are the unfused ones and the kernel still gives the eager pass's bits."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import test_flat_triton as t, torch\n"
        "torch.Tensor.sqrt = t._sqrt_rn\n"
        "from offloadopt.kernels.torch_forms import torch_forms\n"
        "print(torch_forms(torch.device('cpu'), 0.1, 0.001))\n"
        "for mo, ma in [(2, 'fp32+w'), (1, 'bf16-sr'), (0, 'fp32')]:\n"
        "    a, b = t.both(t.make(mo, ma), t.kwargs(mo, ma, decoupled=False), passes=2)\n"
        "    t.same(a, b, f'{mo} {ma}')\n"
        "print('ok')\n"
    )
    path = [str(Path(__file__).parent), os.environ["PYTHONPATH"]]  # the checkout: conftest.py
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default", TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join(path))  # fmt: skip
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=300, cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "'LERP': 1, 'L2_FMA': False, 'V_FORM': 0" in r.stdout and r.stdout.endswith("ok\n")
