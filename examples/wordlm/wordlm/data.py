"""The corpus as ps-compose's dataset factory takes it: `train.dataset: wordlm.data:corpus`.

pytorch/examples' word_language_model reads wikitext's train/valid/test.txt, numbers the
words as it meets them, and feeds the model one long sequence cut into windows of `bptt`
words, carrying the LSTM's hidden state from one window to the next. Ported:

- The vocabulary is built from all three files, in one fixed order, by every process: the
  workers (train), the PS (valid) and the end's test split must agree on num_classes, the
  model's output width. (Built from each split alone, the splits would disagree and the
  job stops at its start with one line naming num_classes.)
- A sample is one window: `BPTT` word ids and the next word at each position. Windows are
  independent samples, shuffled and spread over the workers, so no hidden state crosses
  from one to the next (see model.py).
- Words that occur once in the training text are `<unk>`, as wikitext does.
"""

from __future__ import annotations

import collections
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

BPTT = 35  # words a window, as the example's --bptt
FILES = {"train": "train.txt", "val": "valid.txt", "test": "test.txt"}


def _words(path: Path) -> list[str]:
    return [word for line in path.read_text(encoding="utf-8").splitlines() for word in (*line.split(), "<eos>")]


def vocabulary(root: Path) -> dict[str, int]:
    """Every word of the training text seen twice or more, then <unk>: ids by frequency, ties
    by spelling, so every process numbers them alike."""
    counts = collections.Counter(_words(root / FILES["train"]))
    kept = sorted((w for w, n in counts.items() if n >= 2), key=lambda w: (-counts[w], w))
    return {word: i for i, word in enumerate([*kept, "<unk>"])}


def corpus(root: str, train: bool, seed: int, split: str):
    """(windows of `split`, 1 channel, the vocabulary's size): ps-compose's dataset factory."""
    where = Path(root)
    if not (where / FILES["train"]).is_file():
        raise FileNotFoundError(f"{where / FILES['train']}: run examples/wordlm/make_data.py first")
    vocab = vocabulary(where)
    unknown = vocab["<unk>"]
    ids = torch.tensor([vocab.get(w, unknown) for w in _words(where / FILES[split])])
    count = (len(ids) - 1) // BPTT
    x = ids[: count * BPTT].view(count, BPTT)
    y = ids[1 : count * BPTT + 1].view(count, BPTT)
    return TensorDataset(x, y), 1, len(vocab)
