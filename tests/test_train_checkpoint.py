"""``offloadopt train --save / --resume``: a resumed run's losses are bit for bit those of an
uninterrupted one, checkpoints are written whole, bad checkpoints are one-line errors; and
``--tensorboard`` without tensorboard installed is one too (CPU, tiny preset, a few seconds)."""

import json
import os
import re
from dataclasses import replace

import pytest
import torch

from offloadopt.cli import main
from offloadopt.harness import options, train
from offloadopt.state.integrity import fsync_save

N = 3  # steps before the interrupt; the run has 2 * N
ARGS = ["train", "--steps", str(2 * N), "--batch-size", "2", "--seq-len", "32",
        "--eval-every", str(N), "--eval-batches", "1", "--log-every", "1", "--no-progress"]  # fmt: skip
STEP = re.compile(r"^step +(\d+)/\d+ \| loss (\S+) \| held-out +(\S+) \|")


def _run(capsys, argv: list[str]) -> tuple[int, dict[int, tuple[str, str]], dict | None]:
    """Exit status, {step: (loss, held-out) as printed}, the JSON summary (None if absent)."""
    status = main(argv)
    lines = capsys.readouterr().out.strip().splitlines()
    steps = {int(m[1]): (m[2], m[3]) for line in lines if (m := STEP.match(line))}
    summary = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else None
    return status, steps, summary


def _interrupt_at_step(monkeypatch, step: int):
    """Ctrl-C as training step ``step`` fetches its batch; returns the real get_batch."""
    real_get_batch, fetched = train.get_batch, []

    def interrupted(data, split, *args, **kwargs):
        if split == "train":
            fetched.append(1)
            if len(fetched) == step:
                raise KeyboardInterrupt
        return real_get_batch(data, split, *args, **kwargs)

    monkeypatch.setattr(train, "get_batch", interrupted)
    return real_get_batch


@pytest.mark.parametrize(
    "flags", [["--overlap", "step"], ["--overlap", "delayed"], ["--optimizer", "adamw"]], ids=str
)
def test_resume_continues_an_interrupted_run_bit_for_bit(tmp_path, capsys, monkeypatch, flags):
    argv = [*ARGS, *flags]
    status, whole, summary = _run(capsys, argv)
    assert status == 0 and sorted(whole) == list(range(1, 2 * N + 1))

    ck = str(tmp_path / "run.pt")
    real_get_batch = _interrupt_at_step(monkeypatch, N + 1)
    status, first, _ = _run(capsys, [*argv, "--save", ck, "--save-every", str(N)])
    monkeypatch.setattr(train, "get_batch", real_get_batch)
    assert status == 130 and sorted(first) == list(range(1, N + 1))
    assert torch.load(ck, weights_only=True)["step"] == N
    assert [p.name for p in tmp_path.iterdir()] == ["run.pt"]  # no temporary file left

    status, rest, resumed = _run(capsys, [*argv, "--resume", ck])
    assert status == 0 and sorted(rest) == list(range(N + 1, 2 * N + 1))
    assert {**first, **rest} == whole  # every printed loss and held-out loss
    for key in ("first_train_loss", "final_train_loss", "final_heldout_loss"):
        assert resumed[key] == summary[key], key  # the full floats, exactly


@pytest.mark.parametrize(
    "flags",
    [[], ["--overlap", "delayed"], ["--dtype", "bf16", "--state-dtype", "int8",
                                     "--offload-fraction", "0.5"]],
    ids=str,
)  # fmt: skip
@pytest.mark.slow
def test_a_streamed_checkpoint_resumes_bit_for_bit(tmp_path, capsys, monkeypatch, flags):
    """--checkpoint-format streamed: a folder written by HybridAdamW.save_streamed, replaced
    whole at each save; --resume reads it; the losses are the uninterrupted run's."""
    from offloadopt.state.streamed import read_extra

    argv = [*ARGS, *flags]
    status, whole, summary = _run(capsys, argv)
    assert status == 0
    ck = str(tmp_path / "run")
    real_get_batch = _interrupt_at_step(monkeypatch, N + 1)
    status, first, _ = _run(capsys, [*argv, "--save", ck, "--save-every", "1",
                                     "--checkpoint-format", "streamed"])  # fmt: skip
    monkeypatch.setattr(train, "get_batch", real_get_batch)
    assert status == 130 and read_extra(ck)["step"] == N
    assert [p.name for p in tmp_path.iterdir()] == ["run"]  # replaced whole, nothing left
    status, rest, resumed = _run(capsys, [*argv, "--resume", ck])
    assert status == 0 and {**first, **rest} == whole
    assert resumed["final_heldout_loss"] == summary["final_heldout_loss"]
    # a damaged copy: refused before anything changed, as a bad --resume (status 2, not 1)
    part = tmp_path / "run" / "part-00000.pt"
    with open(part, "r+b") as f:
        f.truncate(part.stat().st_size - 10)
    assert main([*argv, "--resume", ck]) == 2
    assert f"--resume: part-00000.pt of {ck!r} has " in capsys.readouterr().err
    # a damaged index: its path named once (it read "--resume: 'run': 'run/index.pt' ...")
    index = str(tmp_path / "run" / "index.pt")
    with open(index, "r+b") as f:
        f.truncate(100)
    assert main([*argv, "--resume", ck]) == 2
    err = capsys.readouterr().err
    assert f"--resume: {index!r} " in err and f"{ck!r}: " not in err, err


def test_checkpoint_format_refusals_name_the_values(tmp_path, capsys):
    f = tmp_path / "file.pt"
    f.write_bytes(b"x")
    folder = tmp_path / "plain"
    folder.mkdir()
    cases = [
        ([*ARGS, "--save", str(f), "--checkpoint-format", "streamed"], "is a file"),
        ([*ARGS, "--optimizer", "adamw", "--save", str(tmp_path / "a"), "--checkpoint-format",
          "streamed"], "only HybridAdamW"),
        ([*ARGS, "--resume", str(folder)], "no streamed checkpoint"),
        ([*ARGS, "--save", str(folder)], "is an empty folder; --checkpoint-format file writes"),
        # accepted silently before: the format of nothing
        ([*ARGS, "--checkpoint-format", "streamed"], "needs --save PATH"),
    ]  # fmt: skip
    for argv, message in cases:
        try:
            status = main(argv)
        except SystemExit as e:  # argparse's check of the value
            status = e.code
        assert status == 2
        assert message in capsys.readouterr().err, message


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_delayed_saving_and_evaluating_do_not_change_the_losses(tmp_path, capsys, monkeypatch,
                                                                 dtype):  # fmt: skip
    # --overlap delayed: a checkpoint or an evaluation needs the newest weights in the params
    # (opt.synchronize()), which used to end the delay once, so the next forward read weights
    # one step newer: saving changed the losses, and a resume matched neither run unless it
    # saved and evaluated at the same steps.
    argv = [*ARGS, "--overlap", "delayed", "--dtype", dtype, "--eval-every", "100"]
    real_step, losses = train.train_step, []

    def recorded(*args, **kwargs):  # every step's loss, the full float
        loss = real_step(*args, **kwargs)
        losses.append(loss.item())
        return loss

    monkeypatch.setattr(train, "train_step", recorded)
    status, _, summary = _run(capsys, argv)
    whole, losses[:] = list(losses), []
    assert status == 0 and len(whole) == 2 * N

    ck = str(tmp_path / "run.pt")
    real_get_batch = _interrupt_at_step(monkeypatch, N + 1)
    status, _, _ = _run(capsys, [*argv, "--save", ck, "--save-every", "1", "--eval-every", "1"])
    monkeypatch.setattr(train, "get_batch", real_get_batch)
    assert status == 130 and losses == whole[:N]
    assert torch.load(ck, weights_only=True)["delayed_weights"]  # the update in flight at N

    status, _, resumed = _run(capsys, [*argv, "--resume", ck, "--eval-every", "2"])
    assert status == 0 and losses == whole  # a resume that neither saves nor evaluates at N + 1
    assert resumed["final_train_loss"] == summary["final_train_loss"]


def test_a_run_saved_with_speculate_resumes_without_it_bit_for_bit(tmp_path, capsys, monkeypatch):
    """--speculate changes no loss, so a resume may turn it off (or on): a fresh user could
    not drop it from a run whose steps clipped often."""
    argv = [*ARGS, "--overlap", "backward", "--min-offload-numel", "1"]
    status, whole, _ = _run(capsys, argv)
    assert status == 0
    ck = str(tmp_path / "run.pt")
    real_get_batch = _interrupt_at_step(monkeypatch, N + 1)
    status = main([*argv, "--speculate", "--save", ck, "--save-every", str(N)])
    out, err = capsys.readouterr()
    first = {int(m[1]): (m[2], m[3]) for line in out.splitlines() if (m := STEP.match(line))}
    monkeypatch.setattr(train, "get_batch", real_get_batch)
    assert status == 130 and first == {k: whole[k] for k in first} and len(first) == N
    # where the interrupted run can go on from (a fresh user's wish)
    assert f"the last checkpoint, {ck}, holds step {N} of {2 * N}: --resume {ck}" in err, err
    status, rest, resumed = _run(capsys, [*argv, "--resume", ck])
    assert status == 0 and {**first, **rest} == whole and resumed["speculation"] is None


def test_a_checkpoint_is_written_whole(tmp_path, monkeypatch):
    cfg = options.TrainConfig(steps=2, batch_size=2, seq_len=16).resolved()
    model, opt = train.make_model_and_optimizer(cfg)
    gen = torch.Generator().manual_seed(0)
    path = str(tmp_path / "ck.pt")
    train.save_checkpoint(path, cfg, 1, model, opt, gen, 5.0)
    before = open(path, "rb").read()
    real_save = torch.save

    def cut_short(obj, f, *args, **kwargs):  # half a file written, then Ctrl-C
        f.write(b"\x80half")
        raise KeyboardInterrupt

    def zip_writer_masks_it(obj, f, *args, **kwargs):  # a fresh user's finding: Ctrl-C inside
        f.write(b"\x80half")  # torch's zip writer came out as its RuntimeError, exit 1
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise RuntimeError(
                "[enforce fail at inline_container.cc:672] . unexpected pos"
            ) from None

    for interrupted in (cut_short, zip_writer_masks_it):
        monkeypatch.setattr(torch, "save", interrupted)
        with pytest.raises(KeyboardInterrupt):
            train.save_checkpoint(path, cfg, 2, model, opt, gen, 5.0)
        monkeypatch.setattr(torch, "save", real_save)
        assert open(path, "rb").read() == before and os.listdir(tmp_path) == ["ck.pt"]
    opt.close()


def _error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured
    return captured.err.removeprefix("offloadopt: error: ").strip()


def test_bad_checkpoints_are_one_line_errors_naming_the_file(tmp_path, capsys):
    missing = str(tmp_path / "none.pt")
    assert _error(capsys, [*ARGS, "--resume", missing]) == f"--resume: {missing!r}: no such file"
    text = tmp_path / "notes.txt"
    text.write_text("not a checkpoint\n")
    assert _error(capsys, [*ARGS, "--resume", str(text)]).startswith(
        f"--resume: {str(text)!r} is not a checkpoint of offloadopt train"
    )
    other = str(tmp_path / "other.pt")
    torch.save({"tensor": torch.zeros(2)}, other)  # a torch file, not ours
    assert "is not a checkpoint of offloadopt train" in _error(capsys, [*ARGS, "--resume", other])
    small = str(tmp_path / "small.pt")
    cfg = options.TrainConfig(preset="small").resolved()
    fsync_save({"format": train.CHECKPOINT_FORMAT, "version": train.CHECKPOINT_VERSION,
                "step": 1, "config": vars(cfg).copy()}, small)  # fmt: skip
    assert _error(capsys, [*ARGS, "--resume", small]) == (
        f"--resume: {small!r} is a checkpoint of preset 'small', not 'tiny' (--preset)"
    )
    assert _error(capsys, [*ARGS, "--save-every", "2"]).startswith("--save-every 2: ")


def test_a_resume_with_other_steps_names_steps_not_the_warm_up_that_follows(tmp_path, capsys):
    """A user's find: a resume with another --steps also said "--warmup-steps 0 there, 1 here",
    a flag they never passed (its default, steps/20, follows --steps). --steps is named alone,
    with why it must stay; a --warmup-steps the user gave is named as before."""
    ck = str(tmp_path / "run.pt")
    assert main([*ARGS, "--steps", "2", "--save", ck]) == 0  # warm-up 2 // 20 = 0
    capsys.readouterr()
    keep = "(a resumed run takes the saved run's, to continue its losses exactly"
    why = ("; --steps sets the learning-rate schedule (warm-up, steps/20 by default, then cosine "
           "decay to lr/10 at the last step), so it cannot change on resume)")  # fmt: skip
    other = f"--resume: {ck!r} was saved with other settings: "
    steps, warmup = "--steps 2 there, 20 here", "--warmup-steps 0 there, {} here"
    for flags, differ, end in [
        (["--steps", "20"], steps, why),  # warm-up 1 here, by default
        (["--steps", "20", "--warmup-steps", "0"], steps, why),
        (["--steps", "20", "--warmup-steps", "3"], f"{steps}; {warmup.format(3)}", why),
        (["--steps", "2", "--warmup-steps", "1"], warmup.format(1), ")"),
    ]:
        assert _error(capsys, [*ARGS, *flags, "--resume", ck]) == f"{other}{differ} {keep}{end}"
    # the default --dtype follows --device the same way (a CUDA device is not needed to check)
    cfg = options.TrainConfig(steps=2, batch_size=2, seq_len=16).resolved()
    fsync_save({"format": train.CHECKPOINT_FORMAT, "version": train.CHECKPOINT_VERSION,
                "step": 1, "config": vars(cfg).copy()}, ck)  # fmt: skip
    on_cuda = replace(cfg, device="cuda", dtype="bf16")
    with pytest.raises(options.UsageError) as e:
        train.load_checkpoint(ck, on_cuda)
    assert str(e.value) == f"{other}--device 'cpu' there, 'cuda' here {keep})"


def test_tensorboard_without_the_package_is_a_one_line_error(tmp_path, capsys, monkeypatch):
    real = options.importlib.util.find_spec
    monkeypatch.setattr(options.importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboard" else real(name, *a))  # fmt: skip
    message = _error(capsys, [*ARGS, "--tensorboard", str(tmp_path)])
    assert message.startswith(f"--tensorboard {tmp_path}: needs the tensorboard package")


def test_train_logs_through_logging_to_a_callers_handler(capsys):
    import logging

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("offloadopt.train")
    logger.addHandler(handler)
    try:
        cfg = options.TrainConfig(steps=2, batch_size=2, seq_len=16, eval_batches=1, progress=False)
        train.train(cfg)
    finally:
        logger.removeHandler(handler)
    assert capsys.readouterr().out == ""  # the caller's handler replaces the stdout one
    assert records[0].startswith("data: ") and sum(STEP.match(r) is not None for r in records) == 2
    assert logger.level == logging.NOTSET and logger.handlers == []  # as it was


def test_tensorboard_gets_the_losses(tmp_path, capsys):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert main([*ARGS, "--tensorboard", str(tmp_path)]) == 0
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    steps = [e.step for e in events.Scalars("loss/train")]
    assert steps == list(range(1, 2 * N + 1))
    assert [e.step for e in events.Scalars("loss/heldout")] == [N, 2 * N]


@pytest.mark.parametrize("fmt", ["file", "streamed"])
def test_a_64_byte_overwrite_in_a_checkpoint_stops_resume_with_one_line(tmp_path, capsys,
                                                                        monkeypatch, fmt):  # fmt: skip
    """Issue 44's two steps: 64 bytes overwritten in the middle of a part (or of the --save
    file), then --resume. It loaded both, trained on a NaN loss and exited 0; now the checksum
    refuses it: status 2, one line naming the file, no step taken."""
    ck = str(tmp_path / ("run" if fmt == "streamed" else "run.pt"))
    real_get_batch = _interrupt_at_step(monkeypatch, N + 1)
    status, _, _ = _run(capsys, [*ARGS, "--save", ck, "--save-every", str(N),
                                 "--checkpoint-format", fmt])  # fmt: skip
    monkeypatch.setattr(train, "get_batch", real_get_batch)
    assert status == 130
    target = ck
    if fmt == "streamed":
        parts = [os.path.join(ck, f) for f in os.listdir(ck) if f.startswith("part-")]
        target = max(parts, key=os.path.getsize)
    with open(target, "r+b") as f:
        f.seek(os.path.getsize(target) // 2 - 32)
        f.write(bytes(range(64)))
    assert main([*ARGS, "--resume", ck]) == 2
    captured = capsys.readouterr()
    assert not STEP.search(captured.out) and captured.err.count("\n") == 1, captured
    assert captured.err.startswith("offloadopt: error: --resume: ")
    assert "is damaged: its bytes do not match the checksum" in captured.err
    assert os.path.basename(target) in captured.err


def test_a_checkpoint_cut_to_half_is_called_damaged_not_another_file(tmp_path, capsys):
    """A user's find: a --save file cut to half its size (its checksum gone with its end) was
    "not a checkpoint of offloadopt train (... damaged?)", and with --save on the same path (the
    usual resume line) "a file that is not a checkpoint is there ... move it away". Both now say
    it is a damaged checkpoint, status 2, and the file is kept as it was. The usual resume
    line names the file it resumes (--resume), not --save (a later user's find); a damaged
    file under --save alone still says that a save would replace it."""
    ck = str(tmp_path / "run.pt")
    assert _run(capsys, [*ARGS, "--save", ck])[0] == 0
    os.truncate(ck, os.path.getsize(ck) // 2)
    before = open(ck, "rb").read()
    resumed = _error(capsys, [*ARGS, "--resume", ck])
    assert resumed.startswith(
        f"--resume: {ck!r} is damaged: it begins as a checkpoint of offloadopt train"
    )
    assert "restore it from a copy, or resume from an earlier checkpoint" in resumed
    both = _error(capsys, [*ARGS, "--resume", ck, "--save", ck])
    assert both == resumed
    saved = _error(capsys, [*ARGS, "--save", ck])
    assert saved.startswith(
        f"--save {ck}: the checkpoint there is damaged (cut short or overwritten)"
    )
    assert open(ck, "rb").read() == before
    # a file of another kind keeps its message
    other = tmp_path / "notes.txt"
    other.write_text("PK not a zip")
    assert "is not a checkpoint of offloadopt train" in _error(
        capsys, [*ARGS, "--resume", str(other)]
    )


@pytest.mark.parametrize("flags", [[], ["--lr", "0.5"], ["--optimizer", "adamw"]], ids=str)
def test_a_damaged_streamed_checkpoint_says_so_before_any_other_refusal(tmp_path, capsys,
                                                                        flags):  # fmt: skip
    """A new user's finding: a streamed checkpoint of the run's last step, one part damaged,
    resumed: "nothing left" (or "other settings", "only --optimizer hybrid"), not the damage
    (the index alone was verified before those refusals). A damaged --save file says so
    first; so does a folder now."""
    ck = str(tmp_path / "run")
    argv = [*ARGS, "--steps", str(N), "--eval-every", str(N)]
    assert _run(capsys, [*argv, "--save", ck, "--checkpoint-format", "streamed"])[0] == 0
    part = max((os.path.join(ck, f) for f in os.listdir(ck) if f.startswith("part-")),
               key=os.path.getsize)  # fmt: skip
    with open(part, "r+b") as f:
        f.seek(os.path.getsize(part) // 2)
        f.write(bytes(range(64)))
    message = _error(capsys, [*argv, *flags, "--resume", ck])
    assert message.startswith(f"--resume: {os.path.basename(part)} of {ck!r} is damaged: its "
                              "bytes do not match the checksum"), message  # fmt: skip


def test_a_streamed_resume_that_fails_names_the_flag_and_the_path(tmp_path, capsys, monkeypatch):
    """A user's find: a streamed checkpoint that --resume failed to load said
    "--resume: load_streamed: ..." (status 2), or "RuntimeError: load_streamed: ..." where it
    failed after its checks (status 1): the library's function, which the user never called.
    Now the flag and the path, the statuses as they were; the library's message stays."""
    from offloadopt.state import streamed_load

    ck = str(tmp_path / "run")
    real_get_batch = _interrupt_at_step(monkeypatch, 2)  # a checkpoint of step 1 of 2 * N
    argv = [*ARGS, "--save", ck, "--save-every", "1", "--checkpoint-format", "streamed"]
    assert main(argv) == 130
    monkeypatch.setattr(train, "get_batch", real_get_batch)
    part = os.path.join(ck, "part-00000.pt")
    data = open(part, "rb").read()
    with open(part, "wb") as f:  # refused by the run's load, before it changed anything
        f.write(data[:-10])
    capsys.readouterr()
    assert main([*ARGS, "--resume", ck]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"offloadopt: error: --resume: part-00000.pt of {ck!r} has "), err
    with pytest.raises(ValueError, match="^load_streamed: part-00000.pt of "):
        streamed_load.verify(ck)  # the library's message, for its users

    with open(part, "wb") as f:
        f.write(data)
    verify = streamed_load._verify_parts

    def changed_after_its_checks(*args, **kwargs):
        verify(*args, **kwargs)
        with open(part, "r+b") as f:
            f.write(b"\0" * 64)

    monkeypatch.setattr(streamed_load, "_verify_parts", changed_after_its_checks)
    assert main([*ARGS, "--resume", ck]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"offloadopt: error: RuntimeError: --resume: {part!r} no longer "
                          "reads as it did when it was verified"), err  # the path once  # fmt: skip


def test_a_nan_loss_stops_the_run_and_keeps_the_last_checkpoint(tmp_path, capsys, monkeypatch):
    """Issue 44: a run trained from step 50 to 200 on a NaN loss and exited 0. Now it stops at
    the first NaN loss (one line naming the step, status 1), and before saving weights that
    are not finite; the checkpoint holds the last good step. --no-stop-on-nonfinite trains on."""
    real_step, calls = train.train_step, []

    def nan_at(step, weights):
        def patched(model, *args, **kwargs):
            loss = real_step(model, *args, **kwargs)
            calls.append(1)
            if len(calls) == weights:  # the update made a weight NaN; its loss was finite
                with torch.no_grad():
                    next(model.parameters()).view(-1)[0] = float("nan")
            return torch.full_like(loss, float("nan")) if len(calls) == step else loss

        calls.clear()
        monkeypatch.setattr(train, "train_step", patched)

    ck = str(tmp_path / "run.pt")
    argv = [*ARGS, "--save", ck, "--save-every", "1"]
    nan_at(step=N + 1, weights=0)
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        f"offloadopt: stopped: step {N + 1}: the training loss is nan; the run stops, the last "
        f"checkpoint, {ck}, holds step {N} (--resume {ck} goes on"
    ), err
    # a resumed run keeps the saved settings: the advice says so (it offered a lower --lr on
    # --resume, which refuses changed settings: a fresh user's finding)
    assert "with the same settings; a lower --lr or more --grad-clip is a new run" in err, err
    assert torch.load(ck, weights_only=True)["step"] == N
    nan_at(step=0, weights=2)  # a NaN weight after step 2's update, saved there
    assert main(argv) == 1
    assert "step 2: 1 weights are not finite" in capsys.readouterr().err
    assert torch.load(ck, weights_only=True)["step"] == 1
    nan_at(step=N + 1, weights=0)
    assert main([*ARGS, "--no-stop-on-nonfinite"]) == 0
    out = capsys.readouterr().out
    assert f"step {N + 1:6d}/{2 * N} | loss    nan" in out and f"step {2 * N:6d}/" in out


@pytest.mark.parametrize("fmt", ["file", "streamed"])
def test_resume_knows_the_data_by_its_bytes_not_its_path(tmp_path, capsys, monkeypatch, fmt):
    """A new user's finds: the same text under another path was refused ("--data 'a.txt'
    there, '/.../a.txt' here"), and a file rewritten under the same path resumed and trained on
    other bytes. The checkpoint holds the data's sha256: the same bytes by any path resume bit
    for bit, other bytes are refused, naming both."""
    from offloadopt.harness.data import default_text

    text = default_text()[:200_000]
    (tmp_path / "a.txt").write_bytes(text)
    monkeypatch.chdir(tmp_path)
    argv = [*ARGS, "--data", "a.txt"]
    status, whole, _ = _run(capsys, argv)
    assert status == 0
    ck = str(tmp_path / "ck")
    real_get_batch = _interrupt_at_step(monkeypatch, N + 1)
    status, first, _ = _run(capsys, [*argv, "--save", ck, "--save-every", "1",
                                     "--checkpoint-format", fmt])  # fmt: skip
    monkeypatch.setattr(train, "get_batch", real_get_batch)
    assert status == 130
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_bytes(text)
    other = [*ARGS, "--data", str(tmp_path / "sub" / "b.txt")]
    status, rest, _ = _run(capsys, [*other, "--resume", ck])
    assert status == 0 and {**first, **rest} == whole
    (tmp_path / "a.txt").write_bytes(text.replace(b"e", b"f"))  # same path, other bytes
    assert main([*argv, "--resume", ck]) == 2
    err = capsys.readouterr().err
    assert "was saved training on other data: --data 'a.txt' there (sha256 " in err, err
    # the default text by its name, not as "None" (a new user's find)
    assert main([*ARGS, "--resume", ck]) == 2
    err = capsys.readouterr().err
    assert "there (sha256 " in err and ", (none: pydoc_data.topics) here (sha256 " in err, err


def test_a_streamed_checkpoint_goes_into_an_empty_folder(tmp_path, capsys):
    """A new user's find: --checkpoint-format streamed refused an empty folder ("is a folder,
    not a file name"), which save_streamed takes (docs/checkpoints.md)."""
    from offloadopt.state.streamed import read_extra

    empty = tmp_path / "ck"
    empty.mkdir()
    status, _, _ = _run(capsys, [*ARGS, "--save", str(empty), "--checkpoint-format", "streamed"])
    assert status == 0 and read_extra(str(empty))["step"] == 2 * N


@pytest.mark.parametrize("fmt", ["file", "streamed"])
def test_an_interrupt_after_the_checkpoints_rename_reports_the_step_on_disk(
    tmp_path, capsys, monkeypatch, fmt
):
    """A new user's find: Ctrl-C late in a save (after the new checkpoint's rename, while the
    folder was flushed) left the new checkpoint on disk, dropped the "saved:" line and said
    the last checkpoint held the step before. The step reported is now the one on disk."""
    from offloadopt.state import integrity

    ck = str(tmp_path / ("run.pt" if fmt == "file" else "run"))
    flags = [*ARGS, "--save", ck, "--save-every", "1", "--checkpoint-format", fmt]
    saves, real = [], integrity.fsync_dir

    def fsync_dir(path):  # the second save's flush after its rename(s): Ctrl-C
        real(path)
        if os.path.realpath(path) == str(tmp_path.resolve()):
            saves.append(path)
            if len(saves) == 2:
                raise KeyboardInterrupt

    monkeypatch.setattr(integrity, "fsync_dir", fsync_dir)
    assert main(flags) == 130
    err = capsys.readouterr().err
    assert f"the last checkpoint, {ck}, holds step 2 of {2 * N}" in err, err
    status, rest, resumed = _run(capsys, [*ARGS, "--resume", ck])
    assert status == 0 and min(rest) == 3, rest  # it goes on from step 2: the one on disk
