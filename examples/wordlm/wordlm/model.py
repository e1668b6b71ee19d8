"""pytorch/examples' word_language_model RNNModel (BSD-3-Clause, Copyright (c) 2017 the
PyTorch contributors), as ps-compose's model factory takes it: `train.model: wordlm.model:lstm`.

Two changes from the example:
- batch first: ps-compose gives a model `[batch, length]` word ids and its loss takes
  `[batch, length, vocabulary]` logits (the example's tensors are sequence first);
- the hidden state starts at zero for every window: the example carries it from one window
  to the next of one long stream, but here windows are independent samples spread over the
  workers, and the PS evaluates them in any order. Each window is 35 words of context.
"""

from __future__ import annotations

import torch
from torch import nn


class RNNModel(nn.Module):
    """Embedding, a 2-layer LSTM, a linear decoder; dropout between them, as the example's."""

    def __init__(self, ntoken: int, ninp: int = 200, nhid: int = 200, nlayers: int = 2, dropout: float = 0.2) -> None:
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout, batch_first=True)
        self.decoder = nn.Linear(nhid, ntoken)
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -0.1, 0.1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        output, _ = self.rnn(self.drop(self.encoder(ids)))  # hidden state: zero at each window's start
        return self.decoder(self.drop(output))


def lstm(num_classes: int, channels: int) -> nn.Module:
    """ps-compose's model factory: the example's defaults (--emsize 200 --nhid 200 --nlayers 2 --dropout 0.2)."""
    return RNNModel(num_classes)
