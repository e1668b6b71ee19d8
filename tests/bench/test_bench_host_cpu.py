"""bench.host_cpu: /proc/stat read into busy and all jiffies, the share of the host's cores busy
over a window of samples, and the sampler over a real /proc/stat."""

from __future__ import annotations

import sys

import pytest

from bench import host_cpu

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
    samples = [(0.0, 0, 0), (1.0, 10, 100), (2.0, 70, 200), (3.0, 160, 300), (4.0, 160, 400)]
    # inside [0.5, 3.5]: from t=1 to t=3, 150 busy of 200
    assert host_cpu.busy_share(samples, 0.5, 3.5) == pytest.approx(0.75)
    assert host_cpu.busy_share(samples, 0.0, 4.0) == pytest.approx(0.4)
    assert host_cpu.busy_share(samples, 1.5, 2.5) is None  # one sample inside: no share
    assert host_cpu.busy_share([], 0.0, 9.0) is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/stat is Linux's")
def test_the_sampler_reads_proc_stat_from_entry_to_exit_and_sees_a_spinning_core():
    with host_cpu.Sampler(every=0.01) as cpu:
        t = cpu.samples[0][0]
        while cpu.samples[-1][0] < t + 0.3:  # spin a core until the thread has sampled 0.3 s
            pass
    times = [s[0] for s in cpu.samples]
    assert len(times) >= 3 and times == sorted(times)
    assert all(b0 <= b1 and a0 <= a1 for (_, b0, a0), (_, b1, a1) in zip(cpu.samples, cpu.samples[1:]))
    share = host_cpu.busy_share(cpu.samples, times[0], times[-1])
    assert share is not None and 0.0 < share <= 1.0
