"""The reference ps-compose's figures compare with: the same model, corpus and recipe in one
process, as pytorch/examples' word_language_model trains it (its loop: the training text as
`batch_size` long streams, windows of 35 words in order, the hidden state carried from one
window to the next; SGD at lr 20, gradients clipped at 0.25, the rate divided by 4 when the
held-out perplexity does not improve). `--per-window` starts each window from a zero state
instead, as the port does. Prints the held-out perplexity after each epoch, the test
perplexity at the end, and the seconds it took.

    python examples/wordlm/alone.py [--epochs 4] [--per-window]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from wordlm.data import BPTT, FILES, _words, vocabulary  # noqa: E402
from wordlm.model import RNNModel  # noqa: E402

DATA = Path(__file__).resolve().parent / "data"


def stream(split: str, vocab: dict[str, int], batch: int) -> torch.Tensor:
    """The split's word ids as `batch` parallel streams: [length, batch] (the example's batchify)."""
    ids = torch.tensor([vocab.get(w, vocab["<unk>"]) for w in _words(DATA / FILES[split])])
    length = len(ids) // batch
    return ids[: length * batch].view(batch, length).t().contiguous()


def perplexity(model: RNNModel, data: torch.Tensor, carry: bool) -> float:
    model.eval()
    total, count, state = 0.0, 0, None
    with torch.no_grad():
        for i in range(0, data.size(0) - 1, BPTT):
            x, y = data[i : i + BPTT].t(), data[i + 1 : i + 1 + BPTT].t()
            x = x[:, : y.size(1)]
            out, state = model.rnn(model.encoder(x), state if carry else None)
            logits = model.decoder(out)
            total += nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1), reduction="sum")
            count += y.numel()
    return math.exp(total / count)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--per-window", action="store_true", help="a zero hidden state at each window, as the port")
    args = parser.parse_args()
    torch.manual_seed(0)
    carry = not args.per_window
    vocab = vocabulary(DATA)
    train, val, test = (stream(s, vocab, b) for s, b in (("train", 20), ("val", 10), ("test", 10)))
    model = RNNModel(len(vocab))
    lr, best, start = 20.0, float("inf"), time.monotonic()
    for epoch in range(1, args.epochs + 1):
        model.train()
        state = None
        for i in range(0, train.size(0) - 1, BPTT):
            x, y = train[i : i + BPTT].t(), train[i + 1 : i + 1 + BPTT].t()
            x = x[:, : y.size(1)]
            state = tuple(s.detach() for s in state) if (carry and state is not None) else None
            out, state = model.rnn(model.drop(model.encoder(x)), state)
            logits = model.decoder(model.drop(out))
            loss = nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
            model.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 0.25)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(p.grad, alpha=-lr)
        held_out = perplexity(model, val, carry)
        print(f"epoch {epoch}: held-out perplexity {held_out:.1f}, lr {lr:g}, {time.monotonic() - start:.0f} s")
        if held_out < best:
            best = held_out
        else:
            lr /= 4.0
    print(f"test perplexity {perplexity(model, test, carry):.1f} after {time.monotonic() - start:.0f} s")


if __name__ == "__main__":
    main()
