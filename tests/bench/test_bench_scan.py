"""`python -m bench scan` and `python -m bench data`: generated trees and printed lines (no timing asserted)."""

from __future__ import annotations

import re

from bench.__main__ import main
from bench.imagefolder_scan import make_tree, scan_seconds


def test_make_tree_is_what_the_scan_finds(tmp_path):
    make_tree(tmp_path, 250, 5)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"class{c:03d}" for c in range(5)]
    seconds, found = scan_seconds(tmp_path)
    assert found == 250 and seconds >= 0


def test_scan_prints_files_and_seconds(capsys):
    assert main(["scan", "--files", "300", "--classes", "3", "--repeats", "1"]) == 0
    line = capsys.readouterr().out.strip()
    assert re.fullmatch(
        r"scan: 300 files in 3 classes \(\d+\.\d s to create\): find_samples \d+\.\d\d s "
        r"\(best of 1; [\d,]+ files/s\) on \d+ CPU\(s\)",
        line,
    ), line


def test_bench_data_prints_six_rates(capsys):
    assert main(["data", "--images", "24", "--batch", "8"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "data: 24 JPEGs of 224 px, batch 8, one core; images/s per worker:"
    names = [re.match(r"^  (.+?)\s+[\d,]+$", line).group(1) for line in lines[1:]]
    assert names == [
        "today",
        "first epoch (decode + augment)",
        "cached epoch (uint8 batches)",
        "cached epoch + augment on CPU",
        "file cache: write it (decode)",
        "file cache: cached epoch (uint8)",
    ]
