"""The benchmark harness with a tiny model, the CPU standing in for the device."""

import json

import pytest

from offloadopt.harness import anchors
from offloadopt.harness.bench import Bench, BenchConfig, format_table, run_bench


def tiny(tmp_path, **kw):
    kw = {"anchors": [], **kw}
    return BenchConfig(preset="tiny", device="cpu", batch_size=2, seq_len=16, warmup=1, steps=2,
                       slow_steps=1, out=str(tmp_path), progress=False, **kw)  # fmt: skip


def test_run_bench_writes_json_and_every_hybrid_fraction_matches_the_baseline(tmp_path, capsys):
    results = run_bench(tiny(tmp_path, fractions=[0.0, 0.5, 1.0]))
    names = [r["name"] for r in results]
    assert names == [
        "fused-kernel-alone",
        "hybrid:0",
        "hybrid:0 (repeat)",
        "hybrid:0.5",
        "hybrid:1",
    ]
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert [r["name"] for r in saved["results"]] == names and saved["params"] > 0
    for r in results[3:]:
        assert r["status"] == "ok", r
        assert r["timed_steps"] == 2 and r["step_ms"] >= r["fwd_bwd_ms"] > 0
    assert results[2]["rms_rel_diff"] == 0.0  # the CPU path is deterministic
    assert (
        results[1]["checksum"] == results[4]["checksum"]
    )  # fraction 1 is bitwise the baseline here
    assert "hybrid:0.5" in capsys.readouterr().out


def test_a_drifting_configuration_is_flagged_not_hidden(tmp_path):
    bench = Bench(tiny(tmp_path))

    def tagged(build, **tags):
        return lambda model, lr: {**build(model, lr), **tags}

    bench.run("hybrid:0", tagged(anchors.hybrid(0.0), baseline=True))
    bench.run("repeat", tagged(anchors.hybrid(0.0), repeat=True))
    # A broken optimizer: it silently takes twice the learning rate.
    bad = bench.run("broken", lambda model, lr: anchors.hybrid(1.0)(model, 2 * lr))
    assert bad["status"].startswith("DRIFT"), bad
    other = bench.run(
        "torch bf16-less", lambda model, lr: {**anchors.torch_adamw(model, lr), "numerics": "other"}
    )
    assert other["status"] == "other numerics (other)"
    assert "DRIFT" in format_table([bad])


def test_unknown_anchor_is_a_clear_error_before_anything_runs(tmp_path):
    with pytest.raises(ValueError, match="Invalid anchor: 'nope'"):
        run_bench(tiny(tmp_path, anchors=["nope"]))
    assert not (tmp_path / "bench.json").exists()
