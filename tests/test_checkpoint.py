"""Checkpoint folders: completeness marker, rotation, choosing what to resume from, and the errors around it."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness.checkpoint import manifest, resume, store
from harness.checkpoint.export import export_final
from harness.checkpoint.manifest import ALGORITHM, checkpoint_size, file_checksum, MARKER, read_manifest, verify_checkpoint
from harness.distributed.collectives import share_by_size
from harness.errors import ConfigError, HarnessError
from harness.files import human_bytes
from harness_launch import FAST, ROOT, final_weights, max_abs_diff, metrics, report, run_train


def make_ckpt(root, step, complete=True):
    p = root / "checkpoints" / f"step-{step}"
    p.mkdir(parents=True)
    (p / "model.safetensors").write_text("x")
    if complete:
        (p / store.STATE_FILE).write_text(json.dumps({"step": step}))
        (p / MARKER).write_text("complete\n")
    return p


def test_list_checkpoints_sorts_by_step_and_separates_incomplete(tmp_path):
    for s in (10, 2, 100):
        make_ckpt(tmp_path, s)
    partial = make_ckpt(tmp_path, 150, complete=False)
    (tmp_path / "checkpoints" / "notes").mkdir()
    complete, incomplete = store.list_checkpoints(tmp_path)
    assert [s for s, _ in complete] == [2, 10, 100]
    assert incomplete == [partial]


def test_marker_without_state_is_incomplete(tmp_path):
    p = make_ckpt(tmp_path, 5)
    (p / store.STATE_FILE).unlink()
    assert store.list_checkpoints(tmp_path) == ([], [p])


def test_rotation_keeps_newest_and_removes_stale_incomplete(tmp_path):
    for s in (1, 2, 3, 4):
        make_ckpt(tmp_path, s)
    old_partial = make_ckpt(tmp_path, 0, complete=False)
    new_partial = make_ckpt(tmp_path, 9, complete=False)
    deleted = store.rotate(tmp_path, keep=2)
    complete, incomplete = store.list_checkpoints(tmp_path)
    assert [s for s, _ in complete] == [3, 4]
    assert incomplete == [new_partial]  # newer than every complete one: may be a save in progress
    assert old_partial in deleted
    assert store.rotate(tmp_path, keep=0) == []  # keep all


def test_rotation_and_make_room_leave_the_kept_best_checkpoint(tmp_path):
    """train.keep_best: the best evaluation's checkpoint stays beyond the limit (and is not what a short disk frees)."""
    for s in (1, 2, 3, 4):
        make_ckpt(tmp_path, s)
    kept = store.checkpoints_root(tmp_path) / "step-2"
    store.rotate(tmp_path, keep=1, kept=kept)
    assert [s for s, _ in store.list_checkpoints(tmp_path)[0]] == [2, 4]
    store.rotate(tmp_path, keep=1)  # another best: the old one goes at the next rotation
    assert [s for s, _ in store.list_checkpoints(tmp_path)[0]] == [4]


def test_resolve_resume(tmp_path):
    assert resume.resolve_resume(tmp_path, "auto") == (None, [])
    assert resume.resolve_resume(tmp_path, None) == (None, [])
    make_ckpt(tmp_path, 4)
    newest = make_ckpt(tmp_path, 8)
    partial = make_ckpt(tmp_path, 12, complete=False)
    assert resume.resolve_resume(tmp_path, "auto") == (newest, [partial])
    assert resume.resolve_resume(tmp_path, str(newest))[0] == newest


@pytest.mark.parametrize("case, message", [
    ("fresh-over-checkpoints", "config key 'train.resume': {root}/checkpoints already holds checkpoints (newest "
                               "step-8); use train.resume=auto to continue or another train.output_dir"),
    ("missing", "config key 'train.resume': {root}/nope is not a folder"),
    ("incomplete", "config key 'train.resume': {root}/checkpoints/step-12 is not a complete checkpoint (no COMPLETE "
                   "marker or harness_state.json)"),
])
def test_resolve_resume_errors(tmp_path, case, message):
    make_ckpt(tmp_path, 8)
    make_ckpt(tmp_path, 12, complete=False)
    arg = {"fresh-over-checkpoints": None, "missing": str(tmp_path / "nope"),
           "incomplete": str(tmp_path / "checkpoints" / "step-12")}[case]
    with pytest.raises(ConfigError) as e:
        resume.resolve_resume(tmp_path, arg)
    assert str(e.value) == message.format(root=tmp_path)


@pytest.mark.slow
def test_incomplete_checkpoint_is_reported_and_skipped(tmp_path):
    """A crash during a save leaves a folder without the marker: resume=auto passes over it and says so."""
    out = tmp_path / "run"
    args = [f"train.output_dir={out}", "train.max_steps=6", "train.save_every_steps=2", *FAST, "train.save_final=false"]
    run_train([*args, "train.stop_at_step=4"])
    broken = out / "checkpoints" / "step-5"
    broken.mkdir()
    (broken / "model.safetensors").write_text("half")
    proc = run_train(args)
    assert f"{broken} is an incomplete checkpoint" in proc.stdout
    assert "resumed from" in proc.stdout and "step-4" in proc.stdout
    assert [r["step"] for r in metrics(out)] == [1, 2, 3, 4, 5, 6]
    assert not broken.exists()  # removed by rotation once a newer complete checkpoint exists


@pytest.mark.slow
def test_resume_from_a_path_that_is_not_a_checkpoint_is_one_line(tmp_path):
    proc = run_train([f"train.output_dir={tmp_path}", f"train.resume={tmp_path}", *FAST], check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        f"harness: error: config key 'train.resume': {tmp_path} is not a complete checkpoint "
        "(no COMPLETE marker or harness_state.json)")
    assert "Traceback" not in proc.stderr


# ----------------------------------------------------------------------------------------------- damage (issue 17)
# In-process, with a stand-in for the Accelerator whose save_state writes a weights file and an optimizer file.


class FakeAccelerator:
    """Enough of accelerate's Accelerator for save_checkpoint / load_checkpoint / export_final in one process."""

    num_processes, process_index, is_main_process = 1, 0, True

    def __init__(self, fail_on: str | None = None, error: BaseException | None = None):
        self.fail_on, self.error, self.printed, self.loaded = fail_on, error, [], None
        self.seed = 0

    def save_state(self, path):
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.seed += 1
        for name, size in (("model.safetensors", 40_000), ("optimizer.bin", 80_000), ("random_states_0.pkl", 300)):
            if name == self.fail_on:
                (path / name).write_bytes(b"\x01" * (size // 3))  # half-written, then the disk is full
                raise self.error
            (path / name).write_bytes(bytes((self.seed + i) % 251 for i in range(size)))

    def load_state(self, path):
        if self.error is not None and self.fail_on is None:
            raise self.error
        self.loaded = Path(path)

    def print(self, *args):
        self.printed.append(" ".join(map(str, args)))

    def wait_for_everyone(self):
        pass


def save(acc, root, step, keep=0):
    return store.save_checkpoint(acc, root, {"step": step}, keep)


def damage(path: Path, how: str) -> None:
    if how == "truncated":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif how == "deleted":
        path.unlink()
    elif how == "zeroed":  # same size, 4000 zero bytes in the middle (in the tensor data of a weights file): what
        data = bytearray(path.read_bytes())  # a torn write or a bad block leaves, and what loads without a complaint
        data[len(data) // 2: len(data) // 2 + 4000] = bytes(4000)
        path.write_bytes(bytes(data))


def test_marker_is_a_manifest_of_every_file(tmp_path):
    acc = FakeAccelerator()
    path = save(acc, tmp_path, 2)
    manifest = json.loads((path / MARKER).read_text())
    assert manifest["algorithm"] == ALGORITHM == "xxh3_128"
    files = {e["path"]: e for e in manifest["files"]}
    assert sorted(files) == ["harness_state.json", "model.safetensors", "optimizer.bin", "random_states_0.pkl"]
    assert files["optimizer.bin"]["size"] == 80_000
    assert files["optimizer.bin"]["checksum"] == file_checksum(path / "optimizer.bin")[1]
    assert not (path / (MARKER + ".tmp")).exists()
    assert verify_checkpoint(path).ok


@pytest.mark.parametrize("how, problem", [
    ("truncated", "size differs (40000 bytes recorded, 20000 on disk)"),
    ("deleted", "missing"),
    ("zeroed", "checksum differs"),
])
@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.bin"])
def test_damaged_newest_checkpoint_falls_back_to_the_older_one(tmp_path, name, how, problem):
    acc = FakeAccelerator()
    older, newest = save(acc, tmp_path, 2), save(acc, tmp_path, 4)
    damage(newest / name, how)
    if name == "optimizer.bin":
        problem = problem.replace("40000", "80000").replace("20000", "40000")
    assert resume.resolve_resume(tmp_path, "auto", acc) == (older, [])
    assert acc.printed[0] == (f"[harness] warning: checkpoint {newest} fails verification ({name}: {problem}): not "
                              f"resumed from, trying an older one")
    assert acc.printed[1].startswith(f"[harness] checkpoint {older} verified: 4 files, 117.5 KiB in ")
    assert len(acc.printed) == 2
    with pytest.raises(ConfigError) as e:  # named explicitly: no fallback
        resume.resolve_resume(tmp_path, str(newest), acc)
    assert str(e.value) == f"config key 'train.resume': {newest} fails verification: {name}: {problem}"


def test_no_checkpoint_verifies_is_one_line(tmp_path):
    acc = FakeAccelerator()
    damage(save(acc, tmp_path, 2) / "optimizer.bin", "zeroed")
    damage(save(acc, tmp_path, 4) / "model.safetensors", "deleted")
    with pytest.raises(HarnessError) as e:
        resume.resolve_resume(tmp_path, "auto", acc)
    assert str(e.value) == (
        f"no checkpoint in {tmp_path}/checkpoints verifies (step-4: model.safetensors: missing; step-2: optimizer.bin: "
        "checksum differs): move the damaged folders away to start afresh, or use another train.output_dir")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("content", [b"", b"\x00" * 64, b'{"format": 1, "algorithm": "xxh3_128", "fi'])
def test_damaged_marker_is_a_failed_verification(tmp_path, content):
    acc = FakeAccelerator()
    older, newest = save(acc, tmp_path, 2), save(acc, tmp_path, 4)
    (newest / MARKER).write_bytes(content)
    assert resume.resolve_resume(tmp_path, "auto", acc)[0] == older
    assert "COMPLETE marker unreadable" in acc.printed[0]


def test_older_marker_without_checksums_is_accepted_unverified(tmp_path):
    """Checkpoints of an older harness (COMPLETE holds "complete") still resume, with a note, even when damaged."""
    acc = FakeAccelerator()
    legacy = make_ckpt(tmp_path, 6)
    check = verify_checkpoint(legacy)
    assert check.ok and check.legacy and read_manifest(legacy) is None
    assert resume.resolve_resume(tmp_path, "auto", acc) == (legacy, [])
    assert acc.printed == [f"[harness] note: {legacy} has no checksums (marker of an older harness): resumed from "
                           "unverified"]


def test_rotation_keeps_the_checkpoint_just_written_and_a_verifiable_one(tmp_path):
    acc = FakeAccelerator()
    save(acc, tmp_path, 2)
    make_ckpt(tmp_path, 6)  # newer, from an abandoned attempt (or an older harness): no manifest
    path = save(acc, tmp_path, 4, keep=1)  # rotation must not delete what it just wrote in favour of step-6
    assert [s for s, _ in store.list_checkpoints(tmp_path)[0]] == [4, 6]
    assert verify_checkpoint(path).ok
    # without `protect`: the last checkpoint with a manifest is spared when only unverifiable ones would be kept
    make_ckpt(tmp_path, 8)
    assert [p.name for p in store.rotate(tmp_path, keep=2)] == []
    make_ckpt(tmp_path, 9)
    assert [p.name for p in store.rotate(tmp_path, keep=2)] == ["step-6"]
    assert [s for s, _ in store.list_checkpoints(tmp_path)[0]] == [4, 8, 9]


def test_share_by_size_balances_bytes():
    items = [("optim-0", 100), ("optim-1", 100), ("model", 150), ("rng-0", 1), ("rng-1", 1), ("state", 1)]
    shares = share_by_size(items, 2)
    assert sorted(sum(shares, [])) == sorted(n for n, _ in items)
    loads = [sum(dict(items)[n] for n in s) for s in shares]
    assert max(loads) - min(loads) <= 52  # 150+1+1 vs 100+100+1 would be the worst greedy outcome here
    assert share_by_size(items, 2) == shares  # deterministic: every process computes the same split


def test_unloadable_checkpoint_is_one_line(tmp_path):
    acc = FakeAccelerator(error=RuntimeError("Error(s) in loading state_dict for LlamaForCausalLM:\n\tsize mismatch"))
    path = make_ckpt(tmp_path, 2)
    with pytest.raises(HarnessError) as e:
        resume.load_checkpoint(acc, path)
    assert str(e.value) == (f"could not load checkpoint {path} (RuntimeError: Error(s) in loading state_dict for "
                            "LlamaForCausalLM: size mismatch); resume from another one with train.resume=<folder>, "
                            "or check that the config matches the run that wrote it")


# ----------------------------------------------------------------------------------------------- disk space


class Usage:
    """A stand-in for shutil.disk_usage: `free` bytes, less what has been written under `root` since (a disk that
    fills up and frees as files come and go)."""

    def __init__(self, free: int, root: Path | None = None):
        self.root = root
        self.free = free + self.used()

    def used(self) -> int:
        return sum(p.stat().st_size for p in self.root.rglob("*") if p.is_file()) if self.root else 0

    def __call__(self, path):
        free = self.free - self.used()
        return shutil._ntuple_diskusage(10**12, 10**12 - free, free)


def test_save_refused_when_the_last_checkpoint_would_not_fit(tmp_path, monkeypatch):
    acc = FakeAccelerator()
    older = [save(acc, tmp_path, s, keep=2) for s in (2, 4)]
    size = checkpoint_size(older[-1])
    monkeypatch.setattr(store.shutil, "disk_usage", Usage(size - 1))
    with pytest.raises(HarnessError) as e:
        save(acc, tmp_path, 6, keep=0)  # keep all: nothing could go first
    assert str(e.value) == (
        f"not enough disk space for checkpoint step-6 in {tmp_path}/checkpoints: about "
        f"{human_bytes(size)} needed (the size of step-4), {human_bytes(size - 1)} free; older "
        "checkpoints are intact: free some space or lower train.save_total_limit, then continue with "
        "train.resume=auto")
    assert not (tmp_path / "checkpoints" / "step-6").exists()
    assert all(verify_checkpoint(p).ok for p in older)


def test_save_refused_with_one_checkpoint_does_not_advise_a_lower_limit(tmp_path, monkeypatch):
    """Issue 55: at train.save_total_limit 1 (or with one checkpoint) the refusal advised lowering the limit, which
    cannot help: the checkpoint continued from stays until the new one is complete, so two must fit."""
    acc = FakeAccelerator()
    older = save(acc, tmp_path, 2, keep=1)
    monkeypatch.setattr(store.shutil, "disk_usage", Usage(checkpoint_size(older) - 1))
    with pytest.raises(HarnessError) as e:
        save(acc, tmp_path, 4, keep=1)
    assert "lower train.save_total_limit" not in str(e.value)
    assert str(e.value).endswith("older checkpoints are intact: free some space (the checkpoint continued from stays "
                                 "until the new one is complete: room for two is needed, whatever "
                                 "train.save_total_limit), then continue with train.resume=auto"), str(e.value)


def test_short_space_removes_what_rotation_would_remove_only_when_the_newest_verifies(tmp_path, monkeypatch):
    """save_total_limit=2 with room for 2 checkpoints, not 3: the oldest goes before the save instead of after it,
    but only while the checkpoint the run continues from verifies."""
    acc = FakeAccelerator()
    first, second = save(acc, tmp_path, 2, keep=2), save(acc, tmp_path, 4, keep=2)
    monkeypatch.setattr(store.shutil, "disk_usage", Usage(checkpoint_size(second) - 1, tmp_path))
    good = (second / "random_states_0.pkl").read_bytes()
    damage(second / "random_states_0.pkl", "zeroed")
    with pytest.raises(HarnessError, match="not enough disk space for checkpoint step-6"):
        save(acc, tmp_path, 6, keep=2)
    assert first.exists() and second.exists() and not (tmp_path / "checkpoints" / "step-6").exists()
    (second / "random_states_0.pkl").write_bytes(good)
    save(acc, tmp_path, 6, keep=2)
    assert [s for s, _ in store.list_checkpoints(tmp_path)[0]] == [4, 6]
    assert any("little disk space" in line and "removed step-2 before writing step-6" in line for line in acc.printed)


@pytest.mark.parametrize("stage", ["save_state", "marker"])
def test_disk_full_during_a_save_is_one_line_and_leaves_no_complete_partial(tmp_path, monkeypatch, stage):
    acc = FakeAccelerator()
    older = save(acc, tmp_path, 2)
    enospc = OSError(errno.ENOSPC, "No space left on device")
    if stage == "save_state":
        acc.fail_on, acc.error = "optimizer.bin", enospc
    else:
        def full(*args, **kwargs):
            raise enospc
        monkeypatch.setattr(store, "write_marker", full)
    with pytest.raises(HarnessError) as e:
        save(acc, tmp_path, 4)
    msg = str(e.value)
    assert msg.startswith(f"disk full while writing checkpoint step-4 in {tmp_path}/checkpoints (OSError: [Errno 28] "
                          f"No space left on device): about {human_bytes(checkpoint_size(older))}"
                          " needed (the size of step-2), ")
    assert msg.endswith(" free; the partial folder is removed (never marked complete), older checkpoints are intact: "
                        "free some space, then continue with train.resume=auto")
    assert "\n" not in msg
    assert not (tmp_path / "checkpoints" / "step-4").exists()
    assert store.list_checkpoints(tmp_path) == ([(2, older)], [])
    assert verify_checkpoint(older).ok


def test_torch_style_write_error_on_a_full_disk_counts_as_disk_full(tmp_path, monkeypatch):
    """torch.save reports ENOSPC as RuntimeError('... unexpected pos ...'): judged by the free space left."""
    acc = FakeAccelerator(fail_on="optimizer.bin", error=RuntimeError("[enforce fail at inline_container.cc:672] . "
                                                                      "unexpected pos 576 vs 534"))
    monkeypatch.setattr(store.shutil, "disk_usage", Usage(4096))
    with pytest.raises(HarnessError, match=r"^disk full while writing checkpoint step-2 .*RuntimeError.* 4\.0 KiB free"):
        save(acc, tmp_path, 2)
    assert not (tmp_path / "checkpoints" / "step-2").exists()
    # the same error with plenty of space: a write whose errno torch.save dropped (a file-size limit, a quota: issue
    # 55, fault 6, harness/files.py write_cause), one line with what a probe write finds, the partial folder gone
    monkeypatch.setattr(store.shutil, "disk_usage", Usage(10**11))
    with pytest.raises(HarnessError, match=r"^could not write checkpoint .*step-2 \(RuntimeError: .*unexpected pos "
                                           r"576 vs 534: torch.save names no cause, and a 1 MiB write there works now\); "
                                           r"the partial folder is removed"):
        save(acc, tmp_path, 2)
    assert not (tmp_path / "checkpoints" / "step-2").exists()


class FakeModel:
    def save_pretrained(self, folder, state_dict=None, safe_serialization=True):
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / "model.safetensors").write_bytes(b"\x02" * 50_000)


class FakeTokenizer:
    def save_pretrained(self, folder):
        (Path(folder) / "tokenizer.json").write_text("{}")


class ExportAccelerator(FakeAccelerator):
    def get_state_dict(self, model):
        import torch

        w = torch.zeros(12_500)
        return {"w": w, "tied": w}  # 50,000 bytes: tied weights are saved once

    def unwrap_model(self, model, keep_torch_compile=False):
        return model


def test_export_refused_or_cut_by_a_full_disk_is_one_line(tmp_path, monkeypatch):
    acc, dest = ExportAccelerator(), tmp_path / "final"
    monkeypatch.setattr(store.shutil, "disk_usage", Usage(49_999))
    with pytest.raises(HarnessError) as e:
        export_final(acc, FakeModel(), FakeTokenizer(), dest)
    assert str(e.value) == (f"not enough disk space for the final export in {tmp_path}: about 48.8 KiB needed (the "
                            "size of the weights), 48.8 KiB free; the checkpoints are intact: free some space, then "
                            "run again with train.resume=auto")
    monkeypatch.setattr(store.shutil, "disk_usage", Usage(10**11))
    export_final(acc, FakeModel(), FakeTokenizer(), dest)
    before = (dest / "model.safetensors").read_bytes()

    def full(self, folder):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(FakeTokenizer, "save_pretrained", full)
    with pytest.raises(HarnessError, match=r"^disk full while writing the final export .* 48\.8 KiB needed \(the size "
                                           r"of the previous export final/\)"):
        export_final(acc, FakeModel(), FakeTokenizer(), dest)
    assert (dest / "model.safetensors").read_bytes() == before and not (tmp_path / "final.tmp").exists()


@pytest.mark.parametrize("code", [errno.EFBIG, errno.EDQUOT, errno.ENOSPC])
def test_safetensors_errors_keep_their_errno_for_the_one_line(tmp_path, code):
    """Issue 73, fault 10: safetensors raises its own SafetensorError, the OS error only in its words (measured here for
    EFBIG under a file-size limit: 'Error while serializing: I/O error: File too large (os error 27)'). A quota
    (EDQUOT, 122) and a full disk (ENOSPC, 28) in the same words are recognised as torch.save's lost errno is: a full
    disk for the two that are about space, the cause found again for the one line, never a raw traceback."""
    from safetensors import SafetensorError

    from harness.files import disk_full, lost_errno, write_cause

    exc = SafetensorError(f"Error while serializing: I/O error: {os.strerror(code)} (os error {code})")
    assert lost_errno(exc)
    if code != errno.EFBIG:  # (EFBIG is a limit of this process, not of the disk: write_cause names it)
        assert disk_full(exc, tmp_path)
    cause = write_cause(exc, tmp_path)
    assert cause and "\n" not in cause and "Traceback" not in cause


def test_a_best_export_cut_by_a_full_disk_names_the_best_export(tmp_path, monkeypatch):
    """Issue 73, fault 4: the disk-full line of train.keep_best's best/ export called it 'the final export'. It names
    the best/ export, the partial folder is removed and the previous best/ stays whole (the checkpoint's resume
    writes it again: tests/test_early_stopping.py::test_a_best_export_cut_short_is_redone_on_resume)."""
    acc, dest = ExportAccelerator(), tmp_path / "best"
    monkeypatch.setattr(store.shutil, "disk_usage", Usage(10**11))
    export_final(acc, FakeModel(), FakeTokenizer(), dest)
    before = (dest / "model.safetensors").read_bytes()

    def full(self, folder):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(FakeTokenizer, "save_pretrained", full)
    with pytest.raises(HarnessError, match=r"^disk full while writing the best/ export to "):
        export_final(acc, FakeModel(), FakeTokenizer(), dest)
    assert (dest / "model.safetensors").read_bytes() == before and not (tmp_path / "best.tmp").exists()


# ----------------------------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_zeroed_weights_and_cut_metrics_line_resume_to_the_same_weights(tmp_path):
    """The newest checkpoint's weights have zeroed bytes (they would load silently) and metrics.jsonl ends in a cut
    line: the resume passes over step-4 with a warning, continues from step-2, drops the cut line, and ends on the
    weights of an uninterrupted run. Then with every checkpoint damaged: one line, exit 1."""
    args = ["train.max_steps=6", "train.save_every_steps=2", *FAST]
    full, out = tmp_path / "full", tmp_path / "run"
    run_train([f"train.output_dir={full}", *args])
    run_train([f"train.output_dir={out}", *args, "train.stop_at_step=4"])
    step4 = out / "checkpoints" / "step-4"
    damage(step4 / "model.safetensors", "zeroed")
    with open(out / "metrics.jsonl", "ab") as fh:
        fh.write(b'{"step": 5, "loss": 1.2')
    proc = run_train([f"train.output_dir={out}", *args])
    assert (f"[harness] warning: checkpoint {step4} fails verification (model.safetensors: checksum differs): not "
            "resumed from, trying an older one") in proc.stdout
    assert f"resumed from {out}/checkpoints/step-2: step 2" in proc.stdout
    assert f"{out}/metrics.jsonl:5: not a JSON record" in proc.stdout
    assert [r["step"] for r in metrics(out)] == [1, 2, 3, 4, 5, 6]
    assert max_abs_diff(final_weights(out), final_weights(full)) == 0.0

    for p in (out / "checkpoints").iterdir():
        damage(p / "optimizer.bin", "truncated")
    (out / "report.json").unlink()  # else the finished run is not run again (tests/test_rerun.py)
    proc = run_train([f"train.output_dir={out}", "train.max_steps=8", *FAST], check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(
        f"harness: error: no checkpoint in {out}/checkpoints verifies (step-6: optimizer.bin: size differs (")


# accelerate writes the optimizer state with accelerate.checkpointing.save: make it fail like a full disk at one step
ENOSPC_AT = """
import errno, os, sys
import accelerate.checkpointing as ck
real = ck.save
def save(obj, f, *args, **kwargs):
    if str(f).endswith(os.path.join("step-" + os.environ["ENOSPC_AT_STEP"], "optimizer.bin")):
        open(f, "wb").write(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")
    return real(obj, f, *args, **kwargs)
ck.save = save
from harness.train import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_disk_full_during_a_real_save_is_one_line_and_a_restart_continues(tmp_path):
    out = tmp_path / "run"
    args = [f"train.output_dir={out}", "train.max_steps=6", "train.save_every_steps=2", *FAST, "train.save_final=false"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "ENOSPC_AT_STEP": "4"}
    proc = subprocess.run([sys.executable, "-c", ENOSPC_AT, "--config", str(ROOT / "configs/default.yaml"), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"harness: error: disk full while writing checkpoint step-4 in {out}/checkpoints (OSError: "
                           "[Errno 28] No space left on device): about ")
    assert last.endswith(" free; the partial folder is removed (never marked complete), older checkpoints are intact: "
                         "free some space, then continue with train.resume=auto")
    complete, incomplete = store.list_checkpoints(out)
    assert [s for s, _ in complete] == [2] and incomplete == []
    assert verify_checkpoint(complete[0][1]).ok
    resumed = run_train(args)
    assert f"resumed from {out}/checkpoints/step-2" in resumed.stdout
    assert [s for s, _ in store.list_checkpoints(out)[0]] == [4, 6]


def test_disk_full_at_the_final_checkpoint_is_a_warning_and_the_export_goes_on(tmp_path):
    """The checkpoint a finished run writes at its last step (for a longer rerun to continue from) fails for lack of
    space: one warning line, the partial folder removed, the export and report.json written, exit 0."""
    out = tmp_path / "run"
    args = [f"train.output_dir={out}", "train.max_steps=3", "train.save_every_steps=2", *FAST]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "ENOSPC_AT_STEP": "3"}
    proc = subprocess.run([sys.executable, "-c", ENOSPC_AT, "--config", str(ROOT / "configs/default.yaml"), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    warning = [line for line in proc.stdout.splitlines() if "warning" in line]
    assert len(warning) == 1 and warning[0].startswith(
        "[harness] warning: no checkpoint of the final step 3 (disk full while writing checkpoint step-3 in "), warning
    assert warning[0].endswith("); the export goes on")
    assert [s for s, _ in store.list_checkpoints(out)[0]] == [2] and store.list_checkpoints(out)[1] == []
    assert (out / "final" / "model.safetensors").is_file()
    assert json.loads((out / "report.json").read_text())["steps"] == 3


def test_no_final_checkpoint_when_switched_off(tmp_path):
    """train.save_final_checkpoint=false: the run ends with the export alone; the periodic checkpoints are kept."""
    out = tmp_path / "run"
    run_train([f"train.output_dir={out}", "train.max_steps=3", "train.save_every_steps=2",
               "train.save_final_checkpoint=false", *FAST])
    assert [s for s, _ in store.list_checkpoints(out)[0]] == [2]
    assert (out / "final" / "model.safetensors").is_file()


@pytest.mark.slow
def test_two_processes_pass_over_a_damaged_checkpoint_together(tmp_path):
    """Under 2 processes: the checksums are split between them at save and at resume, the main process lists and
    warns, and both continue from the same older checkpoint."""
    out = tmp_path / "run"
    args = [f"train.output_dir={out}", "train.max_steps=4", "train.save_every_steps=1", *FAST, "train.save_final=false"]
    run_train([*args, "train.stop_at_step=3"], nproc=2)
    step3 = out / "checkpoints" / "step-3"
    assert {e["path"] for e in read_manifest(step3)["files"]} >= {"random_states_0.pkl",
                                                                              "random_states_1.pkl"}
    damage(step3 / "optimizer.bin", "truncated")
    proc = run_train(args, nproc=2)
    assert proc.stdout.count(f"checkpoint {step3} fails verification (optimizer.bin: size differs") == 1
    assert f"resumed from {out}/checkpoints/step-2: step 2" in proc.stdout
    assert [r["step"] for r in metrics(out)] == [1, 2, 3, 4]


# ----------------------------------------------------------------------------------------------- verifies, does not load


def test_a_file_the_manifest_does_not_list_fails_verification(tmp_path):
    """An extra custom_checkpoint_1.pkl, or a manifest whose list lost a file: what would be loaded is unproven."""
    acc = FakeAccelerator()
    older, newest = save(acc, tmp_path, 2), save(acc, tmp_path, 4)
    (newest / "custom_checkpoint_1.pkl").write_bytes(b"not ours")
    manifest = json.loads((older / MARKER).read_text())
    manifest["files"] = [e for e in manifest["files"] if e["path"] != "random_states_0.pkl"]
    (older / MARKER).write_text(json.dumps(manifest))
    assert verify_checkpoint(newest).problems == ["custom_checkpoint_1.pkl: not in the manifest"]
    assert verify_checkpoint(older).problems == ["random_states_0.pkl: not in the manifest"]


def test_checkpoint_that_verifies_but_does_not_load_falls_back_to_the_older_one(tmp_path):
    class LoadsOnly(FakeAccelerator):
        def load_state(self, path):
            if Path(path).name != "step-2":
                raise RuntimeError("Error(s) in loading state_dict for LlamaForCausalLM:\n\tsize mismatch")
            self.loaded = Path(path)

    acc = LoadsOnly()
    older, newest = save(acc, tmp_path, 2), save(acc, tmp_path, 4)
    assert resume.load_resumable(acc, tmp_path, newest, auto=True) == (older, {"step": 2})
    assert acc.printed[0] == (f"[harness] warning: checkpoint {newest} verifies but cannot be loaded (RuntimeError: "
                              "Error(s) in loading state_dict for LlamaForCausalLM: size mismatch): not resumed from, "
                              "trying an older one")
    assert acc.loaded == older
    with pytest.raises(HarnessError, match=f"could not load checkpoint {newest} "):  # named explicitly: no fallback
        resume.load_resumable(acc, tmp_path, newest, auto=False)
    shutil.rmtree(older)
    with pytest.raises(HarnessError) as e:
        resume.load_resumable(acc, tmp_path, newest, auto=True)
    assert str(e.value) == (f"no checkpoint in {tmp_path}/checkpoints loads (step-4: RuntimeError: Error(s) in loading "
                            "state_dict for LlamaForCausalLM: size mismatch): move the damaged folders away to start "
                            "afresh, check that the config matches the run that wrote them, or use another "
                            "train.output_dir")


def test_run_passes_over_a_checkpoint_that_verifies_but_does_not_load(tmp_path):
    """End to end: step-2's weights file replaced by one of another shape, its manifest rewritten to match (it
    verifies); the restart warns, continues from step-1 and finishes."""
    from safetensors.torch import save_file
    import torch

    out = tmp_path / "run"
    args = [f"train.output_dir={out}", "train.max_steps=3", "train.save_every_steps=1", "train.save_final=false",
            *FAST]
    run_train([*args, "train.stop_at_step=2"])
    step2 = out / "checkpoints" / "step-2"
    save_file({"model.embed_tokens.weight": torch.zeros(3, 3)}, str(step2 / "model.safetensors"))
    manifest.write_marker(step2, manifest.build_manifest(step2))
    assert verify_checkpoint(step2).ok
    proc = run_train(args)
    assert f"[harness] warning: checkpoint {step2} verifies but cannot be loaded (" in proc.stdout
    assert f"resumed from {out}/checkpoints/step-1: step 1" in proc.stdout
    assert "[harness] done: step 3" in proc.stdout and [r["step"] for r in metrics(out)] == [1, 2, 3]


# ----------------------------------------------------------------------------------------------- changed data files


def test_a_data_files_fingerprint_reads_its_ends_only(tmp_path):
    """Size and a hash of the first and last 64 KiB (harness/files.py): an appended row, an edit at either end, a
    replaced file differ; an edit in the middle of a file over 128 KiB does not (not read: the documented limit);
    the same content at another path or in another order of several files is matched by content."""
    from harness.checkpoint import datafiles
    from harness.files import fingerprint

    small, big = tmp_path / "a.jsonl", tmp_path / "big.jsonl"
    small.write_text('{"text": "one"}\n{"text": "two"}\n')
    line = '{"text": "' + "x" * 90 + '"}\n'
    big.write_text(line * 4000)  # 390 KB
    a, b = fingerprint(small), fingerprint(big)
    small.write_text('{"text": "one"}\n{"text": "two"}\n{"text": "three"}\n')
    assert fingerprint(small)["size"] != a["size"]
    small.write_text('{"text": "one"}\n{"text": "tw0"}\n')  # same size, last bytes changed
    assert fingerprint(small)["size"] == a["size"] and fingerprint(small) != a
    text = big.read_text()
    middle = len(text) // 2
    big.write_text(text[:middle] + "y" + text[middle + 1:])
    assert fingerprint(big) == b  # the middle of a large file is not read
    big.write_text("z" + text[1:])
    assert fingerprint(big) != b
    saved = {"data.train_files": [["a.jsonl", a], ["big.jsonl", b]]}
    assert datafiles.compare(saved, {"data.train_files": [["moved/a.jsonl", a], ["big.jsonl", b]]}) == []
    assert datafiles.compare(saved, {"data.train_files": [["big.jsonl", b], ["a.jsonl", a]]}) == [
        "data.train_files: the same files in another order or number"]
    grown = {**a, "size": a["size"] + 18}
    assert datafiles.compare(saved, {"data.train_files": [["a.jsonl", grown], ["big.jsonl", b]]}) == [
        f"data.train_files: a.jsonl changed ({a['size']} -> {a['size'] + 18} bytes)"]
    assert datafiles.compare(saved, {"data.train_files": [["a.jsonl", a]]}) == ["data.train_files: big.jsonl is gone"]


def test_a_resume_on_changed_data_is_refused_in_one_line_or_starts_a_new_epoch(tmp_path):
    """Rows appended to the training file between attempts: the resume is refused in one line naming the file
    (it continued at the old row count in the new file's order: 15.7% off the uninterrupted run in the issue's
    preference run); with train.resume_changed_data=true the new data trains from the start of the next epoch,
    said in one line and recorded in report.json's resumed_changes."""
    data, out = tmp_path / "rows.jsonl", tmp_path / "run"
    rows = (ROOT / "data/sample/gen.jsonl").read_text().splitlines(keepends=True)
    data.write_text("".join(rows[:64]))
    args = [f"train.output_dir={out}", f"data.train_files=[{data}]", "train.max_steps=4", *FAST]
    run_train([*args, "train.stop_at_step=2"])
    size = data.stat().st_size
    with open(data, "a") as f:
        f.write("".join(rows[64:80]))
    refused = run_train(args, check=False)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert refused.stderr.strip().splitlines()[-1] == (
        f"harness: error: the training data changed since {out}/checkpoints/step-2 was written (data.train_files: "
        f"{data} changed ({size} -> {data.stat().st_size} bytes)): its data position counts rows of the old data; "
        f"put the old data back, set train.resume_changed_data=true to train the new data from the start of a new "
        f"epoch, or train it in another train.output_dir")
    assert not (out / "report.json").exists()
    taken = run_train([*args, "train.resume_changed_data=true"])
    assert f"resumed from {out}/checkpoints/step-2: step 2, data position {{'gen': {{'epoch': 1, 'batches': 0}}}}" \
        in taken.stdout, taken.stdout[-3000:]
    assert (f"[harness] the training data changed since {out}/checkpoints/step-2 (data.train_files: {data} changed "
            f"({size} -> {data.stat().st_size} bytes)); train.resume_changed_data=true: the new data from the start "
            f"of epoch 1, from step 3 (weights, optimizer and schedule continue)") in taken.stdout
    rep = report(out)
    assert rep["steps"] == 4 and rep["resumed_changes"]["data"] == {
        "changed": [f"data.train_files: {data} changed ({size} -> {data.stat().st_size} bytes)"], "from_epoch": 1,
        "from_step": 3}
    saved = json.loads((out / "checkpoints/step-4" / store.STATE_FILE).read_text())
    assert saved["data_files"]["data.train_files"][0][1]["size"] == data.stat().st_size  # the new data's, from now on


def test_a_checkpoint_past_a_file_size_limit_is_one_line_with_its_errno_and_the_steps_kept(tmp_path):
    """Issue 55, fault 6: a checkpoint write that fails on a file-size limit (EFBIG) or a quota (EDQUOT) with free
    disk was a raw traceback: torch.save drops the errno ("unexpected pos ... vs ..."), so the failure was taken for a
    bug. Now one line with the errno found again (RLIMIT_FSIZE here; a probe write for a quota), the partial folder
    removed and the steps kept named."""
    import resource

    import torch
    from accelerate import Accelerator

    from harness.checkpoint.store import list_checkpoints, save_checkpoint
    from harness.errors import HarnessError

    acc = Accelerator(cpu=True)
    model = torch.nn.Linear(64, 64)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters()))
    model(torch.randn(2, 64)).sum().backward()
    opt.step()  # the optimizer's state: twice the weights
    save_checkpoint(acc, tmp_path, {"step": 1}, 2)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (20000, hard))  # the weights fit, the optimizer's torch.save does not
    try:
        with pytest.raises(HarnessError) as e:
            save_checkpoint(acc, tmp_path, {"step": 2}, 2)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert str(e.value) == (f"could not write checkpoint {tmp_path}/checkpoints/step-2 ([Errno 27] File too large: "
                            f"this process's file-size limit (ulimit -f) is 19.5 KiB); the partial folder is removed "
                            f"(never marked complete); steps 1-1 are kept (step-1, the newest complete checkpoint: a "
                            f"resume continues after it)")
    assert [s for s, _ in list_checkpoints(tmp_path)[0]] == [1] and not list_checkpoints(tmp_path)[1]


def test_a_weights_file_past_a_file_size_limit_is_one_line_as_torch_saves(tmp_path):
    """Issue 73, fault 10: the weights file (safetensors, from accelerate's save_state) past a file-size limit fails
    with safetensors' 'File too large (os error 27)', not an OSError: it was taken for a bug (a raw traceback). Now
    the same one line as torch.save's (the errno found again), the partial folder removed, the steps kept named."""
    import resource

    import torch
    from accelerate import Accelerator

    from harness.checkpoint.store import list_checkpoints, save_checkpoint
    from harness.errors import HarnessError

    acc = Accelerator(cpu=True)
    model, opt = acc.prepare(torch.nn.Linear(64, 64), torch.optim.AdamW(torch.nn.Linear(1, 1).parameters()))
    save_checkpoint(acc, tmp_path, {"step": 1}, 2)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (8000, hard))  # the weights (16.6 KB) do not fit
    try:
        with pytest.raises(HarnessError) as e:
            save_checkpoint(acc, tmp_path, {"step": 2}, 2)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert str(e.value) == (f"could not write checkpoint {tmp_path}/checkpoints/step-2 ([Errno 27] File too large: "
                            f"this process's file-size limit (ulimit -f) is 7.8 KiB); the partial folder is removed "
                            f"(never marked complete); steps 1-1 are kept (step-1, the newest complete checkpoint: a "
                            f"resume continues after it)")
    assert [s for s, _ in list_checkpoints(tmp_path)[0]] == [1] and not list_checkpoints(tmp_path)[1]


def test_a_resume_with_another_max_len_is_refused_as_changed_data(tmp_path):
    """Issue 55, fault 10: data.max_len changed on resume was accepted without a line, though it decides the rows the
    data position counts (rows cut, packed). Now it is a change of the training data: refused in one line naming
    it (train.resume_changed_data=true: the new rows from a new epoch, as for changed files)."""
    out = tmp_path / "run"
    args = [f"train.output_dir={out}", "train.max_steps=4", *FAST]
    run_train([*args, "train.stop_at_step=1"])
    refused = run_train([*args, "data.max_len=96"], check=False)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    line = refused.stderr.strip().splitlines()[-1]
    assert line.startswith(f"harness: error: the training data changed since {out}/checkpoints/step-1 was written "
                           f"(data.max_len: "), line
    assert "-> 96 (it decides the rows the data position counts)" in line and "train.resume_changed_data=true" in line
