"""bench.host_cpu: /proc/stat read into busy and all jiffies, the share of the host's cores busy
over a window of samples, the app's processes told by their command line and their CPU per role
over a window, and the sampler over a real /proc."""

from __future__ import annotations

import sys
import time

import pytest

from bench import host_cpu

from needs import host_has

STAT = """cpu  100 5 20 800 50 3 2 10 0 0
cpu0 50 2 10 400 25 1 1 5 0 0
cpu1 50 3 10 400 25 2 1 5 0 0
intr 12345
"""


def test_jiffies_sum_every_core_and_count_all_but_idle_and_iowait_as_busy():
    busy, total = host_cpu.jiffies(STAT)
    assert total == 100 + 5 + 20 + 800 + 50 + 3 + 2 + 10
    assert busy == total - 800 - 50


def test_jiffies_refuse_a_text_without_the_cpu_line():
    with pytest.raises(ValueError, match="no `cpu` line"):
        host_cpu.jiffies("intr 1\n")


def test_busy_share_reads_the_samples_inside_the_window():
    samples = [(0.0, 0, 0, {}), (1.0, 10, 100, {}), (2.0, 70, 200, {}), (3.0, 160, 300, {}), (4.0, 160, 400, {})]
    # inside [0.5, 3.5]: from t=1 to t=3, 150 busy of 200
    assert host_cpu.busy_share(samples, 0.5, 3.5) == pytest.approx(0.75)
    assert host_cpu.busy_share(samples, 0.0, 4.0) == pytest.approx(0.4)
    assert host_cpu.busy_share(samples, 1.5, 2.5) is None  # one sample inside: no share
    assert host_cpu.busy_share([], 0.0, 9.0) is None


@host_has(sys.platform.startswith("linux"), "/proc/stat (Linux)")
def test_the_sampler_reads_proc_stat_from_entry_to_exit_and_sees_a_spinning_core():
    with host_cpu.Sampler(every=0.01) as cpu:
        t = cpu.samples[0][0]
        while cpu.samples[-1][0] < t + 0.3:  # spin a core until the thread has sampled 0.3 s
            pass
    times = [s[0] for s in cpu.samples]
    assert len(times) >= 3 and times == sorted(times)
    assert all(b0 <= b1 and a0 <= a1 for (_, b0, a0, _), (_, b1, a1, _) in zip(cpu.samples, cpu.samples[1:]))
    share = host_cpu.busy_share(cpu.samples, times[0], times[-1])
    assert share is not None and 0.0 < share <= 1.0


def test_an_app_process_is_told_by_its_role_from_its_command_line():
    assert host_cpu.app_role(b"/venv/bin/python\0-m\0app\0ps\0") == "ps"
    assert host_cpu.app_role(b"python3\0-u\0-m\0app\0worker\0--rank\0002\0") == "worker"
    assert host_cpu.app_role(b"python\0-m\0app\0--help\0") is None  # not a role
    assert host_cpu.app_role(b"python\0-m\0orchestrator\0local\0") is None
    assert host_cpu.app_role(b"") is None  # a kernel thread's


def test_process_jiffies_add_user_and_system_time_past_a_name_with_spaces():
    stat = "4242 (pt main thread) S 1 4242 4242 0 -1 4194560 100 0 0 0 250 30 0 0 20 0 9 0 100 0 0"
    assert host_cpu.process_jiffies(stat) == 280


def test_cpu_seconds_per_role_count_each_process_from_the_first_sample_inside_the_window():
    t = host_cpu.TICKS
    samples = [
        (0.0, 0, 0, {"ps:1": 0, "worker:2": 0}),
        (1.0, 0, 0, {"ps:1": t, "worker:2": 2 * t}),
        (2.0, 0, 0, {"ps:1": 3 * t, "worker:2": 3 * t, "worker:3": t}),  # a loader process started
        (3.0, 0, 0, {"ps:1": 4 * t, "worker:2": 5 * t, "worker:3": 2 * t}),
        (4.0, 0, 0, {"ps:1": 5 * t, "worker:2": 6 * t}),  # the loader process ended
    ]
    got = host_cpu.cpu_seconds(samples, 0.5, 3.0)
    assert got == {"ps": pytest.approx(3.0), "worker": pytest.approx(3.0 + 2.0)}
    assert host_cpu.cpu_seconds(samples, 0.5, 4.0)["worker"] == pytest.approx(4.0 + 2.0)  # its 2 s still count
    assert host_cpu.cpu_seconds(samples, 1.5, 2.5) == {}  # one sample inside
    assert host_cpu.cpu_seconds([(0.0, 0, 0, {}), (1.0, 0, 0, {})], 0.0, 1.0) == {}  # no app process


@host_has(sys.platform.startswith("linux"), "/proc (Linux)")
def test_the_sampler_counts_the_cpu_of_a_real_app_process_that_became_one_by_exec(tmp_path, monkeypatch):
    """A shell that execs `python -m app worker` (an `app` package that spins) under its own pid,
    as a container's init does: once its command line says so, its CPU is the worker role's."""
    import subprocess

    monkeypatch.setattr(host_cpu, "RECHECK_S", 0.05)
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "__main__.py").write_text(
        "import time\nend = time.time() + 0.6\nwhile time.time() < end: pass\n"
    )
    # The shell execs once the sampler has taken two samples (`go` made): a loaded host may take
    # longer than any fixed sleep to enter the sampler.
    gate = tmp_path / "go"
    shell = f"while [ ! -e {gate} ]; do sleep 0.02; done; exec {sys.executable} -m app worker"
    proc = subprocess.Popen(["sh", "-c", shell], cwd=tmp_path)
    with host_cpu.Sampler(every=0.05) as cpu:
        deadline = time.monotonic() + 30
        while len(cpu.samples) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        gate.touch()
        proc.wait(timeout=30)
    seen = [sample[3][f"worker:{proc.pid}"] for sample in cpu.samples if f"worker:{proc.pid}" in sample[3]]
    assert len(seen) >= 2 and 0 < seen[-1] - seen[0] <= host_cpu.TICKS  # its spin, ~0.6 s of a core
    assert not any(f"worker:{proc.pid}" in sample[3] for sample in cpu.samples[:2])  # a shell first
    used = host_cpu.cpu_seconds(cpu.samples, cpu.samples[0][0], cpu.samples[-1][0])
    assert used["worker"] >= (seen[-1] - seen[0]) / host_cpu.TICKS  # other app processes may add theirs
