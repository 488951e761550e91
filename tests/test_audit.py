"""offloadopt.audit on synthetic Chrome-trace events (CPU only), each against a slow reference."""

import importlib.util
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offloadopt.audit import PageableCopyError, audit, check_pinned, load_trace_events, summarize

PID, TID = 4242, 4242  # the Python thread
KINDS = ["Pinned", "Pageable", "Device", "Managed", "Array", "Unknown", "Device Static"]
DIRECTIONS = ["HtoD", "DtoH", "DtoD", "HtoH", "PtoP", "HtoA", "AtoD"]
FIXTURE = Path(__file__).parent / "fixtures" / "audit_trace_h200.json"


def memcpy(name, ts, dur, nbytes, corr=None, dev=0, stream=7, ext=None):
    args = {"device": dev, "stream": stream, "bytes": nbytes, "memory bandwidth (GB/s)": 0}
    args |= {"correlation": corr} if corr is not None else {}
    args |= {"External id": ext} if ext is not None else {}
    return {"ph": "X", "cat": "gpu_memcpy", "name": name, "pid": dev, "tid": stream, "ts": ts,
            "dur": dur, "args": args}  # fmt: skip


def kernel(ts, dur, dev=0, stream=7):
    return {"ph": "X", "cat": "kernel", "name": "gemm", "pid": dev, "tid": stream, "ts": ts,
            "dur": dur, "args": {"device": dev, "stream": stream}}  # fmt: skip


def runtime(corr, ts, dur=2, name="cudaMemcpyAsync", tid=TID):
    return {"ph": "X", "cat": "cuda_runtime", "name": name, "pid": PID, "tid": tid, "ts": ts,
            "dur": dur, "args": {"cbid": 41, "correlation": corr}}  # fmt: skip


def py(name, ts, dur, tid=TID):
    return {"ph": "X", "cat": "python_function", "name": name, "pid": PID, "tid": tid, "ts": ts,
            "dur": dur, "args": {}}  # fmt: skip


# --- slow, obvious references -------------------------------------------------------------------


def ref_key(name):
    """Parse 'Memcpy HtoD (Pinned -> Device)' with plain string operations."""
    if not name.startswith("Memcpy ") or " (" not in name or not name.endswith(")"):
        return ("other", "", "")
    direction, kinds = name[len("Memcpy ") :].split(" (", 1)
    if kinds.count(" -> ") != 1 or not direction.isalnum():
        return ("other", "", "")
    src, dst = kinds[:-1].split(" -> ")
    return (direction, src, dst)


def ref_overlap_us(copy, kernels):
    """Microseconds of an integer copy interval with any kernel of its device running."""
    start, end = copy["ts"], copy["ts"] + copy["dur"]
    same = [(k["ts"], k["ts"] + k["dur"]) for k in kernels if k["pid"] == copy["pid"]]
    return sum(any(s <= t < e for s, e in same) for t in range(start, end))


def ref_innermost_user(frames, t):
    """Innermost frame holding t (latest start, then shortest) that is user code."""
    holding = [f for f in frames if f["ts"] <= t <= f["ts"] + f["dur"]]
    holding.sort(key=lambda f: (-f["ts"], f["dur"]))
    user = [f["name"] for f in holding if not f["name"].startswith(("<", "torch/"))]
    return user[0] if user else None


def row(report, label):
    return next(r for r in report.rows if r.label == label)


# --- summarize ----------------------------------------------------------------------------------


def test_rows_by_direction_and_kind_with_pageable_detection():
    events = [
        memcpy("Memcpy HtoD (Pinned -> Device)", 0, 10, 1000),
        memcpy("Memcpy HtoD (Pinned -> Device)", 20, 30, 3000),
        memcpy("Memcpy HtoD (Pageable -> Device)", 60, 100, 500),
        memcpy("Memcpy DtoH (Device -> Pageable)", 200, 4, 4),
        memcpy("Memcpy DtoD (Device -> Device)", 300, 1, 64),
    ]
    report = summarize(events, resolve_lines=False)
    pinned = row(report, "HtoD (Pinned -> Device)")
    assert (pinned.count, pinned.nbytes, pinned.time_us, pinned.avg_us) == (2, 4000, 40.0, 20.0)
    assert not pinned.is_pageable
    assert {r.label for r in report.pageable_rows} == {
        "HtoD (Pageable -> Device)",
        "DtoH (Device -> Pageable)",
    }
    assert report.pageable_count == 2 and report.copy_count == 5
    assert json.loads(json.dumps(report.to_dict()))["pageable_count"] == 2


def test_bandwidth_is_bytes_over_time_in_decimal_gb():
    # 1e9 bytes in 1e6 us (one second) is 1 GB/s; 2 GiB in 40 ms is 53.687 GB/s
    events = [memcpy("Memcpy HtoD (Pinned -> Device)", 0, 1_000_000, 10**9)]
    assert row(summarize(events), "HtoD (Pinned -> Device)").bandwidth_gbps == pytest.approx(1.0)
    events = [memcpy("Memcpy DtoH (Device -> Pinned)", 0, 40_000, 2 * 2**30)]
    r = row(summarize(events), "DtoH (Device -> Pinned)")
    assert r.bandwidth_gbps == pytest.approx(2 * 2**30 / 0.04 / 1e9)
    assert r.time_ms == pytest.approx(40.0)
    zero = row(
        summarize([memcpy("Memcpy HtoD (Pinned -> Device)", 5, 0, 8)]), "HtoD (Pinned -> Device)"
    )
    assert zero.bandwidth_gbps is None  # no time, no bandwidth (not a division by zero)


def test_overlap_counts_the_union_of_kernels_on_the_same_device_only():
    copy = memcpy("Memcpy HtoD (Pinned -> Device)", 0, 100, 100, stream=20)
    kernels = [kernel(10, 20), kernel(20, 30, stream=8), kernel(60, 10, dev=1), kernel(95, 50)]
    r = row(summarize([copy, *kernels]), "HtoD (Pinned -> Device)")
    assert r.overlap_us == ref_overlap_us(copy, kernels) == 45  # [10, 50) and [95, 100)
    assert r.overlap_pct == pytest.approx(45.0)


def test_overlap_with_backward_counts_kernels_launched_inside_a_backward_range():
    """A kernel is backward's when its runtime launch (on any thread: autograd's) falls inside
    an offloadopt.step.backward annotation; the copy's overlap with those alone is "w/ bwd"."""
    from offloadopt.audit import BACKWARD_RANGE

    backward = {"ph": "X", "cat": "user_annotation", "name": BACKWARD_RANGE, "pid": PID,
                "tid": TID, "ts": 100, "dur": 50, "args": {}}  # fmt: skip
    other = dict(backward, name="offloadopt.forward", ts=0, dur=100)
    copy = memcpy("Memcpy DtoH (Device -> Pinned)", 0, 100, 100, stream=20)
    fwd_k, bwd_k, late_k = kernel(0, 30), kernel(40, 20), kernel(90, 20)
    for k, corr in ((fwd_k, 1), (bwd_k, 2), (late_k, 3)):
        k["args"]["correlation"] = corr
    launches = [runtime(1, 10), runtime(2, 120, tid=TID + 1), runtime(3, 160)]
    r = row(summarize([backward, other, copy, fwd_k, bwd_k, late_k, *launches],
                      resolve_lines=False), "DtoH (Device -> Pinned)")  # fmt: skip
    assert r.overlap_us == 60  # [0, 30), [40, 60), [90, 100)
    assert r.overlap_backward_us == 20 and r.overlap_backward_pct == pytest.approx(20.0)
    assert "w/ bwd %" in summarize([copy]).table()


def test_pageable_copy_is_attributed_to_the_innermost_user_frame():
    events = [
        py("train.py(3): <module>", 0, 1000),
        py("train.py(10): step", 100, 500),
        py("torch/optim/optimizer.py(480): wrapper", 150, 400),
        py("<built-in method to of Tensor object at 0x7f00>", 200, 100),
        py("train.py(30): log", 700, 100),
        py("<built-in method item of Tensor object at 0x7f01>", 720, 50),
        runtime(5, 240, 20),
        runtime(6, 730, 30),
        memcpy("Memcpy HtoD (Pageable -> Device)", 245, 10, 400, corr=5),
        memcpy("Memcpy DtoH (Device -> Pageable)", 750, 2, 4, corr=6),
    ]
    report = summarize(events)
    (h2d,) = row(report, "HtoD (Pageable -> Device)").call_sites
    assert h2d.frames == ("train.py(10): step", "train.py(3): <module>")
    assert (h2d.file, h2d.function) == ("train.py", "step")
    assert h2d.callee == "torch/optim/optimizer.py(480): wrapper > Tensor.to"
    (item,) = row(report, "DtoH (Device -> Pageable)").call_sites
    assert (item.frames[0], item.callee) == ("train.py(30): log", "Tensor.item")
    assert (
        ref_innermost_user([e for e in events if e["cat"] == "python_function"], 745)
        == (item.frames[0])
    )


def test_attribution_falls_back_to_flow_events_then_to_the_cpu_op():
    frames = [
        py("job.py(7): run", 0, 1000),
        py("<built-in method copy_ of Tensor object>", 100, 50),
    ]
    flow = [
        {"ph": "s", "id": 9, "pid": PID, "tid": TID, "ts": 120, "cat": "ac2g", "name": "ac2g"},
        {
            "ph": "f",
            "id": 9,
            "pid": 0,
            "tid": 7,
            "ts": 300,
            "cat": "ac2g",
            "name": "ac2g",
            "bp": "e",
        },
    ]
    via_flow = memcpy("Memcpy HtoD (Pageable -> Device)", 300, 5, 8)  # no correlation arg
    op = {"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "pid": PID, "tid": TID, "ts": 400,
          "dur": 20, "args": {"External id": 77}}  # fmt: skip
    via_op = memcpy("Memcpy DtoH (Device -> Pageable)", 500, 5, 8, ext=77)
    report = summarize([*frames, *flow, via_flow, op, via_op], resolve_lines=False)
    (s,) = row(report, "HtoD (Pageable -> Device)").call_sites
    assert (s.frames, s.callee) == (("job.py(7): run",), "Tensor.copy_")
    (s,) = row(report, "DtoH (Device -> Pageable)").call_sites
    assert s.frames == ("job.py(7): run",)
    # without with_stack there are no frames: the CPU op still says what issued the copy
    (s,) = row(summarize([op, via_op]), "DtoH (Device -> Pageable)").call_sites
    assert (s.frames, s.callee, str(s)) == ((), "aten::copy_", "<no Python stack> via aten::copy_")


def test_exact_line_of_item_is_read_from_the_source(tmp_path, monkeypatch):
    (tmp_path / "mymodel.py").write_text(
        "import torch\n"  # 1
        "\n"  # 2
        "def loss_value(x):\n"  # 3  <- the trace names the def line
        "    y = x * 2\n"  # 4
        "    return y.sum().item()\n"  # 5
        "\n"  # 6
        "with profiler() as p:\n"  # 7  <- a frame running when recording began
        "    z = torch.ones(3).to('cuda',\n"  # 8
        "        non_blocking=True)\n"  # 9
        "    w = z.item()\n"  # 10
        "v = z.item()\n"  # 11 (outside the with block)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    events = [
        py("mymodel.py(7): <module>", 0, 1000),
        py("mymodel.py(3): loss_value", 100, 100),
        py("<built-in method item of Tensor object at 0x1>", 150, 40),
        runtime(1, 160, 10),
        memcpy("Memcpy DtoH (Device -> Pageable)", 165, 2, 4, corr=1),
        py("<built-in method to of Tensor object at 0x2>", 300, 40),
        runtime(2, 310, 10),
        memcpy("Memcpy HtoD (Pageable -> Device)", 315, 2, 12, corr=2),
        py("<built-in method item of Tensor object at 0x3>", 400, 40),
        runtime(3, 410, 10),
        memcpy("Memcpy DtoH (Device -> Pageable)", 415, 2, 4, corr=3),
    ]
    report = summarize(events)
    sites = {s.frames[0]: s for s in row(report, "DtoH (Device -> Pageable)").call_sites}
    assert sites["mymodel.py(3): loss_value"].lines == (5,)
    assert str(sites["mymodel.py(3): loss_value"]) == "mymodel.py:5 in loss_value via Tensor.item"
    assert sites["mymodel.py(7): <module>"].lines == (10,)  # not 11: outside the with block
    (to,) = row(report, "HtoD (Pageable -> Device)").call_sites
    assert to.lines == (8,)
    assert summarize(events, resolve_lines=False).pageable_rows[0].call_sites[0].lines == ()


def test_unknown_names_and_malformed_events_go_to_other_and_never_crash():
    events = [
        memcpy("Memcpy HtoD (Pinned -> Device)", 0, 1, 8),
        memcpy("Memcpy weird", 0, 1, 8),
        memcpy("Memcpy HtoD (Pageable)", 0, 1, 8),
        {"ph": "X", "cat": "gpu_memcpy", "ts": "soon", "dur": None, "args": {"bytes": "many"}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy PtoP (Device -> Device)", "args": None},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Managed Static -> Device)"},
        {"cat": "kernel"},
        "not an event",
        {"ph": "f", "cat": "ac2g"},
    ]
    report = summarize(events)
    other = row(report, "other")
    assert other.count == 3 and other.nbytes == 16  # "many" bytes counts as 0
    assert other.is_pageable  # "Memcpy HtoD (Pageable)" must not hide a pageable copy
    assert row(report, "PtoP (Device -> Device)").count == 1
    assert row(report, "HtoD (Managed Static -> Device)").src_kind == "Managed Static"
    assert report.copy_count == 6
    assert "other" in report.table()
    assert summarize([]).rows == [] and summarize({"traceEvents": events}).copy_count == 6


def test_check_raises_listing_the_offending_copy_and_allow_pageable_passes():
    events = [
        py("train.py(10): step", 0, 100),
        py("<built-in method to of Tensor object at 0x7f00>", 10, 50),
        runtime(5, 20, 20),
        memcpy("Memcpy HtoD (Pageable -> Device)", 25, 10, 4096, corr=5),
        memcpy("Memcpy HtoD (Pinned -> Device)", 50, 10, 8192),
    ]
    report = summarize(events, resolve_lines=False)
    with pytest.raises(PageableCopyError) as info:
        report.check()
    msg = str(info.value)
    assert isinstance(info.value, RuntimeError)
    assert "HtoD (Pageable -> Device): 1 copies, 4096 bytes" in msg
    assert "train.py(10): step via Tensor.to" in msg and "Pinned" not in msg
    assert report.check(allow_pageable=True) is report
    pinned_only = summarize(events[-1:])
    assert pinned_only.check() is pinned_only and pinned_only.pageable_count == 0
    table = report.table()
    assert "<- PAGEABLE" in table and "train.py(10): step via Tensor.to" in table
    assert "Count" in table and "GB/s" in table and "Overlap %" in table


# --- property tests -----------------------------------------------------------------------------

interval = st.tuples(st.integers(0, 200), st.integers(0, 60))


@settings(max_examples=200, deadline=None, database=None)
@given(
    copies=st.lists(st.tuples(interval, st.integers(0, 1), st.integers(0, 10**9)), max_size=6),
    kernels=st.lists(st.tuples(interval, st.integers(0, 1), st.integers(0, 3)), max_size=12),
)
def test_overlap_and_totals_match_the_sampling_reference(copies, kernels):
    cs = [memcpy("Memcpy HtoD (Pinned -> Device)", s, d, b, dev=dev) for (s, d), dev, b in copies]
    ks = [kernel(s, d, dev=dev, stream=st_) for (s, d), dev, st_ in kernels]
    report = summarize([*ks, *cs], resolve_lines=False)
    if not cs:
        assert report.rows == []
        return
    (r,) = report.rows
    assert r.count == len(cs) and r.nbytes == sum(c["args"]["bytes"] for c in cs)
    assert r.time_us == sum(c["dur"] for c in cs)
    assert r.overlap_us == sum(ref_overlap_us(c, ks) for c in cs)
    assert 0 <= r.overlap_us <= r.time_us
    if r.time_us:
        assert r.bandwidth_gbps == pytest.approx(r.nbytes / (r.time_us * 1e-6) / 1e9)


@settings(max_examples=300, deadline=None, database=None)
@given(st.lists(st.tuples(st.sampled_from(DIRECTIONS + ["??", ""]), st.sampled_from(KINDS),
                          st.sampled_from(KINDS), st.text(max_size=12)), max_size=8))  # fmt: skip
def test_names_parse_like_the_string_reference(specs):
    names = [f"Memcpy {d} ({s} -> {t})" if i % 3 else junk for i, (d, s, t, junk) in
             enumerate(specs)]  # fmt: skip
    report = summarize([memcpy(n, 0, 1, 1) for n in names], resolve_lines=False)
    expected = {}
    for n in names:
        expected[ref_key(n)] = expected.get(ref_key(n), 0) + 1
    got = {(r.direction, r.src_kind, r.dst_kind): r.count for r in report.rows}
    assert got == expected


@st.composite
def nested_frames(draw, lo=0, hi=1000, depth=0):
    """Properly nested Python frames: children strictly inside their parent, disjoint."""
    frames, cursor = [], lo + 1
    for _ in range(draw(st.integers(0, 3 if depth < 4 else 0))):
        if hi - 1 - cursor < 4:
            break
        s = draw(st.integers(cursor, hi - 4))
        e = draw(st.integers(s + 3, hi - 1))
        kind = draw(st.sampled_from(["user", "torch", "builtin"]))
        name = {"user": f"u{s}.py({s}): f", "torch": f"torch/m.py({s}): g",
                "builtin": f"<built-in method m{s} of Tensor object at 0x0>"}[kind]  # fmt: skip
        frames += [py(name, s, e - s), *draw(nested_frames(s, e, depth + 1))]
        cursor = e + 1
    return frames


@settings(max_examples=300, deadline=None, database=None)
@given(frames=nested_frames(), t=st.integers(0, 1000))
def test_attribution_matches_the_linear_scan_reference(frames, t):
    events = [
        *frames,
        runtime(1, t, 0),
        memcpy("Memcpy HtoD (Pageable -> Device)", t, 1, 8, corr=1),
    ]
    (site,) = summarize(events, resolve_lines=False).rows[0].call_sites
    expected = ref_innermost_user(frames, t)
    if expected is not None:
        assert site.frames[0] == expected
    else:
        assert not any(f.endswith(": f") for f in site.frames)


# --- the context manager, check_pinned, the real trace ------------------------------------------


def test_audit_records_a_region_and_keeps_the_trace(tmp_path):
    path = tmp_path / "trace.json"
    with audit(trace_path=path) as a:
        torch.ones(64) + 1
    assert a.report is not None and a.report.copy_count == 0  # nothing crossed a link
    assert a.trace_path == str(path) and load_trace_events(path)
    with audit() as b:
        torch.ones(4).sum()
    assert b.report is not None and b.trace_path is None
    with pytest.raises(ValueError), audit() as c:
        raise ValueError("the block failed")
    assert c.report is None


class _FakePinned:
    """Looks like a pinned host tensor (a CPU-only torch cannot make one)."""

    device, shape, dtype = torch.device("cpu"), (2,), torch.bfloat16

    def numel(self):
        return 2

    def is_pinned(self):
        return True


def test_check_pinned_lists_unpinned_crossing_tensors():
    master = torch.zeros(4, 3)
    crossing = [("bucket0.weights", master), ("bucket0.grads", _FakePinned())]
    crossing += [("bucket1.weights (empty)", torch.empty(0))]
    opt = SimpleNamespace(crossing_host_tensors=lambda: crossing)
    assert check_pinned(opt) == [
        "bucket0.weights: shape (4, 3) torch.float32, 48 bytes, not pinned"
    ]
    assert check_pinned(SimpleNamespace(crossing_host_tensors=lambda: [])) == []


def test_check_pinned_falls_back_to_optimizer_state():
    p_dev, p_cpu = torch.empty(8, device="meta"), torch.empty(8)  # meta stands in for CUDA
    state = {
        p_dev: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(8), "exp_avg_sq": _FakePinned()},
        p_cpu: {"exp_avg": torch.zeros(8)},  # a CPU param: its state never crosses
    }
    opt = SimpleNamespace(param_groups=[{"params": [p_cpu, p_dev]}], state=state)
    assert check_pinned(opt) == [
        "param_groups[0].params[1] state['exp_avg']: shape (8,) torch.float32, 32 bytes, not pinned"
    ]


def _load_expectations():
    spec = importlib.util.spec_from_file_location(
        "record_fixture", Path(__file__).parent / "cuda" / "record_fixture.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.expectations


@pytest.mark.skipif(not FIXTURE.exists(), reason=f"{FIXTURE.name} not recorded yet")
def test_real_h200_trace():
    events = load_trace_events(FIXTURE)
    report = summarize(events, resolve_lines=False)
    memcpys = [e for e in events if e.get("cat") == "gpu_memcpy" and e.get("ph") == "X"]
    assert report.copy_count == len(memcpys) > 0
    assert sum(r.nbytes for r in report.rows) == sum(e["args"]["bytes"] for e in memcpys)
    assert sum(r.time_us for r in report.rows) == pytest.approx(sum(e["dur"] for e in memcpys))
    for r in report.rows:
        assert sum(s.count for s in r.call_sites) == r.count
        assert sum(s.nbytes for s in r.call_sites) == r.nbytes
    assert row(report, "HtoD (Pinned -> Device)").count >= 1
    assert _load_expectations()(report, events) == []


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


# --- the profiler's own output stays out of the audit's ------------------------------------------


def test_the_profilers_own_lines_are_dropped_and_others_kept(capfd):
    import warnings

    from offloadopt.audit import quiet_profiler

    noise = (
        b"STAGE:2026-12-03 08:00:00 1:1 ActivityProfilerController.cpp:312] Completed Stage: Warm Up\n"
        b"USDT:2026-12-03 08:16:01 10748:10748 SyncActivityProfilerHandler.cpp:52] profiler_start\n"
    )
    with pytest.warns(UserWarning, match="a real one"):
        with quiet_profiler():
            os.write(2, noise + b"RuntimeError: a real error\n")
            warnings.warn("a real one", UserWarning, stacklevel=1)
    err = capfd.readouterr().err
    assert err == "RuntimeError: a real error\n"


def test_an_audit_prints_nothing_of_the_profilers(capfd):
    from offloadopt.audit import PROFILER_NOISE, audit

    with audit() as a:
        (torch.ones(1000) * 2).sum()
    captured = capfd.readouterr()
    assert a.report is not None
    noise = [
        line for line in (captured.out + captured.err).splitlines() if PROFILER_NOISE.search(line)
    ]
    assert noise == []


def test_the_audit_counts_speculative_and_redone_updates(capsys, monkeypatch):
    """--overlap backward-speculate (speculate=True, max_grad_norm=1.0): the audited iterations'
    speculative and redone bucket updates, beside the copies (a redone bucket's cross twice).
    Every step speculates here (MAX_HOLD 0): the tiny preset's steps all clip, so by default
    they would be held back after the first (speculate.py's FOLLOW_CLIP)."""
    from offloadopt.cli import main
    from offloadopt.step.speculate import Speculation

    monkeypatch.setattr(Speculation, "MAX_HOLD", 0)

    assert main(["audit", "--device", "cpu", "--preset", "tiny", "--overlap", "backward-speculate",
                 "--offload-fraction", "1", "--steps", "2", "--warmup", "1"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    summary = json.loads(out.strip().splitlines()[-1])
    spec = summary["speculation"]
    # the audited ones, not warm-up's
    assert spec["steps"] == 2 and spec["held_back"] == 0, spec
    assert spec["buckets"] >= 1, spec
    assert spec["redone_clip"] + spec["redone_inf"] <= 2 and spec["backup_nbytes"] > 0
    assert "speculative updates:" in out


def test_an_optimizer_with_no_fraction_reports_none(capsys):
    """A new user's find: ``audit --optimizer adamw`` (no offload) printed and reported
    ``"offload_fraction": 1.0``; a fraction is reported only for the optimizers that take one."""
    from offloadopt.cli import main

    base = ["audit", "--device", "cpu", "--preset", "tiny", "--steps", "1", "--warmup", "0"]
    assert main([*base, "--optimizer", "adamw"]) == 0
    out = capsys.readouterr().out
    assert json.loads(out.strip().splitlines()[-1])["offload_fraction"] is None
    assert "fraction" not in out.splitlines()[0], out.splitlines()[0]
    assert main([*base, "--offload-fraction", "0.5"]) == 0  # hybrid's is reported
    out = capsys.readouterr().out
    assert json.loads(out.strip().splitlines()[-1])["offload_fraction"] == 0.5
    assert "(fraction 0.5, step mode)" in out
