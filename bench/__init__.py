"""Benchmarks of the parameter server: printed figures, not tests.

`python -m bench` runs the app's PS, a tutorial-style reference PS, a Gloo
send+recv and a memcpy of the same bytes, in one run, and prints a table and
the ratios against their goals (bench/report.py, GOALS); `python -m bench
containers` compares the cpu-smoke run as processes and in compose.
"""
