"""The progress arithmetic (app.training.progress): numbers in, percent, ETA and the line out."""

from __future__ import annotations

from app.training.progress import RunProgress, clock, eta_seconds, line, percent


def test_percent_is_done_of_total_with_one_decimal() -> None:
    assert percent(1200, 4680) == 25.6
    assert percent(0, 4680) == 0.0
    assert percent(4680, 4680) == 100.0


def test_percent_never_passes_100_and_is_none_without_a_total() -> None:
    assert percent(5000, 4680) == 100.0
    assert percent(10, None) is None
    assert percent(0, 0) is None


def test_eta_is_what_is_left_at_the_window_rate() -> None:
    assert eta_seconds(1200, 4680, 13.5) == round(3480 / 13.5, 1)  # 257.8 s
    assert eta_seconds(1200, 4680, 27.0) == round(3480 / 27.0, 1)  # twice the workers: half the time


def test_eta_is_zero_at_the_end_and_unknown_without_a_rate_or_a_total() -> None:
    assert eta_seconds(4680, 4680, 10.0) == 0.0
    assert eta_seconds(4700, 4680, 0.0) == 0.0
    assert eta_seconds(1200, 4680, 0.0) is None  # no update in the window: no rate to go by
    assert eta_seconds(1200, None, 10.0) is None


def test_clock_is_hours_minutes_seconds() -> None:
    assert clock(257.4) == "0:04:17"
    assert clock(0) == "0:00:00"
    assert clock(3600 * 26 + 61) == "26:01:01"
    assert clock(59.6) == "0:01:00"


def test_the_line_says_step_of_total_percent_samples_per_second_and_eta() -> None:
    where = RunProgress(done=1200, total=4680, updates_per_s=13.5, samples_per_s=812.4)
    assert where.line() == "step 1200 of 4680 (25.6%), 812 samples/s, ETA 0:04:18"
    assert where.fields() == {"total": 4680, "percent": 25.6, "eta_s": 257.8}


def test_an_unknown_total_is_said_and_no_number_is_made_up() -> None:
    where = RunProgress(done=1200, total=None, updates_per_s=13.5, samples_per_s=812.4)
    assert where.line() == "step 1200 (total unknown), 812 samples/s"
    assert where.fields() == {}


def test_no_update_in_the_window_leaves_the_eta_unknown() -> None:
    where = RunProgress(done=1200, total=4680, updates_per_s=0.0, samples_per_s=0.0)
    assert where.line() == "step 1200 of 4680 (25.6%), 0 samples/s, ETA unknown"
    assert where.fields() == {"total": 4680, "percent": 25.6}


def test_line_of_recorded_numbers_matches_the_live_one() -> None:
    where = RunProgress(done=300, total=400, updates_per_s=20.0, samples_per_s=640.0)
    assert line(300, 400, 640.0, where.eta_s) == where.line() == "step 300 of 400 (75.0%), 640 samples/s, ETA 0:00:05"
