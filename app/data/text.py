"""`stdlib_text`: a character-level language-modelling dataset that ships with Python itself, the
source of its standard library (the top-level `.py` files of `sysconfig`'s stdlib directory), so
nothing is downloaded and every host with Python has it (the image's Debian Python, the venv's).

Characters map to a fixed vocabulary: newline, tab and the 95 printable ASCII characters, and
one class for any other character, so the model's size does not depend on the Python version.
Every tenth file (sorted by name) is held out. A sample is a window of `CONTEXT` characters
and the same window one character later: (inputs, targets), both LongTensor [CONTEXT]; the
training windows tile the text, the held-out split keeps at most `HELD_OUT_WINDOWS` spread over
its text (an evaluation of a few seconds on a CPU).
"""

from __future__ import annotations

import math
import sysconfig
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from app.config import UsageError

CONTEXT = 64
HELD_OUT_EVERY = 10
HELD_OUT_WINDOWS = 1024
VOCABULARY = "\n\t" + "".join(chr(c) for c in range(32, 127))
UNKNOWN = len(VOCABULARY)  # the class of every other character
NUM_CLASSES = len(VOCABULARY) + 1


def source_files(root: Path | None = None) -> list[Path]:
    """The standard library's top-level modules, sorted by name."""
    root = Path(sysconfig.get_paths()["stdlib"]) if root is None else root
    files = sorted(root.glob("*.py"))
    if not files:
        raise UsageError(f"dataset stdlib_text: no .py files in {root} (this Python ships no standard library source)")
    return files


def encode(text: str) -> torch.Tensor:
    """Characters as class indices (uint8): the vocabulary's, UNKNOWN for any other."""
    table = np.full(129, UNKNOWN, dtype=np.uint8)
    for i, c in enumerate(VOCABULARY):
        table[ord(c)] = i
    points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    return torch.from_numpy(table[np.minimum(points, 128)].copy())


def split_text(train: bool, root: Path | None = None) -> torch.Tensor:
    """The encoded text of the training files, or of the held-out ones (every tenth)."""
    files = source_files(root)
    chosen = [f for i, f in enumerate(files) if (i % HELD_OUT_EVERY == 0) != train]
    return encode("\n".join(f.read_text(encoding="utf-8", errors="replace") for f in chosen))


class TextWindows(Dataset):
    """Windows of encoded text, each (inputs, targets): `context` characters and the same ones
    shifted by one. Indexed by a list of indices (a batch: one gather, no collate)."""

    def __init__(self, codes: torch.Tensor, context: int = CONTEXT, limit: int | None = None) -> None:
        self.codes, self.context = codes, context
        windows = (len(codes) - 1) // context
        if windows < 1:
            raise UsageError(f"dataset stdlib_text: {len(codes)} characters hold no window of {context}")
        step = max(1, windows // limit) if limit else 1
        self.starts = torch.arange(0, windows, step)[: limit or windows] * context

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: list[int] | int) -> tuple[torch.Tensor, torch.Tensor]:
        starts = self.starts[torch.as_tensor(index)]
        offsets = torch.arange(self.context + 1)
        window = self.codes[starts.unsqueeze(-1) + offsets].long()
        return window[..., :-1], window[..., 1:]


def load(train: bool, root: Path | None = None) -> TextWindows:
    """The training windows (tiling the text) or the held-out ones (at most HELD_OUT_WINDOWS)."""
    return TextWindows(split_text(train, root), limit=None if train else HELD_OUT_WINDOWS)


def baselines(root: Path | None = None) -> dict[str, float]:
    """The perplexities a model without context would reach on the held-out text: the unigram's
    (each character's frequency in the training text) and the bigram's (given the previous
    one), both with add-one smoothing; what a language model must beat."""
    train, held_out = split_text(True, root), split_text(False, root)
    unigram = torch.bincount(train.long(), minlength=NUM_CLASSES).double() + 1.0
    log_p = (unigram / unigram.sum()).log()
    uni = math.exp(-float(log_p[held_out.long()].mean()))
    pairs = Counter(zip(train[:-1].tolist(), train[1:].tolist()))
    counts = torch.ones(NUM_CLASSES, NUM_CLASSES, dtype=torch.float64)
    for (a, b), n in pairs.items():
        counts[a, b] += n
    cond = (counts / counts.sum(1, keepdim=True)).log()
    bi = math.exp(-float(cond[held_out[:-1].long(), held_out[1:].long()].mean()))
    return {"unigram": uni, "bigram": bi}
