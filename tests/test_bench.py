"""The benchmark harness with a tiny model, the CPU standing in for the device."""

import json
import os
import sys
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from offloadopt.harness import anchors, models
from offloadopt.harness.bench import Bench, BenchConfig, _tagged, format_table, run_bench


def tiny(tmp_path, **kw):
    kw = {"anchors": [], "preset": "tiny", **kw}
    return BenchConfig(device="cpu", batch_size=2, seq_len=16, warmup=1, steps=2, slow_steps=1,
                       out=str(tmp_path), progress=False, **kw)  # fmt: skip


@pytest.mark.slow
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


@pytest.mark.slow
def test_with_compressed_state_the_kernel_row_times_offloadopts_kernel_too(tmp_path):
    """The configurations' CPU update is offloadopt's kernel under state_dtype= / bf16-sr: the
    kernel row times it beside torch's fp32 one, and the report says which is which."""
    from offloadopt.harness.report import kernel_note, markdown

    results = run_bench(tiny(tmp_path, fractions=[1.0], dtype="bf16", state_dtype="int8",
                             master_weights="bf16-sr"))  # fmt: skip
    kernel = results[0]
    assert kernel["name"] == "fused-kernel-alone" and kernel["kernel_ms"] > 0
    assert kernel["compressed_kernel"] == "bf16-sr masters, int8 moments"
    assert kernel["compressed_kernel_ms"] > 0 and kernel["compressed_kernel_ns_per_param"] > 0
    line = kernel_note(results)[0]
    assert "its kernel alone (bf16-sr masters, int8 moments)" in line and "torch's fp32 one" in line
    text = markdown(json.loads((tmp_path / "bench.json").read_text()))
    assert "offloadopt's kernel alone (bf16-sr masters, int8 moments" in text


@pytest.mark.slow
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
    with pytest.raises(ValueError, match="--anchors: 'nope' is not one of"):
        run_bench(tiny(tmp_path, anchors=["nope"]))
    assert not (tmp_path / "bench.json").exists()


def test_a_builder_that_takes_batch_size_gets_the_benchs_and_its_close_runs_once(tmp_path):
    bench = Bench(tiny(tmp_path))
    seen = []

    def build(model, lr, batch_size=None):
        seen.append(batch_size)
        return {**anchors.hybrid(0.5)(model, lr), "close": lambda: seen.append("closed")}

    bench.run("sized", build)
    assert seen == [2, "closed"]


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["hf-gpt2-tiny", "hf-llama-tiny"])
def test_transformers_presets_run_through_the_bench_and_fraction_1_matches(tmp_path, preset):
    pytest.importorskip("transformers")
    results = run_bench(tiny(tmp_path, preset=preset, fractions=[0.0, 1.0], kernel=False))
    assert [r["name"] for r in results] == ["hybrid:0", "hybrid:0 (repeat)", "hybrid:1"]
    assert results[2]["status"] == "ok" and results[2]["checksum"] == results[0]["checksum"]
    assert 4.0 < results[0]["loss"] < 7.0  # about ln(256) = 5.55 after 3 steps from init
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["params"] == models.num_params(models.build_model(preset, "cpu", torch.float32))


def test_an_hf_preset_without_transformers_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers fails
    with pytest.raises(ImportError, match="needs transformers"):
        models.build_model("hf-gpt2-tiny", torch.device("cpu"), torch.bfloat16)
    with pytest.raises(ValueError, match="Invalid preset: 'nope'"):
        models.build_model("nope", torch.device("cpu"), torch.bfloat16)
    assert {"hf-gpt2-xl", "hf-llama-1b", "gpt2-xl"} <= set(models.MODEL_PRESETS)


@pytest.mark.slow
@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built in")
@pytest.mark.parametrize("preset", ["tiny", "hf-llama-tiny"])
def test_fsdp2_anchor_is_bitwise_the_baseline_on_cpu_and_leaves_the_shared_model(tmp_path, preset):
    if preset.startswith("hf-"):
        pytest.importorskip("transformers")
    bench = Bench(tiny(tmp_path, preset=preset))
    base = bench.run("hybrid:0", _tagged(anchors.hybrid(0.0), baseline=True))
    bench.run("repeat", _tagged(anchors.hybrid(0.0), repeat=True))
    # On the CPU FSDP2 runs without the offload policy (the params live on the host already),
    # with the same math: fp32 params, bf16 compute, fp32 grads, torch's fused CPU AdamW.
    with mock.patch.dict(os.environ):  # RANK, MASTER_PORT, ... the anchor sets
        try:
            fsdp = bench.run("fsdp2-cpuoffload", anchors.fsdp2_cpu_offload)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    assert fsdp["status"] == "ok" and fsdp["rms_rel_diff"] == 0.0, fsdp
    assert fsdp["checksum"] == base["checksum"]
    again = bench.run("hybrid:0 after", anchors.hybrid(0.0))
    assert again["checksum"] == base["checksum"]  # the shared model was left as it was


@pytest.mark.slow
@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built in")
def test_hybrid_under_fsdp2_of_one_rank_is_bitwise_the_single_process_path(tmp_path):
    bench = Bench(tiny(tmp_path, dtype="bf16"))
    base = bench.run("hybrid:0", _tagged(anchors.hybrid(0.0), baseline=True))
    bench.run("repeat", _tagged(anchors.hybrid(0.0), repeat=True))
    plain = bench.run("hybrid:0.5", anchors.hybrid(0.5))
    with mock.patch.dict(os.environ):  # RANK, MASTER_PORT, ... the builder sets
        try:
            fsdp = bench.run("hybrid-fsdp2:0.5", anchors.hybrid_fsdp2(0.5))
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    assert fsdp["status"] == "ok" and fsdp["checksum"] == plain["checksum"] == base["checksum"]
    assert fsdp["opt_host_gb"] == plain["opt_host_gb"] > 0  # the same placement: one shard each


@pytest.mark.slow
def test_the_new_anchors_are_cleanly_unavailable_on_a_cpu_only_machine(tmp_path, monkeypatch):
    bench = Bench(tiny(tmp_path))
    with pytest.raises(anchors.Unavailable, match="deepspeed is not installed|CUDA device"):
        anchors.deepspeed_zero2(bench.reset_model(), 1e-3)
    with pytest.raises(anchors.Unavailable, match="deepspeed is not installed|CUDA device"):
        anchors.deepspeed_zenflow(bench.reset_model(), 1e-3)
    assert not dist.is_available() or not dist.is_initialized()  # refused before any setup
    monkeypatch.setitem(sys.modules, "torch.distributed.fsdp", None)  # a torch without FSDP2
    with pytest.raises(anchors.Unavailable, match="FSDP2"):
        anchors.fsdp2_cpu_offload(bench.reset_model(), 1e-3)
    # run_bench measures anchors on a GPU only: on the CPU they are listed as skipped, not run
    new = ["deepspeed-zero2", "deepspeed-zenflow", "fsdp2-cpuoffload"]
    results = run_bench(tiny(tmp_path, anchors=new, fractions=[0.0], kernel=False))
    assert [r["name"] for r in results] == [*new, "hybrid:0", "hybrid:0 (repeat)"]
    assert all(r["status"] == "skipped: needs a CUDA device" for r in results[:3])


@pytest.mark.slow
def test_modes_run_a_sweep_each_and_the_summary_names_the_largest_fraction(tmp_path, capsys):
    modes = ["step", "backward", "backward-torch-clip", "delayed"]
    results = run_bench(tiny(tmp_path, fractions=[0.0, 1.0], modes=modes, kernel=False))
    by = {r["name"]: r for r in results}
    assert {
        "hybrid-backward:0",
        "hybrid-backward:1",
        "hybrid-delayed:0",
        "hybrid-delayed:1",
    } <= set(by)
    # grads_final in backward mode is step mode's math: checked against the baseline
    assert (
        by["hybrid-backward:1"]["status"] == "ok" and by["hybrid-backward:1"]["mode"] == "backward"
    )
    assert by["hybrid-delayed:1"]["status"].startswith("other numerics (delayed")
    # torch's clip after backward: the updates wait for step(), and the weights are clipped ones
    assert by["hybrid-backward-torch-clip:1"]["status"].startswith(
        "other numerics (clipped by torch"
    )
    out = capsys.readouterr().out
    assert "backward: step time over hybrid:0's, by fraction: 0:" in out


def test_sweep_summary_stops_at_the_first_fraction_over_the_limit():
    from offloadopt.harness.report import sweep_summary

    rows = [{"name": "hybrid:0", "kind": "hybrid", "fraction": 0.0, "step_ms": 100.0}]
    rows += [{"name": f"hybrid-backward:{f}", "kind": "hybrid", "mode": "backward",
              "fraction": f, "step_ms": ms} for f, ms in ((0.1, 104.0), (0.2, 120.0), (0.3, 105.0))]  # fmt: skip
    assert sweep_summary(rows) == [
        "step: step time over hybrid:0's, by fraction: 0:1.00x; largest fraction within 1.10x: 0",
        "backward: step time over hybrid:0's, by fraction: 0.1:1.04x 0.2:1.20x 0.3:1.05x; "
        "largest fraction within 1.10x: 0.1",
    ]
    # a clipped mode with its own fraction 0 is measured against it (clipped the same way); a
    # mode with step mode's math against hybrid:0, even with a fraction 0 of its own
    clipped = "other numerics (clipped in the optimizer)"
    rows += [{"name": f"hybrid-backward-clip:{f:g}", "kind": "hybrid", "mode": "backward-clip",
              "fraction": f, "step_ms": ms, "status": clipped}
             for f, ms in ((0.0, 110.0), (0.1, 120.0), (0.2, 125.0))]  # fmt: skip
    rows.append({"name": "hybrid-backward:0", "kind": "hybrid", "mode": "backward",
                 "fraction": 0.0, "step_ms": 130.0, "status": "ok"})  # fmt: skip
    assert sweep_summary(rows)[1:] == [
        "backward: step time over hybrid:0's, by fraction: 0:1.30x 0.1:1.04x 0.2:1.20x "
        "0.3:1.05x; largest fraction within 1.10x: none",
        "backward-clip: step time over hybrid-backward-clip:0's, by fraction: 0:1.00x "
        "0.1:1.09x 0.2:1.14x; largest fraction within 1.10x: 0.1",
    ]


def test_an_unknown_mode_is_named_before_anything_runs(tmp_path):
    from offloadopt.harness.checks import UsageError

    with pytest.raises(UsageError, match="--overlap: 'sideways' is not one of step, backward"):
        run_bench(tiny(tmp_path, modes=["sideways"]))


def test_a_failed_fraction_stops_the_sweep_summary_and_is_named():
    from offloadopt.harness.report import sweep_summary

    rows = [{"name": "hybrid:0", "kind": "hybrid", "fraction": 0.0, "step_ms": 100.0},
            {"name": "hybrid-backward:0.5", "kind": "anchor", "status": "error: RuntimeError: x"},
            {"name": "hybrid-backward:1", "kind": "hybrid", "mode": "backward", "fraction": 1.0,
             "step_ms": 101.0}]  # fmt: skip
    assert sweep_summary(rows)[1] == (
        "backward: step time over hybrid:0's, by fraction: 0.5:failed 1:1.01x; largest fraction "
        "within 1.10x: none"
    )


def test_the_plot_keeps_its_axis_labels_with_several_modes(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from offloadopt.harness.report import plot

    labels = []
    real = Figure.savefig

    def keep(fig, *a, **k):
        labels.extend(ax.get_ylabel() for ax in fig.axes)
        return real(fig, *a, **k)

    monkeypatch.setattr(Figure, "savefig", keep)
    rows = [{"name": f"hybrid{'-' + m if m != 'step' else ''}:{f:g}", "kind": "hybrid", "mode": m,
             "fraction": f, "step_ms": 100.0 + f, "peak_gpu_gb": 1.0 - f / 2}
            for m in ("step", "delayed") for f in (0.0, 1.0)]  # fmt: skip
    plot(rows, tmp_path / "bench.png")
    assert labels == ["step time (ms, median)", "peak GPU memory (GB)"]


@pytest.mark.slow
def test_an_interrupted_run_leaves_the_previous_bench_json_as_it_was(tmp_path):
    """A fresh user's finding: Ctrl-C during a second run in the same --out replaced a finished
    run's bench.json with the few rows done (and left the old bench.png beside it)."""
    run_bench(tiny(tmp_path, fractions=[0.0, 1.0], kernel=False))
    before = (tmp_path / "bench.json").read_bytes()
    calls, run = [], Bench.run

    def interrupted(self, name, builder, slow):
        calls.append(name)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return run(self, name, builder, slow)

    with mock.patch.object(Bench, "run", interrupted), pytest.raises(KeyboardInterrupt):
        run_bench(tiny(tmp_path, fractions=[0.0, 0.5, 1.0], kernel=False))
    assert (tmp_path / "bench.json").read_bytes() == before
    partial = json.loads((tmp_path / "bench.partial.json").read_text())
    assert [r["name"] for r in partial["results"]] == ["hybrid:0"]  # the rows done
    run_bench(tiny(tmp_path, fractions=[0.0], kernel=False))  # a finished run: whole, no partial
    assert not (tmp_path / "bench.partial.json").exists()
    assert json.loads((tmp_path / "bench.json").read_text())["results"][0]["name"] == "hybrid:0"


def test_the_kernel_row_says_how_it_compares_with_the_hybrid_rows():
    from offloadopt.harness.gpt import GPT, PRESETS
    from offloadopt.harness.probes import time_kernel

    shapes = [p.shape for p in GPT(PRESETS["tiny"]).parameters()]
    kernel = {"name": "fused-kernel-alone", "kind": "kernel", **time_kernel(shapes)}
    assert kernel["reps"] >= 25 and kernel["params"] == sum(
        p.numel() for p in GPT(PRESETS["tiny"]).parameters()
    )
    assert 0 < kernel["kernel_ms"] <= kernel["kernel_max_ms"]
    row = {"name": "hybrid:1", "fraction": 1.0, "step_ms": 9.0, "fwd_bwd_ms": 5.0, "opt_ms": 4.0,
           "peak_gpu_gb": 0.0, "pinned_gb": 0.0, "opt_stats_cpu_update_ms": 1.25, "status": "ok"}  # fmt: skip
    table = format_table([kernel, row]).splitlines()
    assert table[1].startswith("fused-kernel-alone") and "ms a step" in table[1]
    assert table[-1].startswith("kernel vs opt ms: hybrid:1's CPU update took 1.25 ms a step")
    assert "of its opt ms 4.00" in table[-1]
    assert not format_table([row])[-1].startswith("kernel vs")  # no kernel row: no note
