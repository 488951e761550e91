"""The logic of the GPU-host scripts in benchmarks/ that CPU can check: overlap_bench.py's
configuration variants, its summary and both scripts' checks of their options;
profile_modes.py's reading of a torch.profiler trace."""

import json
import math
import sys
from pathlib import Path
from unittest import mock

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import overlap_bench  # noqa: E402
import profile_modes  # noqa: E402


def test_overlap_bench_variants_add_options_to_a_known_configuration():
    known = dict(overlap_bench.configs(False) + overlap_bench.EXTRA)
    got = overlap_bench.derived("backward f0.2 threads8 switch0.5 fifo perseg", known)
    assert got == {
        **known["backward f0.2"],
        "cpu_threads": 8,
        "switch_s": 0.0005,
        "fifo": True,
        "perseg": True,
    }
    assert overlap_bench.derived("delayed f1 bucket256", known)["bucket_nbytes"] == 256 * 2**20
    assert overlap_bench.derived("backward f1 base", known) == {
        **known["backward f1"],
        "base": True,
    }
    assert overlap_bench.derived("f0", known) is known["f0"]
    assert overlap_bench.derived("backward f0.4 clip int8", known) == {
        **overlap_bench.CLIPPED, "fraction": 0.4, "state_dtype": "int8"}  # fmt: skip
    assert overlap_bench.derived("backward f0 int8", known) == {  # issue 46's fraction 0
        **overlap_bench.BEST, "fraction": 0.0, "state_dtype": "int8"}  # fmt: skip
    assert overlap_bench.derived("backward f0 sr8 pertensor", known) == {
        **overlap_bench.BEST, "fraction": 0.0, **overlap_bench.STATES["sr8"],
        "per_tensor": True}  # fmt: skip
    assert overlap_bench.derived("delayed f1 sr8", known) == {
        **known["delayed f1"], "state_dtype": "int8", "master_weights": "bf16-sr"}  # fmt: skip
    assert overlap_bench.derived("backward f0.1 clip spec maxnorm100 copybk", known) == {
        **overlap_bench.CLIPPED, "fraction": 0.1, "speculate": True, "max_grad_norm": 100.0,
        "copy_backup": True}  # fmt: skip
    with pytest.raises(ValueError, match="'backward f0.2 threads'"):
        overlap_bench.derived("backward f0.2 threads", known)  # no number: not a variant
    with pytest.raises(ValueError, match="'nonsense f9'"):
        overlap_bench.derived("nonsense f9 threads4", known)


def test_profile_modes_config_parses_options():
    assert profile_modes._config("backward:0.2:cpu_threads=8,grads_final=False") == (
        "backward", 0.2, {"cpu_threads": 8, "grads_final": False})  # fmt: skip
    assert profile_modes._config("step") == ("step", 0.0, {})
    for bad in ("sideways:0.1", "step:x", "step:0.1:threads"):
        with pytest.raises(Exception, match="step|sideways"):
            profile_modes._config(bad)


def _x(cat, name, ts, dur, tid, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 0,
            "args": args}  # fmt: skip


def test_profile_modes_gaps_split_launch_bound_from_waits_and_blame_the_launching_thread():
    trace = {"traceEvents": [
        _x("gpu_user_annotation", "## forward+backward", 0, 1000, 1),
        _x("kernel", "k1", 10, 100, 7, stream=7, correlation=1),
        _x("kernel", "k2", 400, 100, 7, stream=7, correlation=2),  # 290 us gap: launched late
        _x("kernel", "k3", 600, 100, 7, stream=7, correlation=3),  # 100 us gap: launched early
        _x("kernel", "side", 520, 50, 9, stream=9, correlation=4),  # another stream: not counted
        _x("cuda_runtime", "cudaLaunchKernel", 5, 2, 50, correlation=1),
        _x("cuda_runtime", "cudaLaunchKernel", 390, 2, 50, correlation=2),
        _x("cuda_runtime", "cudaLaunchKernel", 300, 2, 50, correlation=3),
        _x("python_function", "hook", 20, 300, 50),  # between launches 1 and 2, on their thread
        _x("python_function", "inner", 50, 100, 50),
        _x("python_function", "elsewhere", 20, 300, 51),  # another thread
    ]}  # fmt: skip
    g = profile_modes.compute_gaps(trace)
    assert g["iterations"] == 1
    assert g["compute_busy_ms"] == pytest.approx(0.3)
    assert g["launch_bound_gap_ms"] == pytest.approx(0.29)
    assert g["wait_gap_ms"] == pytest.approx(0.1)
    assert dict(g["launching_thread_ms"]) == pytest.approx({"hook": 0.2, "inner": 0.1})
    assert profile_modes.compute_gaps({"traceEvents": []}) == {}


def test_profile_modes_launch_breakdown_splits_each_range_into_its_ops_and_the_rest():
    trace = {"traceEvents": [
        _x("user_annotation", "offloadopt.launch_d2h", 0, 100, 5),
        _x("cpu_op", "aten::copy_", 10, 30, 5),
        _x("cuda_runtime", "cudaMemcpyAsync", 15, 20, 5),  # nested in copy_: not counted twice
        _x("cpu_op", "aten::record_stream", 50, 10, 5),
        _x("cpu_op", "aten::copy_", 60, 10, 6),  # another thread: not this range's
        _x("user_annotation", "offloadopt.launch_d2h", 200, 50, 5),
        _x("cuda_runtime", "cudaEventRecord", 210, 5, 5),
        _x("user_annotation", "offloadopt.cpu_update", 300, 500, 5),  # not a launch
    ]}  # fmt: skip
    r = profile_modes.launch_breakdown(trace)
    assert list(r) == ["offloadopt.launch_d2h"]
    row = r["offloadopt.launch_d2h"]
    assert row["count"] == 2
    assert row["ms"] == pytest.approx(0.15)
    assert row["ops_ms"] == pytest.approx({"aten::copy_": 0.03, "aten::record_stream": 0.01,
                                           "cudaEventRecord": 0.005})  # fmt: skip
    assert row["uncovered_ms"] == pytest.approx(0.15 - 0.045)
    assert row["runtime_ms"] == pytest.approx({"cudaMemcpyAsync": 0.02, "cudaEventRecord": 0.005})


def test_profile_modes_records_the_workers_launch_ranges_on_the_cpu():
    """The worker is not the thread that starts the profiler: its ranges must still be there
    (pipeline._traced checked a per-thread flag, and every worker range was lost)."""
    from offloadopt.harness.bench import Bench, BenchConfig

    bench = Bench(BenchConfig(preset="tiny", batch_size=2, warmup=3, steps=1, mock_data=True,
                              progress=False, audit=False, device="cpu"))  # fmt: skip
    bench.sync = lambda: None
    # step mode: step() returns once every copy is queued, so both ranges fall in the window
    r = profile_modes.profile_one(bench, "step", 1.0, 1, 1, 5, launches=True)
    assert set(r["launches"]) == {"offloadopt.launch_d2h", "offloadopt.launch_h2d"}
    assert all(row["count"] >= 1 and row["ms"] > 0 for row in r["launches"].values())
    assert any(x["name"] == "offloadopt.cpu_update" for x in r["ranges"])


# --- the scripts' options: a usage error (status 2) naming the value, before anything is built --

CPU = ["--device", "cpu"]
OVERLAP_BAD = [
    (["--steps", "0"], "argument --steps: 0 is not an integer >= 1"),
    (["--warmup", "-1"], "argument --warmup: -1 is not an integer >= 0"),
    (["--batch-size", "0"], "argument --batch-size: 0 is not an integer >= 1"),
    (["--seq-len", "0"], "argument --seq-len: 0 is not an integer >= 1"),
    (["--preset", "nope"], "argument --preset: 'nope' is not one of tiny, small,"),
    (["--preset", "tiny", "--seq-len", "129"], "--seq-len: 129 is more than the tiny preset's 128"),
    (["--only", "f0", "nope"], "--only: 'nope' is no configuration"),
    (["--only", "backward f0.2 threads"], "--only: 'backward f0.2 threads' is no configuration"),
    (["--only", "f0 threads0"], "--only: 'f0 threads0': 'threads0' needs a number above 0"),
    (["--only", "backward f0.2 bucket0"],
     "--only: 'backward f0.2 bucket0': 'bucket0' needs a number above 0"),
    (["--only", "backward f0.2 switch0"],
     "--only: 'backward f0.2 switch0': 'switch0' needs a number above 0"),
    (["--only", "backward f1 base", "--baseline-dir", "/nonexistent"],
     "--baseline-dir: '/nonexistent' holds no offloadopt_base package"),
]  # fmt: skip
PROFILE_BAD = [
    (["--steps", "-1"], "argument --steps: -1 is not an integer >= 1"),  # was "--warmup"'s
    (["--steps", "0"], "argument --steps: 0 is not an integer >= 1"),
    (["--warmup", "-1"], "argument --warmup: -1 is not an integer >= 0"),
    (["--batch-size", "0"], "argument --batch-size: 0 is not an integer >= 1"),
    (["--top", "0"], "argument --top: 0 is not an integer >= 1"),
    (["--preset", "nope"], "argument --preset: 'nope' is not one of tiny, small,"),
    (["--configs", "step:1.5"], "argument --configs: 'step:1.5': fraction 1.5 is not in [0, 1]"),
    (["--configs", "backward:1:bogus=3"],
     "argument --configs: 'backward:1:bogus=3': 'bogus' is not a HybridAdamW option"),
    (["--configs", "step:1:cpu_threads=0"],
     "argument --configs: 'step:1:cpu_threads=0': Invalid cpu_threads: 0"),
    (["--configs", "backward:1:release_grads=true"],
     "argument --configs: 'backward:1:release_grads=true': expected MODE:FRACTION[:key=value,...],"),
]  # fmt: skip


def _usage_error(parse, argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        parse(argv)
    assert e.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("argv, message", OVERLAP_BAD, ids=[" ".join(a) for a, _ in OVERLAP_BAD])
def test_overlap_bench_checks_its_options_before_anything_is_built(argv, message, capsys, tmp_path):
    boom = AssertionError("got past the checks")
    with mock.patch.object(overlap_bench, "load_text", side_effect=boom), \
         mock.patch.object(overlap_bench.models, "build_model", side_effect=boom):  # fmt: skip
        line = _usage_error(overlap_bench.main, [*argv, *CPU, "--out", str(tmp_path / "o")], capsys)
    assert line.startswith(f"error: {message}", line.index("error: ")), line
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("argv, message", PROFILE_BAD, ids=[" ".join(a) for a, _ in PROFILE_BAD])
def test_profile_modes_checks_its_options_before_anything_is_built(argv, message, capsys, tmp_path):
    with mock.patch.object(profile_modes, "Bench", side_effect=AssertionError("built")):
        line = _usage_error(profile_modes.main, [*argv, *CPU, "--out", str(tmp_path)], capsys)
    assert line.startswith(f"error: {message}", line.index("error: ")), line


def test_overlap_bench_exits_1_when_a_configuration_failed_and_keeps_the_rows(tmp_path, capsys):
    real = overlap_bench.run

    def run(model, init, batches, name, cfg, *rest):
        if name == "step f0.1":
            raise RuntimeError("this configuration broke")
        return real(model, init, batches, name, cfg, *rest)

    argv = ["--preset", "tiny", "--batch-size", "2", "--steps", "1", "--warmup", "0", "--no-probe",
            "--no-memory", "--only", "f0", "step f0.1", *CPU, "--out", str(tmp_path)]  # fmt: skip
    with mock.patch.object(overlap_bench, "run", side_effect=run):
        assert overlap_bench.main(argv) == 1
    rows = json.loads((tmp_path / "overlap.json").read_text())["configs"]
    assert [r["name"] for r in rows] == ["f0", "step f0.1"] and "step_ms" in rows[0]
    assert rows[1]["error"] == "RuntimeError: this configuration broke"
    assert "1 configuration(s) failed: step f0.1" in capsys.readouterr().err
    assert overlap_bench.parse_args(["--preset", "tiny", *CPU]).seq_len == 128  # its longest


def test_the_scripts_take_good_options_and_variants():
    args = overlap_bench.parse_args(
        ["--only", "f0", "backward f0.05 threads8 fifo", "--quick", *CPU]
    )
    assert args.only == ["f0", "backward f0.05 threads8 fifo"]  # --only is not limited by --quick
    assert profile_modes.parse_args(CPU).configs == [("step", 0.0, {})]  # main() unpacks three


def test_overlap_bench_help_says_what_only_takes(capsys):
    with pytest.raises(SystemExit):
        overlap_bench.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for word in ("threadsN", "bucketN", "switchN", "fifo", "'backward f0.2 threads8 switch1'",
                 "'delayed f1 clip'"):  # fmt: skip
        assert word in text, word


def _row(name, step_ms, fraction=0.0, **extra):
    return {"name": name, "fraction": fraction, "choice": None, "step_ms": step_ms,
            "step_ms_min": step_ms, "step_ms_max": step_ms, "to_backward_end_ms": step_ms / 2,
            "peak_gpu_gb": 1.0, **extra}  # fmt: skip


PROBE = {"main_alone_ns_per_param": 1.0, "main_link_ns_per_param": 1.5,
         "worker_alone_ns_per_param": 2.0, "worker_link_ns_per_param": 2.5}  # fmt: skip


@pytest.mark.parametrize(
    "rows, probe",
    [
        ([_row("delayed f1", 30.0)], None),  # --only "delayed f1": no f0, --no-probe
        ([_row("f0", 10.0), _row("step f1", 40.0)], None),  # no sweep rows, no probe
        ([_row("f0 clip", 10.0), {"name": "backward f0.1 clip", "error": "boom"}], PROBE),
        ([_row("f0", 10.0), _row("backward auto", 10.5, 0.1, choice={}),
          _row("backward auto budget", 11.0, 0.3, choice={"max_gpu_memory": 0.5e9})], None),
        ([_row("f0", 10.0), _row("backward f0.1", 10.5, 0.1, grads_final=True),
          _row("backward f1", 20.0, 1.0)], PROBE),
    ],
)  # fmt: skip
def test_overlap_bench_summary_says_n_a_for_what_was_not_run(rows, probe, capsys, tmp_path):
    results = {"gpu": "none", "torch": "x", "args": {"batch_size": 4, "seq_len": 128,
               "out": str(tmp_path)}, "configs": rows}  # fmt: skip
    if probe is not None:
        results["kernel_probe"] = probe
    overlap_bench.summarize(results, 10**6)
    lines = capsys.readouterr().out.strip().splitlines()[1:]
    assert lines, "nothing summarized"
    for line in lines:
        assert "nan" not in line and "; ;" not in line and "()" not in line, line
        assert not line.rstrip().endswith((":", ";", "=", ",")), line
    if probe is not None:
        assert any(line.startswith("  CPU pass, ns/param: main 1.000 alone") for line in lines)
    else:
        assert any("n/a" in line for line in lines)
        # a ratio needs the whole bound: against forward+backward alone it read 5.71x once
        for line in lines:
            assert "CPU pass n/a" not in line or line.endswith("= n/a"), line


def test_overlap_bench_summary_keeps_its_figures_when_every_row_is_there(capsys):
    results = {"gpu": "none", "torch": "x", "args": {"batch_size": 4, "seq_len": 128},
               "configs": [_row("f0", 10.0), _row("backward f0.1", 10.5, 0.1),
                           _row("delayed f1", 30.0, 1.0)], "kernel_probe": PROBE}  # fmt: skip
    overlap_bench.summarize(results, 10**7)
    out = " ".join(capsys.readouterr().out.split())
    # the CPU pass: 2.5 ns x 1e7 params = 25 ms; fwd+bwd of f0 5 ms; 30 / max(5, 25) = 1.20
    assert "delayed f1 30.0 ms; / max(fwd+bwd 5, CPU pass 25) = 1.20" in out
    assert "sweep (no clipping): f0 10.0 ms; 0.1:1.05x; largest within 1.10x: 0.1" in out
    assert not math.isnan(results["configs"][0]["step_ms"])


def test_the_baseline_is_timed_without_a_sync_between_backward_and_step(monkeypatch):
    """f0's forward+backward needs a sync before step(), which would also keep step()'s
    launches from overlapping backward; timed in the same iterations it made the baseline
    slower than the configurations it is the baseline of. It is timed in extra iterations."""
    import torch

    from offloadopt.harness import models

    torch.manual_seed(0)
    model = models.build_model("tiny", torch.device("cpu"), torch.float32)
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    batches = [(torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))) for _ in range(3)]
    syncs = []
    monkeypatch.setattr(overlap_bench, "sync", lambda m: syncs.append(1))
    row = overlap_bench.run(model, init, batches, "f0", {"fraction": 0.0}, warmup=1, steps=2)
    # three timed-or-warm-up iterations with a sync before and after each; two more for
    # forward+backward with one more sync each, before step()
    assert len(syncs) == 3 * 2 + 2 * 3
    assert math.isfinite(row["to_backward_end_ms"]) and math.isfinite(row["step_ms"])
    syncs.clear()
    overlap_bench.run(model, init, batches, "backward f0.1", {"fraction": 0.1}, warmup=1, steps=2)
    assert len(syncs) == 3 * 2


def test_timeline_marks_every_bucket_and_replays_its_table(tmp_path, capsys):
    """benchmarks/timeline.py on the CPU: each timed iteration's marks, the worker's per-bucket
    marks for every bucket, the table from the run and from its JSON, the patches undone."""
    import timeline

    from offloadopt.link.pipeline import Pipeline
    from offloadopt.link.transfer import Transfer

    before = (Pipeline._start_d2h, Pipeline._update, Transfer.start_h2d)
    argv = ["--device", "cpu", "--preset", "tiny", "--batch-size", "2", "--seq-len", "32",
            "--warmup", "1", "--steps", "3", "--out", str(tmp_path)]  # fmt: skip
    assert timeline.main(argv) == 0
    assert (Pipeline._start_d2h, Pipeline._update, Transfer.start_h2d) == before
    meta = json.loads((tmp_path / "timeline-delayed-b2.json").read_text())
    kinds = [k for k, _, _ in meta["marks"]]
    assert kinds.count("iteration") == 3 and kinds.count("step_out") == 3
    starts = {b for k, b, _ in meta["marks"] if k == "update_start"}
    ends = {b for k, b, _ in meta["marks"] if k == "update_end"}
    assert starts and starts == ends == {b for k, b, _ in meta["marks"] if k == "h2d_launched"}
    assert meta["stats"]["buckets"] >= 1
    first = capsys.readouterr().out
    assert "period median" in first
    assert timeline.main(["--replay", str(tmp_path / "timeline-delayed-b2.json")]) == 0
    replayed = capsys.readouterr().out
    assert replayed.splitlines()[-1].split(";")[1] == first.splitlines()[-1].split(";")[1]
    with pytest.raises(SystemExit) as e:
        timeline.main(["--replay", str(tmp_path / "nope.json")])
    assert e.value.code == 2 and "nope.json" in capsys.readouterr().err
