"""The logic of the GPU-host scripts in benchmarks/ that CPU can check: overlap_bench.py's
configuration variants and profile_modes.py's reading of a torch.profiler trace."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import overlap_bench  # noqa: E402
import profile_modes  # noqa: E402


def test_overlap_bench_variants_add_options_to_a_known_configuration():
    known = dict(overlap_bench.configs(False) + overlap_bench.EXTRA)
    got = overlap_bench.derived("backward f0.2 threads8 switch0.5 fifo", known)
    assert got == {**known["backward f0.2"], "cpu_threads": 8, "switch_s": 0.0005, "fifo": True}
    assert overlap_bench.derived("delayed f1 bucket256", known)["bucket_nbytes"] == 256 * 2**20
    assert overlap_bench.derived("f0", known) is known["f0"]
    with pytest.raises(SystemExit, match="'backward f0.2 threads'"):
        overlap_bench.derived("backward f0.2 threads", known)  # no number: not a variant
    with pytest.raises(SystemExit, match="'nonsense f9'"):
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
