"""Streamed checkpoints (opt.save_streamed / opt.load_streamed, offloadopt/state/streamed.py):
a resume in a fresh optimizer and model is bitwise the uninterrupted run in every mode and
representation; the folder holds the stored representation (no fp32 moments beside int8
codes); a checkpoint that does not fit is refused before anything changes; an interrupted save
keeps the previous checkpoint; and saving does not copy the state in host memory."""

from __future__ import annotations

import datetime
import os
import re

import pytest
import torch

from offloadopt import HybridAdamW, HybridSGD
from offloadopt.state import streamed

SETTINGS = {
    "fp32": {},
    "int8": dict(state_dtype="int8"),
    "bf16-sr+int8": dict(state_dtype="int8", master_weights="bf16-sr"),
}
MODES = {
    "step": {},
    "backward": dict(overlap="backward", grads_final=True),
    "delayed": dict(overlap="delayed"),
}


def model(seed=0, dtype=torch.bfloat16):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 300), torch.nn.Tanh(), torch.nn.Linear(300, 8)
    ).to(dtype)


def batch(i):
    return torch.randn(16, 64, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)


def build(m, **kw):
    opt = HybridAdamW(m.parameters(), lr=1e-2, weight_decay=0.1, offload_fraction=0.5,
                      min_offload_numel=1, **kw)  # fmt: skip
    if kw.get("overlap") == "delayed":
        opt.watch(m)
    return opt


def train(m, opt, start, stop):
    for i in range(start, stop):
        m(batch(i)).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def snapshot(m, opt):
    opt.synchronize()
    return [p.detach().clone() for p in m.parameters()], {
        i: {k: v.clone() for k, v in opt.state[p].items()} for i, p in enumerate(m.parameters())
    }


def assert_same(a, b):
    (wa, sa), (wb, sb) = a, b
    for x, y in zip(wa, wb, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert sa.keys() == sb.keys()
    for i in sa:
        assert sa[i].keys() == sb[i].keys(), i
        for k in sa[i]:
            torch.testing.assert_close(sa[i][k], sb[i][k], rtol=0, atol=0, msg=f"{i} {k}")


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_a_resume_in_a_fresh_process_is_bitwise_the_uninterrupted_run(tmp_path, setting, mode):
    kw = {**SETTINGS[setting], **MODES[mode]}
    m0 = model()
    o0 = build(m0, **kw)
    train(m0, o0, 0, 3)
    # A save synchronizes: with the delayed update the next forward then reads the newest
    # weights (docs/modes.md), so the uninterrupted run synchronizes at the same point.
    o0.synchronize()
    train(m0, o0, 3, 6)
    m1 = model()
    o1 = build(m1, **kw)
    train(m1, o1, 0, 3)
    nbytes = o1.save_streamed(str(tmp_path / "ck"), model=m1, extra={"step": 3, "note": "x"})
    assert nbytes == sum(e.stat().st_size for e in os.scandir(tmp_path / "ck"))
    o1.close()
    m2 = model(seed=1)  # other weights: the checkpoint's must replace them
    o2 = build(m2, **kw)
    assert o2.load_streamed(str(tmp_path / "ck"), model=m2) == {"step": 3, "note": "x"}
    train(m2, o2, 3, 6)
    assert_same(snapshot(m2, o2), snapshot(m0, o0))
    assert streamed.read_extra(str(tmp_path / "ck")) == {"step": 3, "note": "x"}
    o0.close()
    o2.close()


def test_the_folder_holds_the_stored_representation(tmp_path):
    """int8: codes and scales, no fp32 moments; fewer bytes than torch.save of state_dict()."""
    m = model()
    opt = build(m, state_dtype="int8")
    train(m, opt, 0, 2)
    n = opt.save_streamed(str(tmp_path / "ck"))
    index = torch.load(tmp_path / "ck" / "index.pt", weights_only=True)
    keys = {k.rsplit("/", 1)[-1] for k in index["items"]}
    assert keys == {"master", "exp_avg_q", "exp_avg_scale", "exp_avg_sq_q", "exp_avg_sq_scale"}
    torch.save(opt.state_dict(), tmp_path / "sd.pt")
    assert n < 0.6 * os.path.getsize(tmp_path / "sd.pt")
    opt.close()


def test_a_checkpoint_of_another_representation_loads_as_state_dict_would(tmp_path):
    """An fp32 checkpoint into int8 state: the moments are encoded on load (as a
    load_state_dict of the same state does), and the weights are the checkpoint's."""
    m = model()
    opt = build(m)
    train(m, opt, 0, 3)
    opt.save_streamed(str(tmp_path / "ck"))
    sd = opt.state_dict()
    a, b = model(seed=1), model(seed=1)
    oa, ob = build(a, state_dtype="int8"), build(b, state_dtype="int8")
    oa.load_streamed(str(tmp_path / "ck"))
    ob.load_state_dict(sd)
    assert_same(snapshot(a, oa), snapshot(b, ob))
    for o in (opt, oa, ob):
        o.close()


@pytest.mark.parametrize("case", ["not-a-folder", "not-ours", "other-model", "other-rule",
                                  "other-shapes"])  # fmt: skip
def test_a_checkpoint_that_does_not_fit_is_refused_and_changes_nothing(tmp_path, case):
    m = model()
    opt = build(m, state_dtype="int8")
    train(m, opt, 0, 2)
    path = str(tmp_path / "ck")
    if case == "not-a-folder":
        open(path, "w").close()
        match = "not a folder"
    elif case == "not-ours":
        os.makedirs(path)
        torch.save({"x": torch.zeros(3)}, os.path.join(path, "index.pt"))
        match = "not a streamed checkpoint"
    elif case == "other-rule":
        w = torch.nn.Linear(4, 4)
        sgd = HybridSGD(w.parameters(), lr=0.1, momentum=0.9)
        w(torch.ones(2, 4)).sum().backward()
        sgd.step()
        sgd.save_streamed(path)
        sgd.close()
        match = "HybridSGD"
    else:
        other = model() if case == "other-model" else torch.nn.Sequential(
            torch.nn.Linear(64, 301), torch.nn.Tanh(), torch.nn.Linear(301, 8)
        ).to(torch.bfloat16)  # fmt: skip
        o = build(other, state_dtype="int8")
        train(other, o, 0, 1)
        if case == "other-model":  # the optimizer fits, the model does not
            extra = torch.nn.Linear(2, 2).to(torch.bfloat16)
            o.save_streamed(path, model=torch.nn.Sequential(other, extra))
            match = "model's tensors differ"
        else:
            o.save_streamed(path)
            match = "shape"
        o.close()
    before = snapshot(m, opt)
    with pytest.raises(ValueError, match=match):
        opt.load_streamed(path, model=m if case == "other-model" else None)
    assert_same(snapshot(m, opt), before)
    train(m, opt, 2, 3)  # still usable
    opt.close()


def test_an_interrupted_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    m = model()
    opt = build(m, state_dtype="int8")
    train(m, opt, 0, 2)
    path = str(tmp_path / "ck")
    opt.save_streamed(path, extra="first")
    train(m, opt, 2, 3)
    monkeypatch.setattr(streamed, "PART_NBYTES", 4096)  # many parts
    real, calls = streamed.fsync_save, []

    def fails(obj, file):
        calls.append(file)
        if len(calls) == 3:
            raise KeyboardInterrupt  # after two parts were written
        return real(obj, file)

    monkeypatch.setattr(streamed, "fsync_save", fails)
    with pytest.raises(KeyboardInterrupt):
        opt.save_streamed(path, extra="second")
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # no temporary folder left
    assert streamed.read_extra(path) == "first"
    monkeypatch.setattr(streamed, "fsync_save", real)
    opt.save_streamed(path, model=m, extra="third")  # many parts: it reads back whole
    assert len([f for f in os.listdir(path) if f.startswith("part-")]) > 10
    m2 = model(seed=1)
    o2 = build(m2, state_dtype="int8")
    assert o2.load_streamed(path, model=m2) == "third"
    assert_same(snapshot(m2, o2), snapshot(m, opt))
    o2.close()
    with pytest.raises(FileExistsError, match="not a streamed checkpoint"):
        open(tmp_path / "file", "w").close()
        opt.save_streamed(str(tmp_path / "file"))
    opt.close()


def _rss_peak_reset() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM (Linux)
        return True
    except OSError:
        return False


def _hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


@pytest.mark.slow
def test_saving_does_not_copy_the_state_in_host_memory(tmp_path):
    """Offloaded int8 state of 24M params (about 145 MB on the host): state_dict() grows the
    host peak by more than the state; save_streamed by a small part of it."""
    if not _rss_peak_reset():
        pytest.skip("no /proc/self/clear_refs here")
    m = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(6)]).to(torch.bfloat16)
    opt = HybridAdamW(m.parameters(), state_dtype="int8", offload_fraction=1.0)
    m(torch.ones(2, 2048, dtype=torch.bfloat16)).float().sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    state = opt.host_nbytes
    _rss_peak_reset()
    base = _hwm()
    opt.save_streamed(str(tmp_path / "ck"))
    streamed_growth = _hwm() - base
    _rss_peak_reset()
    base = _hwm()
    sd = opt.state_dict()
    snapshot_growth = _hwm() - base
    del sd
    assert snapshot_growth > state
    assert streamed_growth < 0.25 * state, (streamed_growth, state)
    opt.close()


def test_a_fresh_users_findings_on_streamed_checkpoints(tmp_path):
    """Meta-device params: the load places the groups first (the loaded state drove nothing
    after the first step's placement). An extra that torch.load(weights_only=True) cannot
    read is refused before the previous checkpoint is replaced. A missing part, or a part
    whose tensor disagrees with the index, is a ValueError before anything changes."""
    import argparse

    m = model()
    opt = build(m, state_dtype="int8")
    train(m, opt, 0, 2)
    path = str(tmp_path / "ck")
    opt.save_streamed(path, model=m, extra={"step": 2})
    with pytest.raises(ValueError, match="weights_only"):
        opt.save_streamed(path, extra=argparse.Namespace(a=1))
    assert streamed.read_extra(path) == {"step": 2}
    train(m, opt, 2, 4)
    expected = snapshot(m, opt)

    with torch.device("meta"):
        late = model()
    lo = build(late, state_dtype="int8")
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        late.to_empty(device="cpu")
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    lo.load_streamed(path, model=late)
    train(late, lo, 2, 4)
    assert_same(snapshot(late, lo), expected)

    index = torch.load(os.path.join(path, "index.pt"), weights_only=True)
    part = os.path.join(path, "part-00000.pt")
    saved = torch.load(part, weights_only=True)
    name = next(iter(saved))
    torch.save({**saved, name: saved[name].reshape(-1)[:1].clone()}, part)
    before = snapshot(m, opt)
    with pytest.raises(ValueError, match="damaged"):
        opt.load_streamed(path, model=m)  # its size differs from the index's
    old = {k: v for k, v in index.items() if k not in ("part_nbytes", "part_checksums")}
    torch.save({**old, "version": 1}, os.path.join(path, "index.pt"))  # before sizes, checksums
    with (
        pytest.raises(ValueError, match="damaged or mixed-up"),
        pytest.warns(match="before checksums"),
    ):
        opt.load_streamed(path, model=m)  # an index without sizes: found before any change
    os.remove(part)
    with pytest.raises(ValueError, match="lacks part files"):
        opt.load_streamed(path, model=m)
    assert_same(snapshot(m, opt), before)
    assert index["items"]
    for o in (opt, lo):
        o.close()


def test_save_paths_a_symlink_an_empty_folder_and_a_killed_saves_leftovers(tmp_path):
    """A fresh user's findings: a symlinked path was replaced by a folder; an existing empty
    folder was refused; the temporary folders' names were fixed per process, so a leftover of
    an interrupted save made every later save of that process fail, and a save killed between
    its two renames left the previous checkpoint under a hidden name, never cleaned up."""
    m = model()
    opt = build(m, state_dtype="int8")
    train(m, opt, 0, 1)
    real = tmp_path / "real"
    real.mkdir()  # empty: taken
    link = tmp_path / "link"
    link.symlink_to(real)
    opt.save_streamed(str(link), extra="one")
    assert link.is_symlink() and streamed.read_extra(str(real)) == "one"
    opt.save_streamed(str(link), extra="two")
    assert link.is_symlink() and streamed.read_extra(str(link)) == "two"
    # a leftover of this process's interrupted save: later saves still work
    os.makedirs(tmp_path / f".real.{os.getpid()}.zz.old")
    opt.save_streamed(str(real), extra="three")
    assert streamed.read_extra(str(real)) == "three"
    # a save killed between its renames: the checkpoint is the .old of a dead process
    dead = 2**22 + 12345  # above the default pid_max: no such process
    os.replace(real, tmp_path / f".real.{dead}.ab.old")
    os.makedirs(tmp_path / f".real.{dead}.cd.tmp")
    # (issue 44: a fresh process's load named the .old folder but did not use it)
    with pytest.warns(match="killed after moving the previous checkpoint aside"):
        assert opt.load_streamed(str(real)) == "three"  # moved back, and loaded
    assert streamed.read_extra(str(real)) == "three"
    os.replace(real, tmp_path / f".real.{dead}.ef.old")  # again, then a save
    opt.save_streamed(str(real), extra="four")  # moves it back, then replaces it
    assert streamed.read_extra(str(real)) == "four"
    left = sorted(e for e in os.listdir(tmp_path) if str(dead) in e)
    assert left == [], left
    opt.close()


def test_a_save_keeps_the_folders_mode_and_what_the_user_put_there(tmp_path):
    """A new user's findings: every streamed checkpoint was a 0700 folder (mkdtemp's mode),
    and a folder the user made for one became 0700 too; a file the user put in a checkpoint
    folder (notes) was deleted by the next save."""
    m = model()
    opt = build(m, state_dtype="int8")
    train(m, opt, 0, 1)
    old = os.umask(0o022)
    try:
        fresh = tmp_path / "fresh"
        opt.save_streamed(str(fresh))
        assert fresh.stat().st_mode & 0o777 == 0o755  # the umask's
        made = tmp_path / "made"
        made.mkdir(mode=0o750)
        os.chmod(made, 0o750)
        opt.save_streamed(str(made))
        assert made.stat().st_mode & 0o777 == 0o750  # the replaced folder's
        (made / "notes.txt").write_text("lr sweep 3")
        (made / "sub").mkdir()
        train(m, opt, 1, 2)
        opt.save_streamed(str(made), extra="second")
        assert (made / "notes.txt").read_text() == "lr sweep 3" and (made / "sub").is_dir()
        assert streamed.read_extra(str(made)) == "second"
        assert made.stat().st_mode & 0o777 == 0o750
        assert sorted(p.name for p in tmp_path.iterdir()) == ["fresh", "made"]  # no .old left
    finally:
        os.umask(old)
    opt.close()


def test_a_killed_file_saves_temporary_file_goes_at_the_next_save(tmp_path):
    """A new user's find: ``train --save ck.pt`` killed outright (SIGKILL) during a save left
    ``.ck.pt.PID.tmp`` (checkpoint-sized) beside it for good. The next save to that path
    removes a dead process's leftover and keeps a live one's."""
    from offloadopt.cli import main

    ck = tmp_path / "ck.pt"
    dead = tmp_path / f".ck.pt.{2**22 + 12345}.tmp"  # above the default pid_max: no such process
    live = tmp_path / f".ck.pt.{os.getppid()}.tmp"  # a live process's save in progress
    dead.write_bytes(b"x" * 1000)
    live.write_bytes(b"y")
    argv = ["train", "--steps", "1", "--batch-size", "2", "--seq-len", "16", "--quiet"]
    assert main([*argv, "--save", str(ck)]) == 0
    assert ck.is_file() and not dead.exists() and live.read_bytes() == b"y"


def test_a_truncated_part_is_refused_before_anything_changes(tmp_path, monkeypatch):
    """A part file cut short (a copy that stopped) was found only when its turn came, after
    earlier parts had been loaded: the optimizer was left half loaded. The index records each
    part's bytes, checked first. Ctrl-C inside torch.save (torch's zip writer reports it as a
    RuntimeError) is the KeyboardInterrupt again."""
    m = model()
    opt = build(m, state_dtype="int8")
    train(m, opt, 0, 2)
    monkeypatch.setattr(streamed, "PART_NBYTES", 4096)  # many parts
    path = str(tmp_path / "ck")
    opt.save_streamed(path, model=m)
    parts = sorted(f for f in os.listdir(path) if f.startswith("part-"))
    last = os.path.join(path, parts[-1])
    with open(last, "r+b") as f:
        f.truncate(os.path.getsize(last) - 100)
    m2 = model(seed=1)
    o2 = build(m2, state_dtype="int8")
    train(m2, o2, 0, 1)
    before = snapshot(m2, o2)
    with pytest.raises(ValueError, match=f"{parts[-1]} of .* truncated"):
        o2.load_streamed(path, model=m2)
    assert_same(snapshot(m2, o2), before)
    o2.close()

    def interrupted(obj, f):
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise RuntimeError("PytorchStreamWriter failed writing file data") from None

    monkeypatch.setattr(torch, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        opt.save_streamed(path)
    monkeypatch.undo()
    assert streamed.read_extra(path) is None and len(os.listdir(tmp_path)) == 1
    opt.close()


def test_a_truncated_index_is_named_damaged_in_a_whole_sentence(tmp_path):
    """A user's find: an index.pt cut short was refused with torch's text quoted and cut at
    200 characters, mid-word ("...your checkpoint file is corrupted. Thi): a damaged or
    incomplete index"). Now the file, that it is damaged, torch's exception by its kind alone,
    and that nothing was changed; an index whose bytes match its checksum is not called
    damaged where torch cannot read it."""
    from offloadopt.state import integrity

    m = model()
    opt = build(m)
    train(m, opt, 0, 2)
    path = str(tmp_path / "ck")
    opt.save_streamed(path, model=m)
    file = os.path.join(path, "index.pt")
    whole = open(file, "rb").read()
    before = snapshot(m, opt)
    fix = "; nothing was changed: restore the folder from a copy, or load an earlier checkpoint"
    for size in (0, 10, 100, len(whole) // 2, len(whole) - 1000):
        with open(file, "wb") as f:
            f.write(whole[:size])
        with pytest.raises(ValueError) as e:
            opt.load_streamed(path, model=m)
        # the kind: RuntimeError, EOFError, OSError: Invalid argument (torch's seek), by size
        assert re.fullmatch(rf"load_streamed: {re.escape(repr(file))} is damaged \(cut short or "
                            r"overwritten\): torch.load cannot read it \([A-Za-z]+(: [A-Za-z ]+)?"
                            rf"\){re.escape(fix)}", str(e.value)), str(e.value)  # fmt: skip
        assert_same(snapshot(m, opt), before)
    integrity.fsync_save({"when": datetime.date(2026, 1, 1)}, file)  # no type weights_only reads
    with pytest.raises(ValueError) as e:
        streamed.read_extra(path)
    assert str(e.value) == (f"read_extra: {file!r}: torch.load cannot read it (UnpicklingError), "
                            "though its bytes match its checksum (saved by a newer torch?); "
                            "nothing was changed")  # fmt: skip
    opt.close()


def test_an_index_that_is_no_file_is_named_damaged_with_the_advice(tmp_path):
    """An index.pt that is a folder (a link to a device, a link to nothing) was "has no
    index.pt: not a streamed checkpoint", without the advice the damage messages give; it is
    there, and damaged: nothing was changed, and what to do."""
    m = model()
    opt = build(m)
    train(m, opt, 0, 2)
    path = str(tmp_path / "ck")
    opt.save_streamed(path, model=m)
    index = os.path.join(path, "index.pt")
    os.remove(index)
    before = snapshot(m, opt)
    for make in (os.mkdir, lambda p: os.symlink("/dev/zero", p),
                 lambda p: os.symlink(str(tmp_path / "nowhere"), p)):  # fmt: skip
        make(index)
        with pytest.raises(ValueError) as e:
            opt.load_streamed(path, model=m)
        assert str(e.value) == (
            f"load_streamed: {index!r} is no regular file (a folder, a link to a device or a "
            "missing file): the checkpoint is damaged; nothing was changed: restore the folder "
            "from a copy, or load an earlier checkpoint"
        )
        assert_same(snapshot(m, opt), before)
        (os.rmdir if make is os.mkdir else os.remove)(index)
    with pytest.raises(ValueError, match="has no index.pt: not a streamed checkpoint"):
        opt.load_streamed(path, model=m)  # none at all: as before
    opt.close()


def test_read_extra_names_itself(tmp_path):
    """A fresh user's finding: read_extra's errors said "load_streamed:"."""
    with pytest.raises(ValueError, match="^read_extra: .* is not a folder"):
        streamed.read_extra(str(tmp_path / "none"))


def test_dict_hooks_a_streamed_checkpoint_cannot_run_are_refused(tmp_path):
    """state_dict pre/post hooks and load_state_dict pre-hooks edit a whole dict, which a
    streamed checkpoint never holds: save_streamed / load_streamed refuse, naming them,
    before anything is written or changed; load_state_dict post-hooks run after a load."""
    m = model()
    opt = build(m)
    train(m, opt, 0, 2)
    opt.save_streamed(str(tmp_path / "ck"), m)
    before = snapshot(m, opt)
    for register in (opt.register_state_dict_pre_hook, opt.register_state_dict_post_hook):
        handle = register(lambda *a: None)
        with pytest.raises(ValueError, match="save_streamed: 1 state_dict hook"):
            opt.save_streamed(str(tmp_path / "other"))
        assert not (tmp_path / "other").exists()
        handle.remove()
    handle = opt.register_load_state_dict_pre_hook(lambda o, sd: sd)
    train(m, opt, 2, 3)
    moved = snapshot(m, opt)
    with pytest.raises(ValueError, match="load_streamed: 1 load_state_dict pre-hook"):
        opt.load_streamed(str(tmp_path / "ck"), m)
    assert_same(snapshot(m, opt), moved)  # nothing changed
    handle.remove()
    ran = []
    opt.register_load_state_dict_post_hook(lambda o: ran.append(o))
    opt.load_streamed(str(tmp_path / "ck"), m)
    assert ran == [opt]
    assert_same(snapshot(m, opt), before)
    opt.close()
