"""The export directory replaced whole (app/publish.py): a full disk mid-write leaves the
earlier export as it was (before: a whole model.json beside a torn model.pt, over a good
export), and two exports of one name at once leave one of them whole, never a mix of
their files (before: both delivered the same run)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from app import publish


def test_a_publish_replaces_the_directory_and_leaves_nothing_beside_it(tmp_path):
    into = tmp_path / "model"
    publish.publish({"model.pt": b"old pt", "model.json": b"old card", "stale.txt": b"x"}, into)
    publish.publish({"model.pt": b"new pt", "model.json": b"new card"}, into)
    assert {p.name: p.read_bytes() for p in into.iterdir()} == {"model.pt": b"new pt", "model.json": b"new card"}
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_a_full_disk_mid_write_leaves_the_earlier_export_as_it_was(tmp_path, monkeypatch):
    into = tmp_path / "model"
    publish.publish({"model.pt": b"good pt", "model.json": b"good card"}, into)
    real_fsync, calls = os.fsync, []

    def full(fd: int) -> None:
        calls.append(fd)
        if len(calls) == 2:  # the second file: the disk is full
            raise OSError(28, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(publish.os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        publish.publish({"model.json": b"new card", "model.pt": b"new pt, torn"}, into)
    assert {p.name: p.read_bytes() for p in into.iterdir()} == {"model.pt": b"good pt", "model.json": b"good card"}
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_exports_of_one_name_at_once_leave_one_whole_pair(tmp_path):
    into = tmp_path / "model"
    errors: list[BaseException] = []

    def export(run: str) -> None:
        try:
            for i in range(40):
                publish.publish({"model.pt": f"{run} {i}".encode(), "model.json": f"{run} {i}".encode()}, into)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=export, args=(run,)) for run in ("run-a", "run-b", "run-c")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    pair = {p.name: p.read_bytes() for p in into.iterdir()}
    assert set(pair) == {"model.pt", "model.json"} and pair["model.pt"] == pair["model.json"], pair
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_a_publish_whose_rename_meets_another_runs_directory_that_is_then_moved_aside_tries_again(
    tmp_path, monkeypatch
):
    """Three exports at once: this one's rename finds a second one's `model` in place (not empty),
    and by the time it looks, a third has moved that aside. It tries again, and its pair is what
    stays (before, it raised "Directory not empty" because `model` was gone when it looked)."""
    into = tmp_path / "model"
    real_rename = Path.rename
    raced = []

    def rename(self: Path, target: Path) -> Path:
        if Path(target) == into and self.name.startswith(".model.new-") and not raced:
            raced.append(self)
            into.mkdir()
            (into / "model.pt").write_bytes(b"another run")  # a second export's, swapped in
            try:
                return real_rename(self, target)
            finally:
                (into / "model.pt").unlink()  # a third export moves it aside and removes it
                into.rmdir()
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", rename)
    publish.publish({"model.pt": b"mine", "model.json": b"mine"}, into)
    assert raced and {p.name: p.read_bytes() for p in into.iterdir()} == {"model.pt": b"mine", "model.json": b"mine"}
    assert [p.name for p in tmp_path.iterdir()] == ["model"]
