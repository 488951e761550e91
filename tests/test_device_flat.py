"""Device-resident compressed state in flat buffers (offloadopt/step/device_flat.py) against the
per-tensor device pass it replaces, bitwise: every representation, mixed shapes and dtypes, odd
sizes, params cut between passes, a clip factor, a GradScaler with skipped steps, re-placement
between fractions, checkpoints (saved without the flat storage, loaded into the views, resumed
in a fresh optimizer). CPU tensors stand in for the device: ``takes_flat`` is forced on, and the
per-tensor path's calls go to the torch-ops pass (use_kernel=False) instead of the C++ kernel."""

from __future__ import annotations

import io
import random

import pytest
import torch

import offloadopt.step.update as update
from offloadopt import HybridAdamW
from offloadopt.kernels import adam, flat, reference
from offloadopt.step import device_flat

# odd sizes, a 0-dim param, one cut by a pass of 512 or 1,024 elements, two dtypes
SHAPES = [(33, 17), (257,), (), (2, 300), (1100,), (5, 5, 11), (256,), (3, 512)]
DTYPES = [torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.float32, torch.bfloat16,
          torch.float32, torch.bfloat16, torch.bfloat16]  # fmt: skip
SETTINGS = {
    "int8": dict(state_dtype="int8"),  # bf16 params with fp32 masters; fp32 params their own
    "sr8": dict(state_dtype="int8", master_weights="bf16-sr"),  # bf16 params their own master
    "bf16": dict(state_dtype="bf16"),
    "sr-fp32": dict(master_weights="bf16-sr"),  # fp32 moments beside bf16-sr masters
}


def make_params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(d))
            for s, d in zip(SHAPES, DTYPES, strict=True)]  # fmt: skip


def groups(params, **extra):
    return [{"params": params[:5], "lr": 1e-2, "weight_decay": 0.1, **extra},
            {"params": params[5:], "lr": 3e-3, "weight_decay": 0.0, "betas": (0.8, 0.95)}]  # fmt: skip


def grads(params, step: int, scale: float = 1.0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return [(torch.randn(p.shape, generator=g) * scale).to(p.dtype) for p in params]


@pytest.fixture
def paths(monkeypatch):
    """``use(flat)``: the flat pass on (or off) for CPU tensors; the per-tensor path's calls
    always go to the torch-ops pass (on the CPU the default is the C++ kernel)."""
    monkeypatch.setattr(update, "adam_update",
                        lambda *a, **k: adam.adam_update(*a, use_kernel=False, **k))  # fmt: skip

    def use(on: bool) -> None:
        monkeypatch.setattr(device_flat, "takes_flat", lambda device: on)

    return use


def train(params, opt, steps, start=0, scaler=None, bad=(), moves=None):
    """``steps`` steps with seeded grads (with ``scaler``: scaled, an inf at the steps in
    ``bad``); ``moves``: step -> fraction to move to before it."""
    for step in range(start, start + steps):
        if moves and step in moves:
            opt.set_offload_fraction(moves[step])
        scale = 1.0 if scaler is None else scaler.get_scale()
        for p, g in zip(params, grads(params, step, scale), strict=True):
            if step in bad and p.dim() == 2:
                g[0, 0] = float("inf")
            p.grad = g.to(p.device)
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
    opt.synchronize()


def build(params, setting, fraction=0.0, **kw):
    kw.setdefault("min_offload_numel", 1)
    return HybridAdamW(groups(params), offload_fraction=fraction, **SETTINGS[setting], **kw)


def same(a_params, a_opt, b_params, b_opt, what: str) -> None:
    for i, (p, q) in enumerate(zip(a_params, b_params, strict=True)):
        x, y = p.detach().reshape(-1), q.detach().reshape(-1)
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), f"{what}: param {i}"
        sa, sb = a_opt.state[p], b_opt.state[q]
        assert sorted(sa) == sorted(sb), f"{what}: param {i} keys"
        for k in sa:
            x, y = sa[k].reshape(-1), sb[k].reshape(-1)
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), f"{what}: param {i} {k}"


def flat_members(opt) -> set:
    return set(opt.debug.updater.flat.where)


def test_the_keys_made_on_the_device_are_sr_key_bit_for_bit():
    rnd = random.Random(0)
    salts = [0, 1, 5, 2**40 + 5, 2**63 + 11, 2**64 - 1] + [rnd.getrandbits(64) for _ in range(500)]
    table = torch.tensor([flat.signed64(s) for s in salts], dtype=torch.int64)
    for step in (1.0, 2.0, 1000.0, 2.0**33 + 7):
        keys = flat.key_table(table, step).tolist()
        for salt, row in zip(salts, keys, strict=True):
            for draw in (0, 1):
                k = reference.sr_key(salt, step, draw)
                assert row[2 * draw : 2 * draw + 2] == [k & 0xFFFFFFFF, k >> 32], (salt, step)


def test_the_keys_of_one_step_per_param_are_sr_key_too():
    salts = [3, 2**63 + 11, 7]
    steps = [4.0, 5.0, 2.0**40]
    table = torch.tensor([flat.signed64(s) for s in salts], dtype=torch.int64)
    keys = flat.key_table(table, steps).tolist()
    for salt, step, row in zip(salts, steps, keys, strict=True):
        k0, k1 = reference.sr_key(salt, step, 0), reference.sr_key(salt, step, 1)
        assert row == [k0 & 0xFFFFFFFF, k0 >> 32, k1 & 0xFFFFFFFF, k1 >> 32]


@pytest.mark.parametrize("setting", ["int8", "sr8", "bf16"])
def test_a_missed_grad_leaves_the_steps_apart_and_the_set_flat(paths, monkeypatch, setting):
    """A param without a grad at one step: its set takes the per-tensor path that step; after
    it, the set's params are at two step counts and the flat pass runs with per-block
    scalars and keys (no new layout); the bits of the per-tensor path throughout."""
    monkeypatch.setitem(device_flat.FLAT_CHUNK, "cpu", 512)
    runs = []
    for on in (False, True):
        paths(on)
        params = make_params()
        opt = build(params, setting)
        for step in range(5):
            for p, g in zip(params, grads(params, step), strict=True):
                p.grad = None if (step == 1 and p is params[0]) else g
            opt.step()
            if on and step == 1:
                sets = set(opt.debug.updater.flat.where.values())
        runs.append((params, opt))
    same(*runs[0], *runs[1], f"{setting}, after a missed grad")
    params, opt = runs[1]
    assert {float(opt.state[p]["step"]) for p in params[:5]} == {4.0, 5.0}
    assert set(opt.debug.updater.flat.where.values()) == sets  # laid out once
    assert opt.debug.updater.flat.where[params[0]].fl_all is not None  # per-block scalars


@pytest.mark.parametrize("chunk", [512, 2**16])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_the_flat_pass_is_bitwise_the_per_tensor_pass(paths, monkeypatch, setting, chunk):
    monkeypatch.setitem(device_flat.FLAT_CHUNK, "cpu", chunk)
    calls = []
    real = device_flat.core_into
    monkeypatch.setattr(device_flat, "core_into", lambda *a, **k: (calls.append(1), real(*a, **k)))
    paths(False)
    old_params = make_params()
    old = build(old_params, setting)
    train(old_params, old, 4)
    assert not flat_members(old) and not calls
    paths(True)
    new_params = make_params()
    new = build(new_params, setting)
    train(new_params, new, 4)
    same(old_params, old, new_params, new, f"{setting}, passes of {chunk}")
    assert flat_members(new) == set(new_params) and calls
    # the state is views of the flat buffers, made there at the first grad
    for p in new_params:
        for k, t in new.state[p].items():
            assert t._base is not None, k


@pytest.mark.parametrize("setting", ["int8", "sr8"])
def test_a_clip_factor_and_a_grad_scaler_give_the_same_bits(paths, setting):
    runs = []
    for on in (False, True):
        paths(on)
        params = make_params()
        opt = build(params, setting, max_grad_norm=0.5)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
        scaler.scale(torch.ones(()))  # the scale exists before the first step
        train(params, opt, 6, scaler=scaler, bad={2})
        assert bool(flat_members(opt)) == on
        runs.append((params, opt))
    same(*runs[0], *runs[1], f"{setting}, clipped under a GradScaler")
    assert {float(s["step"]) for s in runs[1][1].state.values()} == {5.0}  # one skipped


def test_params_that_cannot_join_keep_the_per_tensor_path(paths):
    """A strided param and fp16 params (fp32 masters from fp16 grads) stay out of the sets;
    a set with a member without a grad this step takes the per-tensor path that step; the
    results are those of the per-tensor path throughout."""
    runs = []
    for on in (False, True):
        paths(on)
        params = make_params()
        base = torch.randn(6, 40, generator=torch.Generator().manual_seed(3))
        strided = torch.nn.Parameter(base.t())  # (40, 6), not contiguous
        fp16 = torch.nn.Parameter(
            torch.randn(77, generator=torch.Generator().manual_seed(4)).half()
        )
        every = params + [strided, fp16]
        opt = HybridAdamW([{"params": every, "lr": 1e-2}], offload_fraction=0.0,
                          state_dtype="int8", min_offload_numel=1)  # fmt: skip
        for step in range(4):
            for p, g in zip(every, grads(every, step), strict=True):
                p.grad = None if (step == 2 and p is every[1]) else g
            opt.step()
        if on:
            assert flat_members(opt) == set(params)
        runs.append((every, opt))
    same(*runs[0], *runs[1], "strided, fp16, a missing grad")


@pytest.mark.parametrize("setting", ["int8", "sr8"])
def test_moving_between_fractions_keeps_every_bit(paths, setting):
    """0 -> 0.5 -> 0 with set_offload_fraction: the flat buffers are laid out again from the
    per-param state at each move; the same bits as the per-tensor path through the same
    moves, and as a run that never moved (the torch-ops pass on the host too)."""
    moves = {2: 0.5, 4: 0.0}
    runs = []
    for on, mv in ((False, moves), (True, moves), (True, None)):
        paths(on)
        params = make_params()
        opt = build(params, setting)
        train(params, opt, 6, moves=mv)
        runs.append((params, opt))
    same(*runs[0], *runs[1], "moved, per tensor against flat")
    same(*runs[1], *runs[2], "moved against not moved")
    assert flat_members(runs[1][1]) == set(runs[1][0])


def test_a_move_to_half_leaves_the_offloaded_params_no_flat_state(paths):
    paths(True)
    params = make_params()
    opt = build(params, "int8")
    train(params, opt, 2)
    opt.set_offload_fraction(0.5)
    train(params, opt, 1, start=2)
    device = {p for p in params if not opt.is_offloaded(p)}
    assert device and device != set(params)
    assert flat_members(opt) == device
    for p in set(params) - device:  # arena views now, none of a flat buffer
        assert opt.state[p]["exp_avg_q"].device.type == "cpu"


def test_checkpoints_round_trip_and_resume_bitwise(paths, tmp_path):
    paths(True)
    ref_params = make_params()
    ref = build(ref_params, "int8")
    train(ref_params, ref, 5)
    params = make_params()
    opt = build(params, "int8")
    train(params, opt, 3)
    sd = opt.state_dict()
    for entry in sd["state"].values():  # copies: never a whole flat buffer (a decoded
        for k, t in entry.items():  # moment keeps its own block padding: export_moments)
            padded = -(-t.numel() // 256) * 256 * t.element_size()
            assert t.untyped_storage().nbytes() <= padded, k
    buf = io.BytesIO()
    torch.save(sd, buf)
    nbytes = sum(t.numel() * t.element_size() for e in sd["state"].values() for t in e.values())
    assert buf.tell() < nbytes + 64 * 1024
    # loaded into the same optimizer: written into the views, the sets stay
    held = {p: dict(opt.state[p]) for p in params}
    opt.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    for p in params:
        assert all(opt.state[p][k] is t for k, t in held[p].items())
    # loaded into a fresh optimizer, then stepped: the bits of the run that never stopped
    fresh = build(params, "int8")
    buf.seek(0)
    fresh.load_state_dict(torch.load(buf, weights_only=True))
    train(params, fresh, 2, start=3)
    same(ref_params, ref, params, fresh, "resumed in a fresh optimizer")
    assert flat_members(fresh) == set(params)
    # streamed: each view is written as its own bytes
    path = str(tmp_path / "ck")
    n = fresh.save_streamed(path)
    assert n < 2 * nbytes
    again = build(make_params(), "int8")
    again.load_streamed(path)
    for p, q in zip(params, again.param_groups[0]["params"] + again.param_groups[1]["params"],
                    strict=True):  # fmt: skip
        for k, t in fresh.state[p].items():
            assert torch.equal(t, again.state[q][k]), k


def test_a_deleted_state_is_made_again_and_the_sets_follow(paths):
    """``del opt.state[p]`` drops one member's views: at the next step its set is laid out
    again from the others' state and p's new state; the bits of the per-tensor path."""
    runs = []
    for on in (False, True):
        paths(on)
        params = make_params()
        opt = build(params, "int8")
        train(params, opt, 2)
        del opt.state[params[1]]
        train(params, opt, 2, start=2)
        runs.append((params, opt))
    same(*runs[0], *runs[1], "after a deleted state")
    assert flat_members(runs[1][1]) == set(runs[1][0])


def test_the_default_fp32_state_builds_no_flat_buffers(paths):
    paths(True)
    params = make_params()
    opt = HybridAdamW(groups(params), offload_fraction=0.0)
    train(params, opt, 2)
    assert not flat_members(opt)


def test_off_the_cpu_by_default_and_switched_off_by_the_environment(monkeypatch):
    monkeypatch.delenv("OFFLOADOPT_DEVICE_FLAT", raising=False)
    assert not device_flat.takes_flat(torch.device("cpu"))
    assert device_flat.takes_flat(torch.device("cuda", 0))
    monkeypatch.setenv("OFFLOADOPT_DEVICE_FLAT", "0")
    assert not device_flat.takes_flat(torch.device("cuda", 0))


def test_the_gpu_probe_runs_at_a_tiny_size_on_the_cpu(tmp_path):
    """benchmarks/probes/device_pass.py as the GPU host runs it, at the tiny preset on the CPU
    (a program: no test imports a benchmark): every row timed, the flat row bitwise the
    per-tensor one, the pass alone with its bytes per element (int8, fp32 masters: 16, and
    per block a row of step scalars and two scales read and written)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "probes" / "device_pass.py"
    argv = ["--preset", "tiny", "--device", "cpu", "--warmup", "0", "--repeats", "1",
            "--modes", "int8", "--out", str(tmp_path)]  # fmt: skip
    r = subprocess.run([sys.executable, str(script), *argv], capture_output=True, text=True,
                       timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads((tmp_path / "device_pass.json").read_text())
    rows = out["rows"]
    assert [row["row"] for row in rows] == ["torch fused AdamW, fp32 state",
                                            "HybridAdamW, fp32 state", "int8: per tensor",
                                            "int8: flat, eager"]  # fmt: skip
    assert rows[-1]["bitwise"] is True and all(row["ms"] > 0 for row in rows)
    passes = out["passes"]  # one pass timed alone, beside a triad
    assert [p["row"] for p in passes] == ["triad a = b + s*c, fp32", "int8 pass, eager"]
    assert passes[1]["bytes_per_elem"] == 16 + 24 / 256 and all(p["gbps"] > 0 for p in passes)
    assert "reproduce: python benchmarks/probes/device_pass.py --preset tiny" in r.stdout
