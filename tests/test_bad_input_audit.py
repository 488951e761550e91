"""Bad input to the audit helpers: summarize() never raises on malformed events, check_pinned()
refuses what is not an optimizer, load_trace_events() names a file that is not a trace, and
audit() checks its trace path before the region runs and never leaves half a file."""

import gzip
import json
import math
import os
import re
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offloadopt.audit import AuditReport, audit, check_pinned, load_trace_events, summarize


def memcpy(**fields):
    event = {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pageable -> Device)",
             "pid": 0, "tid": 7, "ts": 10, "dur": 2, "args": {"bytes": 8, "correlation": 1}}  # fmt: skip
    return {**event, **fields}


# --- summarize ------------------------------------------------------------------------------------


def test_the_malformed_events_that_raised_are_counted_not_fatal():
    events = [
        memcpy(args={"bytes": math.nan}),
        memcpy(args={"bytes": "Infinity", "correlation": [1]}),
        memcpy(args={"bytes": 10**400}),  # beyond a float: counts as 0, not OverflowError
        memcpy(pid=[0], tid={"stream": 7}, ts=math.inf, dur=-math.inf),
        {"ph": "X", "cat": "kernel", "pid": [0], "ts": "soon", "dur": math.nan},
        {"ph": "f", "cat": "ac2g", "pid": [0], "tid": 7, "ts": [10], "id": {"a": 1}},
        {"ph": "s", "cat": "ac2g", "id": [1]},
        {"ph": "X", "cat": "cpu_op", "args": {"External id": [3]}},
        {"ph": "X", "cat": "cuda_runtime", "pid": [1], "args": {"correlation": {"x": 1}}},
        {"ph": "X", "cat": "python_function", "pid": [1], "tid": 1, "name": "f.py(" + "9" * 5000 + "): g"},
        {"ph": ["X"], "cat": ["kernel"], "name": b"bytes"},
        memcpy(),
    ]  # fmt: skip
    report = summarize(events)
    (row,) = report.rows
    assert row.count == 5 and row.nbytes == 2 * 8 and row.time_us == 4 * 2  # NaN, inf: 0
    assert report.kernel_count == 1 and math.isfinite(report.kernel_time_us)
    json.dumps(report.to_dict())  # finite numbers only: it still serialises
    assert "5 copies, 5 pageable" in report.table()


def test_bad_arguments_raise_at_once_naming_them():
    with pytest.raises(TypeError, match=r"^depth: got str 'x', not an int$"):
        summarize([memcpy()], depth="x")
    with pytest.raises(ValueError, match=r"^depth: 0 is not >= 1$"):
        summarize([], depth=0)
    with pytest.raises(TypeError, match=r"internal: got str"):
        summarize([], internal="torch/")
    with pytest.raises(ValueError, match=r"internal: '\(' is not a regex"):
        summarize([], internal=("(",))
    with pytest.raises(TypeError, match=r"load_trace_events\(path\)"):
        summarize("trace.json")
    with pytest.raises(TypeError, match=r"^trace_events: got int 42"):
        summarize({"traceEvents": 42})
    assert summarize(e for e in [memcpy()]).copy_count == 1  # any iterable of events
    assert summarize([memcpy()], internal=()).copy_count == 1  # no frame is internal


# JSON values of every kind, for any field of an event
scalar = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
json_value = st.recursive(
    scalar, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)  # fmt: skip
ids = st.integers(0, 3) | json_value
event = st.fixed_dictionaries(
    {},
    optional={
        "ph": st.sampled_from(["X", "s", "f", "i"]) | json_value,
        "cat": st.sampled_from(["gpu_memcpy", "kernel", "cuda_runtime", "cpu_op",
                                "python_function", "ac2g"]) | json_value,
        "name": st.sampled_from(["Memcpy HtoD (Pageable -> Device)", "Memcpy DtoH (x",
                                 "train.py(3): step", "<built-in method item of Tensor object>",
                                 "torch/nn/m.py(1): f"]) | json_value,
        "pid": ids, "tid": ids, "id": ids, "ts": st.integers(0, 50) | json_value,
        "dur": st.integers(0, 50) | json_value,
        "args": st.fixed_dictionaries({}, optional={"bytes": st.integers(0, 99) | json_value,
                                                    "correlation": ids, "External id": ids})
        | json_value,
    },
)  # fmt: skip


@settings(max_examples=150, deadline=None, database=None)
@given(events=st.lists(event | json_value, max_size=12))
def test_summarize_never_raises_on_any_json_events(events):
    report = summarize(events)
    assert isinstance(report, AuditReport)
    assert report.copy_count == sum(r.count for r in report.rows)
    for r in report.rows:
        assert r.nbytes >= 0 and math.isfinite(r.time_us) and r.time_us >= 0
        assert sum(s.count for s in r.call_sites) == r.count
    report.table()
    json.dumps(report.to_dict())


# --- check_pinned ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "given, shown",
    [(None, "NoneType None"), (42, "int 42"), ("opt", "str 'opt'"),
     (torch.zeros(2), "Tensor tensor([0., 0.])"), ([torch.zeros(2)], "list [tensor([0., 0.])]")],
)  # fmt: skip
def test_check_pinned_refuses_what_is_not_an_optimizer(given, shown):
    with pytest.raises(
        TypeError, match=rf"^check_pinned: got {re.escape(shown)}, not an optimizer"
    ):
        check_pinned(given)


def test_check_pinned_refuses_a_malformed_optimizer():
    with pytest.raises(TypeError, match=r"crossing_host_tensors\(\) gave str 'weights'"):
        check_pinned(SimpleNamespace(crossing_host_tensors=lambda: ["weights"]))
    with pytest.raises(TypeError, match=r"param_groups\[0\] is dict \{'lr': 0.1\}"):
        check_pinned(SimpleNamespace(param_groups=[{"lr": 0.1}], state={}))
    with pytest.raises(TypeError, match=r"param_groups\[0\] is dict"):
        check_pinned(SimpleNamespace(param_groups=[{"params": ["w"]}], state={}))
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))])
    assert check_pinned(opt) == []  # a real optimizer: CPU params never cross


# --- load_trace_events ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content, says",
    [(bytes(range(256)) * 8, "not a Chrome trace (JSON)"),
     (b"\xff\xfe\x00garbage", "not a Chrome trace (JSON)"),
     (b'{"traceEvents": [', "not a Chrome trace (JSON)"),
     (gzip.compress(b"[1, 2")[:-6], "not a Chrome trace (JSON)"),
     (b"42", "not a Chrome trace: a number, not an object with a traceEvents list"),
     (b'"events"', "not a Chrome trace: a string"),
     (b'{"traceEvents": {"a": 1}}', "not a Chrome trace: an object without a traceEvents list"),
     (b"{}", "not a Chrome trace: an object without a traceEvents list")],
    ids=["binary", "utf16-junk", "cut-short", "cut-short-gzip", "number", "string", "dict", "empty"],
)  # fmt: skip
def test_load_trace_events_names_the_file_that_is_not_a_trace(tmp_path, content, says):
    path = tmp_path / "trace.json"
    path.write_bytes(content)
    with pytest.raises(ValueError) as info:
        load_trace_events(path)
    assert str(info.value).startswith(f"{path}: {says}")


def test_load_trace_events_reads_gzip_by_its_bytes_and_bare_lists(tmp_path):
    (tmp_path / "named.json").write_bytes(gzip.compress(b'{"traceEvents": [{"ph": "X"}]}'))
    assert load_trace_events(tmp_path / "named.json") == [{"ph": "X"}]
    (tmp_path / "list.json").write_text("[{}, 3]")
    assert load_trace_events(tmp_path / "list.json") == [{}, 3]  # summarize skips the 3
    with pytest.raises(FileNotFoundError):
        load_trace_events(tmp_path / "missing.json")


# --- audit(trace_path=...) ------------------------------------------------------------------------


def test_audit_checks_its_trace_path_and_kwargs_before_the_block_runs(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "kept").write_text("x")
    ran = []
    for path, says in [(tmp_path / "empty", "is a folder"), (tmp_path / "full", "is a folder"),
                       (tmp_path / "no" / "t.json", "no folder"), ("", "is not a file name")]:  # fmt: skip
        with pytest.raises(ValueError, match=f"^trace_path: .*{says}"), audit(trace_path=path):
            ran.append(path)
    with pytest.raises(TypeError, match="depth"), audit(depth="x"):
        ran.append("depth")
    with pytest.raises(TypeError, match="unexpected keyword"), audit(dpeth=3):
        ran.append("dpeth")
    assert ran == []
    assert sorted(os.listdir(tmp_path)) == ["empty", "full"]  # no file, no <dir>.tmp
    assert os.listdir(tmp_path / "empty") == [] and os.listdir(tmp_path / "full") == ["kept"]


def test_audit_writes_the_trace_whole_and_leaves_no_temporary_file(tmp_path):
    for name in ("t.json", "t.json.gz"):
        with audit(trace_path=tmp_path / name) as a:
            torch.ones(8).sum()
        assert a.report is not None and load_trace_events(tmp_path / name)
    assert sorted(os.listdir(tmp_path)) == ["t.json", "t.json.gz"]
    assert (tmp_path / "t.json.gz").read_bytes()[:2] == b"\x1f\x8b"
