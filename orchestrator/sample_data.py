"""`make sample-data`: a small image tree in Imagenette's layout, from data that ships offline.

    <out>/train/<class>/*.JPEG|*.png
    <out>/val/<class>/*.JPEG|*.png

The images are scikit-learn's 8x8 `digits` (1,797 of them, inside the
package), upsampled to `size` pixels and coloured: a random foreground and
background colour per image, a small random shift and some noise, written as
JPEG (Imagenette's own format) and PNG, alternately. Every fourth image of the
scikit-learn order goes to val/. The same arguments give the same files.

It stands in for a real ImageFolder tree on machines that cannot download one:
configs/cpu-resnet.yaml trains ResNet-18 on it. Needs numpy, Pillow and
scikit-learn (the dev venv, `make setup`).
"""

from __future__ import annotations

from pathlib import Path

from orchestrator.errors import UsageError
from orchestrator.hints import command

CLASSES = tuple(f"digit_{d}" for d in range(10))
VAL_EVERY = 4  # every 4th image is held out: ~450 val, ~1,350 train
DEFAULT_OUT = "data/sample-imagenette"
DEFAULT_SIZE = 32


def write_tree(out: Path, size: int = DEFAULT_SIZE, seed: int = 0) -> dict[str, int]:
    """Write the tree under `out` (replacing images of an earlier run); images per split."""
    try:
        import numpy as np
        from PIL import Image
        from sklearn.datasets import load_digits
    except ImportError as error:
        raise UsageError(
            f"sample data needs numpy, Pillow and scikit-learn ({error.name} is missing); "
            f"run it with the dev venv: {command('sample-data')}"
        ) from None
    if size < 8:
        raise UsageError(f"--size: got {size}; must be at least 8 (pixels)")
    digits = load_digits()
    rng = np.random.default_rng(seed)
    counts = {"train": 0, "val": 0}
    for split in counts:
        for name in CLASSES:
            folder = out / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for old in folder.iterdir():
                if old.suffix in (".JPEG", ".png"):
                    old.unlink()
    for index, (pixels, label) in enumerate(zip(digits.images, digits.target)):
        split = "val" if index % VAL_EVERY == VAL_EVERY - 1 else "train"
        image = _coloured(pixels / 16.0, size, rng, np, Image)
        suffix = ".JPEG" if (index // VAL_EVERY) % 2 == 0 else ".png"
        path = out / split / CLASSES[label] / f"{split}_{index:05d}{suffix}"
        if suffix == ".JPEG":
            image.save(path, quality=90)
        else:
            image.save(path)
        counts[split] += 1
    return counts


def _coloured(ink, size: int, rng, np, Image):
    """One 8x8 digit (values 0..1) as a `size` x `size` RGB image."""
    gray = Image.fromarray((ink * 255).astype(np.uint8), mode="L").resize((size, size), Image.BILINEAR)
    alpha = np.asarray(gray, dtype=np.float32)[..., None] / 255.0
    shift = rng.integers(-size // 8, size // 8 + 1, size=2)
    alpha = np.roll(alpha, tuple(shift), axis=(0, 1))
    fg = rng.uniform(0.55, 1.0, size=3) * 255
    bg = rng.uniform(0.0, 0.35, size=3) * 255
    rgb = alpha * fg + (1 - alpha) * bg + rng.normal(0, 8, size=(size, size, 3))
    return Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8), mode="RGB")


def run(out: str, size: int) -> int:
    """The `sample-data` verb: write the tree, print one line."""
    counts = write_tree(Path(out), size)
    print(
        f"{out}: {counts['train']} train and {counts['val']} val images, "
        f"{len(CLASSES)} classes, {size}x{size} px (JPEG and PNG)"
    )
    return 0
