"""Compressed optimizer state on the GPU (state_dtype=, master_weights="bf16-sr"): the offloaded
params run the CPU kernel and land bitwise where a CPU-only run puts them; device-resident params
run the plain-torch reference on the GPU, to rounding; checkpoints resume bitwise; no pageable
copy. Run on the GPU host."""

import io

import pytest
import torch

from offloadopt import HybridAdamW, check_pinned

pytestmark = pytest.mark.cuda

SETTINGS = [dict(state_dtype="int8"), dict(state_dtype="bf16"),
            dict(master_weights="bf16-sr", state_dtype="int8")]  # fmt: skip
SHAPES = [(512, 256), (256,), (384, 512), (300, 7), (64,)]


def params_on(device, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype).to(device)) for s in SHAPES]


def run(params, steps, opt):
    for step in range(steps):
        g = torch.Generator().manual_seed(100 + step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype).to(p.device)
        opt.step()
    return opt


@pytest.fixture(autouse=True)
def _needs_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (tests/cuda run on the GPU host)")


@pytest.mark.parametrize("kw", SETTINGS, ids=lambda kw: "-".join(map(str, kw.values())))
def test_offloaded_params_land_where_a_cpu_run_puts_them(kw):
    cpu, gpu = params_on("cpu"), params_on("cuda")
    run(cpu, 6, HybridAdamW(cpu, lr=1e-2, min_offload_numel=1000, **kw))
    opt = run(gpu, 6, HybridAdamW(gpu, lr=1e-2, min_offload_numel=1000, **kw))
    torch.cuda.synchronize()
    for p, q in zip(gpu, cpu, strict=True):
        if opt.debug.records[p].offloaded:  # the same CPU kernel on the same inputs
            torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=0, atol=0)
        else:  # the reference in torch ops on the GPU: the same math, another op order
            torch.testing.assert_close(p.detach().cpu().float(), q.detach().float(),
                                       rtol=2e-2, atol=2e-2)  # fmt: skip
    assert check_pinned(opt) == []  # every host buffer that crosses the link is pinned


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_every_fraction_and_backward_mode_train_to_the_same_place(fraction):
    kw = dict(master_weights="bf16-sr", state_dtype="int8", lr=1e-2, min_offload_numel=1000)
    ref = params_on("cuda")
    run(ref, 6, HybridAdamW(ref, offload_fraction=1.0, **kw))
    mine = params_on("cuda")
    run(mine, 6, HybridAdamW(mine, offload_fraction=fraction, overlap="backward",
                             grads_final=True, **kw))  # fmt: skip
    for p, q in zip(mine, ref, strict=True):
        torch.testing.assert_close(p.detach().float(), q.detach().float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("fraction", [0.0, 1.0])
def test_a_checkpoint_resumes_bitwise_on_the_gpu(fraction):
    kw = dict(state_dtype="int8", lr=1e-2, min_offload_numel=1000, offload_fraction=fraction)
    whole = params_on("cuda")
    a = run(whole, 6, HybridAdamW(whole, **kw))
    first = params_on("cuda")
    b = run(first, 3, HybridAdamW(first, **kw))
    buf = io.BytesIO()
    torch.save(b.state_dict(), buf)
    buf.seek(0)
    c = HybridAdamW(first, **kw)
    c.load_state_dict(torch.load(buf, weights_only=True))
    for step in range(3, 6):
        g = torch.Generator().manual_seed(100 + step)
        for p in first:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype).to(p.device)
        c.step()
    for p, q in zip(first, whole, strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=0)
    for p, q in zip(first, whole, strict=True):
        for k, v in a.state[q].items():
            torch.testing.assert_close(c.state[p][k], v, rtol=0, atol=0)


@pytest.mark.parametrize(
    "hook",
    [None, ("d2h",), ("h2d",), "worker"],
    ids=["plain", "slow-d2h", "slow-h2d", "slow-worker"],
)
def test_bf16_over_the_link_is_the_fp32_links_bits_with_late_copies(hook, monkeypatch):
    """int8 moments, fp32 masters, bf16 params: grads cross D2H and weights H2D in bf16, the
    weights written over the grads in the host slot (transfer.py). Small buckets and two slots:
    each slot's next D2H must wait for the H2D that reads it (Slot.host_read), which late
    copies would expose. Bitwise the fp32 link's result; half its bytes."""
    import time

    from offloadopt.place import placer

    def go(link):
        monkeypatch.setattr(placer, "BF16_LINK", link)
        params = params_on("cuda")
        opt = HybridAdamW(params, lr=1e-2, state_dtype="int8", offload_fraction=1.0,
                          min_offload_numel=1, bucket_nbytes=64 * 1024)  # fmt: skip
        assert len(opt.buckets) > 4
        for tr in opt.debug.pipeline.transfers.values():
            if isinstance(hook, tuple):
                tr.side_stream_hook = lambda kind: kind in hook and torch.cuda._sleep(20_000_000)
        if hook == "worker":
            opt.debug.pipeline.worker_hook = lambda bucket: time.sleep(0.005)
        bytes_seen = []
        for step in range(4):
            g = torch.Generator().manual_seed(100 + step)
            for p in params:
                p.grad = torch.randn(p.shape, generator=g).to(p.dtype).to(p.device)
            opt.step()
            # the next step's grads are made while the H2Ds run: a reused slot must wait
            bytes_seen.append((opt.stats["d2h_nbytes"], opt.stats["h2d_nbytes"]))
        torch.cuda.synchronize()
        assert check_pinned(opt) == []
        out = [p.detach().cpu() for p in params], bytes_seen
        opt.close()
        return out

    (w1, n1), (w0, n0) = go(True), go(False)
    for a, b in zip(w1, w0, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert all(d == d0 // 2 and h == h0 // 2 for (d, h), (d0, h0) in zip(n1, n0, strict=True))


@pytest.mark.parametrize("kw", [{}, dict(state_dtype="int8")], ids=["fp32", "int8"])
def test_a_streamed_checkpoint_resumes_bitwise_on_the_gpu(kw, tmp_path):
    """save_streamed / load_streamed with device-resident and offloaded state on CUDA: the
    device tensors copied to the host part by part, read back into the GPU state."""
    params = params_on("cuda")
    opt = run(params, 3, HybridAdamW(params, lr=1e-2, min_offload_numel=1000,
                                     offload_fraction=0.5, **kw))  # fmt: skip
    assert any(not opt.debug.records[p].offloaded for p in params)
    assert any(opt.debug.records[p].offloaded for p in params)
    opt.save_streamed(str(tmp_path / "ck"))
    run(params, 3, opt)
    torch.cuda.synchronize()
    expected = [p.detach().cpu() for p in params]
    fresh = params_on("cuda", seed=0)
    # the weights at the save: three steps of the first run
    run(fresh, 3, HybridAdamW(fresh, lr=1e-2, min_offload_numel=1000, offload_fraction=0.5, **kw))
    other = HybridAdamW(fresh, lr=1e-2, min_offload_numel=1000, offload_fraction=0.5, **kw)
    other.load_streamed(str(tmp_path / "ck"))
    for step in range(3):
        g = torch.Generator().manual_seed(100 + step)
        for p in fresh:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype).to(p.device)
        other.step()
    torch.cuda.synchronize()
    for a, b in zip(fresh, expected, strict=True):
        torch.testing.assert_close(a.detach().cpu(), b, rtol=0, atol=0)
