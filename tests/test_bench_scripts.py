"""The GPU-host scripts of benchmarks/ that the CPU can check, each run as a program
(tests/as_program.py: no test imports a benchmark): overlap_bench.py's configurations and
variants (``--list``), its summary (``--summary``), a failed configuration, the baseline's
extra iterations; profile_modes.py's configurations and the worker's launch ranges on the
CPU; timeline.py's marks and replay; and every script's checks of its options. The reading of
a torch.profiler trace that profile_modes.py prints lives in offloadopt/harness/trace_gaps.py."""

import json
import math

import as_program
import pytest

from offloadopt.harness.trace_gaps import compute_gaps, launch_breakdown

# A test that runs a script is slow: one process that imports torch, about 2 s on 2 cores.
CPU = ["--device", "cpu"]
CLIPPED = dict(overlap="backward", wait="module", max_grad_norm=1.0)  # the script's "clip"
BEST = dict(overlap="backward", wait="module", grads_final=True)  # the script's "backward"


def _listed(out: str) -> dict[str, dict]:
    """``overlap_bench.py --list``'s lines: name -> options."""
    return {row["name"]: row["options"] for row in map(json.loads, out.splitlines())}


VARIANTS = ["f0", "backward f0.2", "backward f1", "delayed f1",
            "backward f0.2 threads8 switch0.5 fifo perseg", "delayed f1 bucket256",
            "backward f1 base", "backward f0.4 clip int8", "delayed f1 sr8",
            "backward f0.1 clip spec maxnorm100 copybk", "backward f0 int8",
            "backward f0 sr8 pertensor", "backward f0.3 clip spec nohold"]  # fmt: skip


@pytest.mark.slow
def test_overlap_bench_variants_add_options_to_a_known_configuration(usage):
    rc, line, _, out = usage["overlap_bench.py", "--list variants"]
    assert rc == 0, line
    got = _listed(out)
    assert list(got) == VARIANTS
    assert got["backward f0.2 threads8 switch0.5 fifo perseg"] == {
        **got["backward f0.2"],
        "cpu_threads": 8,
        "switch_s": 0.0005,
        "fifo": True,
        "perseg": True,
    }
    assert got["delayed f1 bucket256"]["bucket_nbytes"] == 256 * 2**20
    assert got["backward f1 base"] == {**got["backward f1"], "base": True}
    assert got["f0"] == {"fraction": 0.0}
    assert got["backward f0.4 clip int8"] == {**CLIPPED, "fraction": 0.4, "state_dtype": "int8"}
    assert got["backward f0 int8"] == {**BEST, "fraction": 0.0, "state_dtype": "int8"}  # issue 46
    assert got["backward f0 sr8 pertensor"] == {
        **BEST, "fraction": 0.0, "state_dtype": "int8", "master_weights": "bf16-sr",
        "per_tensor": True}  # fmt: skip
    assert got["delayed f1 sr8"] == {
        **got["delayed f1"], "state_dtype": "int8", "master_weights": "bf16-sr"}  # fmt: skip
    assert got["backward f0.1 clip spec maxnorm100 copybk"] == {
        **CLIPPED, "fraction": 0.1, "speculate": True, "max_grad_norm": 100.0,
        "copy_backup": True}  # fmt: skip
    assert got["backward f0.3 clip spec nohold"] == {
        **CLIPPED, "fraction": 0.3, "speculate": True, "no_hold": True}  # fmt: skip
    # no number: not a variant; an unknown name: none (usage errors, below, name them)
    assert usage["overlap_bench.py", "--only nonsense f9 threads4"][0] == 2
    assert "'nonsense f9'" in usage["overlap_bench.py", "--only nonsense f9 threads4"][1]


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """profile_modes.py on the CPU: three configurations with --launches, then the defaults."""
    out = tmp_path_factory.mktemp("prof")
    small = ["--preset", "tiny", "--batch-size", "2", "--warmup", "1", "--steps", "1", "--top",
             "5", *CPU]  # fmt: skip
    configs = ["step:1", "backward:0.2:cpu_threads=8,grads_final=False", "step"]
    runs = as_program.run("profile_modes.py",
                          ["--configs", *configs, "--launches", *small, "--out", str(out / "a")],
                          [*small, "--out", str(out / "b")])  # fmt: skip
    assert [r["rc"] for r in runs] == [0, 0], [r["err"][-2000:] for r in runs]
    return [json.loads((out / d / "profile.json").read_text()) for d in ("a", "b")]


@pytest.mark.slow
def test_profile_modes_config_parses_options(profiled, usage):
    configs = [r["config"] for r in profiled[0]]
    assert configs == ["step:1.0", "backward:0.2:cpu_threads=8:grads_final=False", "step:0.0"]
    for bad, word in (("sideways:0.1", "sideways"), ("step:x", "step"), ("step:0.1:threads", "step")):  # fmt: skip
        rc, line, *_ = usage["profile_modes.py", f"--configs {bad}"]
        assert rc == 2 and word in line, line


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
    g = compute_gaps(trace)
    assert g["iterations"] == 1
    assert g["compute_busy_ms"] == pytest.approx(0.3)
    assert g["launch_bound_gap_ms"] == pytest.approx(0.29)
    assert g["wait_gap_ms"] == pytest.approx(0.1)
    assert dict(g["launching_thread_ms"]) == pytest.approx({"hook": 0.2, "inner": 0.1})
    assert compute_gaps({"traceEvents": []}) == {}


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
    r = launch_breakdown(trace)
    assert list(r) == ["offloadopt.launch_d2h"]
    row = r["offloadopt.launch_d2h"]
    assert row["count"] == 2
    assert row["ms"] == pytest.approx(0.15)
    assert row["ops_ms"] == pytest.approx({"aten::copy_": 0.03, "aten::record_stream": 0.01,
                                           "cudaEventRecord": 0.005})  # fmt: skip
    assert row["uncovered_ms"] == pytest.approx(0.15 - 0.045)
    assert row["runtime_ms"] == pytest.approx({"cudaMemcpyAsync": 0.02, "cudaEventRecord": 0.005})


@pytest.mark.slow
def test_profile_modes_records_the_workers_launch_ranges_on_the_cpu(profiled):
    """The worker is not the thread that starts the profiler: its ranges must still be there
    (pipeline._traced checked a per-thread flag, and every worker range was lost)."""
    # step mode: step() returns once every copy is queued, so both ranges fall in the window
    r = profiled[0][0]
    assert set(r["launches"]) == {"offloadopt.launch_d2h", "offloadopt.launch_h2d"}
    assert all(row["count"] >= 1 and row["ms"] > 0 for row in r["launches"].values())
    assert any(x["name"] == "offloadopt.cpu_update" for x in r["ranges"])


# --- the scripts' options: a usage error (status 2) naming the value, before anything is built --

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
# Anything built past the checks fails the run: the model, the text, the bench.
NOTHING_BUILT = """
import offloadopt.harness.bench as bench, offloadopt.harness.data as data
import offloadopt.harness.models as models
def built(*args, **kwargs):
    raise AssertionError("got past the checks")
models.build_model = data.load_text = bench.Bench = built
"""


def _usage_runs(out) -> dict[tuple[str, str], tuple]:
    """(script, key) -> (exit status, last line of stderr, whether --out exists, stdout) of
    every command line that must build nothing, two processes in all: the bad ones above (key:
    " ".join(argv)), overlap_bench.py's --help and its --list of VARIANTS ("--list variants")
    and of two names under --quick ("--list --quick")."""
    base = out / "baseline"  # the "base" variant's package, as --baseline-dir checks it
    (base / "offloadopt_base").mkdir(parents=True)
    (base / "offloadopt_base" / "__init__.py").write_text("")
    extra = {"overlap_bench.py": {
        "--only nonsense f9 threads4": ["--only", "nonsense f9 threads4"], "--help": ["--help"],
        "--list variants": ["--only", *VARIANTS, "--baseline-dir", str(base), "--list"],
        "--list --quick": ["--only", "f0", "backward f0.05 threads8 fifo", "--quick", "--list"]},
        "profile_modes.py": {f"--configs {c}": ["--configs", c]
                             for c in ("sideways:0.1", "step:x", "step:0.1:threads")}}  # fmt: skip
    found = {}
    for script, bad in (("overlap_bench.py", OVERLAP_BAD), ("profile_modes.py", PROFILE_BAD)):
        runs = {" ".join(a): a for a, _ in bad} | extra[script]
        dirs = [out / script / str(i) for i in range(len(runs))]
        lines = ([*a, *CPU, "--out", str(d)] for a, d in zip(runs.values(), dirs, strict=True))
        done = as_program.run(script, *lines, prelude=NOTHING_BUILT)
        for key, d, r in zip(runs, dirs, done, strict=True):
            err = r["err"].strip().splitlines() or [""]
            found[script, key] = (r["rc"], err[-1], d.exists(), r["out"])
    return found


@pytest.fixture(scope="module")
def usage(tmp_path_factory):
    return _usage_runs(tmp_path_factory.mktemp("usage"))


@pytest.mark.slow
@pytest.mark.parametrize("argv, message", OVERLAP_BAD, ids=[" ".join(a) for a, _ in OVERLAP_BAD])
def test_overlap_bench_checks_its_options_before_anything_is_built(argv, message, usage):
    rc, line, out_made, _ = usage["overlap_bench.py", " ".join(argv)]
    assert rc == 2, line
    assert line.startswith(f"error: {message}", line.index("error: ")), line
    assert not out_made


@pytest.mark.slow
@pytest.mark.parametrize("argv, message", PROFILE_BAD, ids=[" ".join(a) for a, _ in PROFILE_BAD])
def test_profile_modes_checks_its_options_before_anything_is_built(argv, message, usage):
    rc, line, _, _ = usage["profile_modes.py", " ".join(argv)]
    assert rc == 2, line
    assert line.startswith(f"error: {message}", line.index("error: ")), line


# A configuration at fraction 0.1 fails as HybridAdamW is built: the rest must run on.
BROKEN_AT_0_1 = """
import offloadopt
class Broken(offloadopt.HybridAdamW):
    def __init__(self, *args, offload_fraction=0.0, **kwargs):
        if offload_fraction == 0.1:
            raise RuntimeError("this configuration broke")
        super().__init__(*args, offload_fraction=offload_fraction, **kwargs)
offloadopt.HybridAdamW = Broken
"""


@pytest.mark.slow
def test_overlap_bench_exits_1_when_a_configuration_failed_and_keeps_the_rows(tmp_path):
    argv = ["--preset", "tiny", "--batch-size", "2", "--steps", "1", "--warmup", "0", "--no-probe",
            "--no-memory", "--only", "f0", "step f0.1", *CPU, "--out", str(tmp_path)]  # fmt: skip
    [r] = as_program.run("overlap_bench.py", argv, prelude=BROKEN_AT_0_1)
    assert r["rc"] == 1, r["err"]
    results = json.loads((tmp_path / "overlap.json").read_text())
    rows = results["configs"]
    assert [r["name"] for r in rows] == ["f0", "step f0.1"] and "step_ms" in rows[0]
    assert rows[1]["error"] == "RuntimeError: this configuration broke"
    assert "1 configuration(s) failed: step f0.1" in r["err"]
    assert results["args"]["seq_len"] == 128  # the tiny preset's longest


@pytest.mark.slow
def test_the_scripts_take_good_options_and_variants(profiled, usage):
    # --only is not limited by --quick
    rc, line, _, out = usage["overlap_bench.py", "--list --quick"]
    assert rc == 0, line
    assert list(_listed(out)) == ["f0", "backward f0.05 threads8 fifo"]
    assert [r["config"] for r in profiled[1]] == ["step:0.0"]  # profile_modes' default


@pytest.mark.slow
def test_overlap_bench_help_says_what_only_takes(usage):
    rc, _, _, out = usage["overlap_bench.py", "--help"]
    assert rc == 0
    text = " ".join(out.split())
    for word in ("threadsN", "bucketN", "switchN", "fifo", "'backward f0.2 threads8 switch1'",
                 "'delayed f1 clip'"):  # fmt: skip
        assert word in text, word


def _row(name, step_ms, fraction=0.0, **extra):
    return {"name": name, "fraction": fraction, "choice": None, "step_ms": step_ms,
            "step_ms_min": step_ms, "step_ms_max": step_ms, "to_backward_end_ms": step_ms / 2,
            "peak_gpu_gb": 1.0, **extra}  # fmt: skip


PROBE = {"main_alone_ns_per_param": 1.0, "main_link_ns_per_param": 1.5,
         "worker_alone_ns_per_param": 2.0, "worker_link_ns_per_param": 2.5}  # fmt: skip


SUMMARY_CASES = [
    ([_row("delayed f1", 30.0)], None),  # --only "delayed f1": no f0, --no-probe
    ([_row("f0", 10.0), _row("step f1", 40.0)], None),  # no sweep rows, no probe
    ([_row("f0 clip", 10.0), {"name": "backward f0.1 clip", "error": "boom"}], PROBE),
    ([_row("f0", 10.0), _row("backward auto", 10.5, 0.1, choice={}),
      _row("backward auto budget", 11.0, 0.3, choice={"max_gpu_memory": 0.5e9})], None),
    ([_row("f0", 10.0), _row("backward f0.1", 10.5, 0.1, grads_final=True),
      _row("backward f1", 20.0, 1.0)], PROBE),
]  # fmt: skip
EVERY_ROW = {"gpu": "none", "torch": "x", "args": {"batch_size": 4, "seq_len": 128},
             "params": 10**7, "configs": [_row("f0", 10.0), _row("backward f0.1", 10.5, 0.1),
                                          _row("delayed f1", 30.0, 1.0)],
             "kernel_probe": PROBE}  # fmt: skip


@pytest.fixture(scope="module")
def summaries(tmp_path_factory):
    """``overlap_bench.py --summary`` of each saved run above (the cases, then EVERY_ROW)."""
    tmp = tmp_path_factory.mktemp("summaries")
    paths = []
    for i, (rows, probe) in enumerate(SUMMARY_CASES):
        results = {"gpu": "none", "torch": "x", "params": 10**6,
                   "args": {"batch_size": 4, "seq_len": 128, "out": str(tmp)}, "configs": rows}  # fmt: skip
        if probe is not None:
            results["kernel_probe"] = probe
        paths.append(tmp / f"{i}.json")
        paths[-1].write_text(json.dumps(results))
    paths.append(tmp / "every.json")
    paths[-1].write_text(json.dumps(EVERY_ROW))
    runs = as_program.run("overlap_bench.py", *(["--summary", str(p), *CPU] for p in paths))
    assert all(r["rc"] == 0 for r in runs), [r["err"][-2000:] for r in runs]
    return [r["out"] for r in runs]


@pytest.mark.slow
@pytest.mark.parametrize("rows, probe", SUMMARY_CASES)
def test_overlap_bench_summary_says_n_a_for_what_was_not_run(rows, probe, summaries):
    out = summaries[next(i for i, case in enumerate(SUMMARY_CASES) if case[0] is rows)]
    lines = out.strip().splitlines()[1:]
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


@pytest.mark.slow
def test_overlap_bench_summary_keeps_its_figures_when_every_row_is_there(summaries):
    out = " ".join(summaries[-1].split())
    # the CPU pass: 2.5 ns x 1e7 params = 25 ms; fwd+bwd of f0 5 ms; 30 / max(5, 25) = 1.20
    assert "delayed f1 30.0 ms; / max(fwd+bwd 5, CPU pass 25) = 1.20" in out
    assert "sweep (no clipping): f0 10.0 ms; 0.1:1.05x; largest within 1.10x: 0.1" in out


# Each forward+backward of a configuration, a line on stdout (models.loss_fn's function).
COUNT_PASSES = """
import offloadopt.harness.models as models
made = models.loss_fn
def loss_fn(*args, **kwargs):
    inner = made(*args, **kwargs)
    def counted(*a, **k):
        print("pass", flush=True)
        return inner(*a, **k)
    return counted
models.loss_fn = loss_fn
"""


@pytest.mark.slow
def test_the_baseline_is_timed_without_a_sync_between_backward_and_step(tmp_path):
    """f0's forward+backward needs a sync before step(), which would also keep step()'s
    launches from overlapping backward; timed in the same iterations it made the baseline
    slower than the configurations it is the baseline of. It is timed in extra iterations:
    f0 runs warm-up + 2 x steps passes, any other configuration warm-up + steps."""
    small = ["--preset", "tiny", "--batch-size", "2", "--seq-len", "16", "--warmup", "1",
             "--steps", "2", "--no-probe", "--no-memory", *CPU]  # fmt: skip
    argv = [*small, "--only", "f0", "backward f0.1", "--out", str(tmp_path)]
    [r] = as_program.run("overlap_bench.py", argv, prelude=COUNT_PASSES)
    assert r["rc"] == 0, r["err"][-2000:]
    # each configuration's passes, then its row's line
    lines = [line.split()[0] for line in r["out"].splitlines() if line.strip()]
    assert lines[: 1 + 2 * 2 + 1 + 1 + 2 + 1] == ["pass"] * 5 + ["f0"] + ["pass"] * 3 + ["backward"]
    for row in json.loads((tmp_path / "overlap.json").read_text())["configs"]:
        assert math.isfinite(row["to_backward_end_ms"]) and math.isfinite(row["step_ms"])


@pytest.mark.slow
def test_timeline_marks_every_bucket_and_replays_its_table(tmp_path):
    """benchmarks/timeline.py on the CPU: each timed iteration's marks, the worker's per-bucket
    marks for every bucket, the table from the run and from its JSON."""
    argv = ["--device", "cpu", "--preset", "tiny", "--batch-size", "2", "--seq-len", "32",
            "--warmup", "1", "--steps", "3", "--out", str(tmp_path)]  # fmt: skip
    saved = str(tmp_path / "timeline-delayed-b2.json")
    first, replayed, missing = as_program.run(
        "timeline.py", argv, ["--replay", saved], ["--replay", str(tmp_path / "nope.json")]
    )
    assert first["rc"] == 0, first["err"][-2000:]
    meta = json.loads((tmp_path / "timeline-delayed-b2.json").read_text())
    kinds = [k for k, _, _ in meta["marks"]]
    assert kinds.count("iteration") == 3 and kinds.count("step_out") == 3
    starts = {b for k, b, _ in meta["marks"] if k == "update_start"}
    ends = {b for k, b, _ in meta["marks"] if k == "update_end"}
    assert starts and starts == ends == {b for k, b, _ in meta["marks"] if k == "h2d_launched"}
    assert meta["stats"]["buckets"] >= 1
    assert "period median" in first["out"]
    assert replayed["rc"] == 0
    last = replayed["out"].splitlines()[-1].split(";")[1]
    assert last == first["out"].splitlines()[-1].split(";")[1]
    assert missing["rc"] == 2 and "nope.json" in missing["err"]


# kernel_icount.py under a fake valgrind: what callgrind_annotate prints for one mode, the
# kernel's two functions and one of torch's (not counted for ours)
_ANNOTATED = """\
--------------------------------------------------------------------------------
5,470,941,108 (100.0%)  PROGRAM TOTALS
--------------------------------------------------------------------------------
413,665,085 ( 7.56%)  ???:_PyEval_EvalFrameDefault [libpython3.11.so]
20,522,985 ( 0.38%)  ???:isa_avx2::(anonymous namespace)::Kern<(M)1, true, (S)2, false>::span(Job const&, unsigned long) [k.so]
11,000,001 ( 0.25%)  ???:isa_avx2::(anonymous namespace)::Kern<(M)1, true, (S)2, false>::encode(Pending&) [k.so]
10,126,032 ( 0.19%)  ???:at::native::fused_adam_kernel(at::Tensor const&) [libtorch_cpu.so]
"""  # fmt: skip
FAKE_VALGRIND = f"""
import shutil, subprocess
ANNOTATED = {_ANNOTATED!r}
def run(cmd, **kwargs):
    out = ANNOTATED if cmd[0] == "callgrind_annotate" else ""
    return subprocess.CompletedProcess(cmd, 0, stdout=out, stderr="")
subprocess.run = run
shutil.which = lambda tool: "/usr/bin/" + tool
"""


def test_kernel_icount_sums_the_kernels_functions_per_element():
    """benchmarks/kernel_icount.py: per element, the kernel's own functions only (not torch's
    or Python's), over its 3 calls of --numel params; a bad mode or size is a usage error."""
    good, torch_row, bad_mode, bad_numel = as_program.run(
        "kernel_icount.py",
        ["--modes", "bf16m int8 state", "--numel", "1e6"],
        ["--modes", "torch fused fp32", "--numel", "1e6"],
        ["--modes", "bf16m int9 state"],
        ["--numel", "10"],
        prelude=FAKE_VALGRIND,
    )
    assert good["rc"] == 0, good["err"]
    row = good["out"].splitlines()[-1].split()
    # (20,522,985 + 11,000,001) / 3e6 = 10.51: span 6.84, encode 3.67
    assert row[3:] == ["10.51", "span", "6.84,", "encode", "3.67"], row
    assert torch_row["out"].splitlines()[-1].split()[3:] == ["3.38", "fused_adam", "3.38"]
    assert bad_mode["rc"] == 2 and "'bf16m int9 state'" in bad_mode["err"]
    assert bad_numel["rc"] == 2 and "--numel 10" in bad_numel["err"]
