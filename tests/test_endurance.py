"""tests/long/endurance.py on the CPU: a few steps of every phase, the JSON it writes, and the
checks failing when they should (a broken oracle kernel, memory that grows). tests/long/ is on
pytest's pythonpath (pyproject.toml)."""

import json

import endurance
import endurance_checks
import pytest
import torch

SMALL = ["--device", "cpu", "--preset", "tiny", "--batch-size", "4", "--seq-len", "32"]
SMALL += ["--sample-every", "1", "--eval-batches", "2", "--no-progress"]


def test_smoke_run_writes_every_figure_and_passes(tmp_path, capsys):
    rc = endurance.main([*SMALL, "--steps", "5", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    r = json.loads((tmp_path / "endurance.json").read_text())
    e = r["endurance"]
    assert r["exit_code"] == 0 and r["ok"] and all(r["checks"].values())
    assert e["steps"] == 5 and e["mismatch_steps"] == 0 and e["first_mismatch"] is None
    assert 0 < e["offloaded_param_tensors"] < e["param_tensors"]  # fraction 0.5: some, not all
    assert [s["step"] for s in e["samples"]] == [1, 2, 3, 4, 5]
    for s in e["samples"]:
        assert s["host_rss_nbytes"] > 0 and s["host_nbytes"] > 0
        assert s["pinned_nbytes"] == s["gpu_allocated_nbytes"] == 0  # nothing pinned on a CPU
        assert s["train_loss_nats"] == pytest.approx(e["train_losses_nats"][s["step"] - 1])
    flat = e["flatness"]
    assert flat["host_rss"]["limit_nbytes"] >= endurance_checks.RSS_LIMIT_NBYTES
    assert flat["pinned"]["spread_nbytes"] == flat["host"]["spread_nbytes"] == 0
    assert [ref["seed"] for ref in r["references"]] == [0, 1, 2]
    for run in [e, *r["references"]]:
        assert len(run["train_losses_nats"]) == 5
        assert run["final_train_loss_nats"] == run["train_losses_nats"][-1]
        assert 0 < run["heldout_loss_nats"] < 6  # about ln(256) = 5.55 this early
    # fp32 on the CPU: the hybrid is bitwise torch's AdamW, so seed 0 trains identically
    assert r["train_losses_equal_same_seed_reference"] is True
    assert e["train_losses_nats"] == r["references"][0]["train_losses_nats"]
    assert r["references"][1]["train_losses_nats"] != e["train_losses_nats"]  # other batches
    band = r["heldout_band"]
    assert band["within"] == (band["min_nats"] <= band["endurance_nats"] <= band["max_nats"])
    assert out.rstrip().splitlines()[-1] == "result: PASS (exit 0)"
    assert "mismatching steps (bitwise)" in out


def test_a_wrong_update_is_counted_once_and_fails_the_run(tmp_path, monkeypatch):
    calls = []

    def off_by_a_bit(params, grads, exp_avgs, *args, **kwargs):
        torch._fused_adamw_(params, grads, exp_avgs, *args, **kwargs)
        calls.append(1)
        if len(calls) == 3:  # the third step: one element of one moment is off
            exp_avgs[0].view(-1)[0] += 1e-3

    monkeypatch.setattr(endurance_checks, "ORACLE_KERNEL", off_by_a_bit)
    rc = endurance.main([*SMALL, "--steps", "5", "--ref-seeds=", "--out", str(tmp_path)])
    assert rc == 1
    r = json.loads((tmp_path / "endurance.json").read_text())
    e = r["endurance"]
    # the oracle takes the hybrid's state after a mismatch: steps 4 and 5 agree again
    assert e["mismatch_steps"] == 1 and r["checks"]["bitwise_state"] is False
    first = e["first_mismatch"]
    assert first["step"] == 3 and first["count"] == 1
    assert first["mismatches"][0]["key"] == "exp_avg"
    assert first["mismatches"][0]["elements_differing"] == 1
    assert r["references"] == [] and r["heldout_band"]["within"] is None


def test_flatness_limits():
    def samples(rss_growth, pinned_growth):  # growth per sample, every 10 steps
        return [
            {
                "step": s,
                "host_rss_nbytes": 2**30 + rss_growth * s // 10,
                "pinned_nbytes": 2**20 + pinned_growth * s // 10,
                "host_nbytes": 2**21,
                "gpu_allocated_nbytes": 0,
                "gpu_max_allocated_nbytes": 0,
            }
            for s in range(10, 101, 10)
        ]

    flat = endurance_checks.flatness(samples(2**20, 0), 100)  # 8 MiB over steps 20..100: fine
    assert flat["warmup_steps"] == 10 and flat["samples_after_warmup"] == 9
    assert flat["host_rss"]["spread_nbytes"] == 8 * 2**20 and flat["host_rss"]["ok"]
    assert flat["pinned"]["ok"] and flat["host"]["ok"]
    flat = endurance_checks.flatness(samples(10 * 2**20, 4096), 100)  # 80 MiB: over max(64 MiB, 2%)
    assert not flat["host_rss"]["ok"] and flat["host_rss"]["limit_nbytes"] == 64 * 2**20
    assert not flat["pinned"]["ok"] and flat["pinned"]["spread_nbytes"] == 8 * 4096
