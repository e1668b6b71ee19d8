"""app.pidns: the holder of the shared PID namespace waits for the job's processes to come,
and exits once they have been gone for its grace period (a fake /proc and clock)."""

from __future__ import annotations

from pathlib import Path

from app import pidns


class FakeHost:
    """A /proc whose processes follow a script: at tick i, the pids of `script[i]`."""

    def __init__(self, root: Path, script: list[set[int]]) -> None:
        self.root, self.script, self.tick, self.now = root, script, 0, 0.0
        self._show()

    def _show(self) -> None:
        for entry in self.root.iterdir():
            entry.rmdir()
        for pid in {1, 7} | self.script[min(self.tick, len(self.script) - 1)]:  # tini and the holder itself
            (self.root / str(pid)).mkdir()
        (self.root / "self").mkdir(exist_ok=True)  # not a pid

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.tick += 1
        self._show()


def run(tmp_path: Path, script: list[set[int]], grace: float = 3.0, limit: int = 100) -> tuple[int, int]:
    host = FakeHost(tmp_path, script + [set()] * limit)
    assert pidns.hold(1.0, grace, tmp_path, frozenset({7}), host.clock, host.sleep) == 0
    return host.tick, len(script)


def test_others_leaves_out_tini_the_holder_and_what_is_not_a_pid(tmp_path: Path) -> None:
    FakeHost(tmp_path, [{12, 30}])
    assert sorted(pidns.others(tmp_path, frozenset({7}))) == [12, 30]


def test_it_exits_once_the_job_has_been_gone_for_the_grace_period(tmp_path: Path) -> None:
    ticks, busy = run(tmp_path, [{20}, {20, 21}, {21}])
    assert ticks == busy - 1 + 3  # last seen at tick 2, exit 3 ticks of 1 s later


def test_a_container_restarting_within_the_grace_keeps_the_namespace(tmp_path: Path) -> None:
    # the PS alone, gone for 2 ticks (a restart), back, then done
    ticks, _ = run(tmp_path, [{20}, set(), set(), {25}, {25}])
    assert ticks == 4 + 3


def test_it_waits_for_the_first_process_however_long(tmp_path: Path) -> None:
    ticks, _ = run(tmp_path, [set()] * 10 + [{40}])
    assert ticks == 10 + 3
