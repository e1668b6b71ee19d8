"""Write data/digits.npz, the example's dataset: scikit-learn's 8x8 digits as uint8
(values 0..16), split once into train (80%) and held-out (20%) with a fixed seed.

    python examples/custom/make_data.py     # rewrites examples/custom/data/digits.npz

The file ships in the repository; this script says how it was made.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from sklearn.datasets import load_digits

OUT = Path(__file__).resolve().parent / "data" / "digits.npz"
HELD_OUT = 0.2
SEED = 0


def main() -> None:
    bunch = load_digits()
    x = bunch.images.astype(np.uint8)  # (1797, 8, 8), 0..16
    y = bunch.target.astype(np.int64)
    order = np.random.default_rng(SEED).permutation(len(y))
    cut = round(len(y) * HELD_OUT)
    test, train = order[:cut], order[cut:]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(OUT, x_train=x[train], y_train=y[train], x_test=x[test], y_test=y[test])
    print(f"wrote {OUT}: {len(train)} train, {len(test)} held-out samples, {OUT.stat().st_size} bytes")


if __name__ == "__main__":
    main()
