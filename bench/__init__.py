"""Benchmarks of the parameter server: printed figures, not tests.

`python -m bench` prints the headline table: seconds per step of each strategy
(and of the official PS example's design, bench/reference.py) against compute
alone (bench/headline.py); `python -m bench full` the full matrix: the app's
PS, the reference PS, a Gloo send+recv and a memcpy of the same bytes, with the
ratios against their goals (bench/report.py, GOALS); `python -m bench
constants` the step model's constants; `python -m bench containers` compares
the cpu-smoke run as processes and in compose.
"""
