"""`char_transformer`: a small decoder-only transformer (torch.nn only), the language model the
project trains beside its CNNs (configs/cpu-lm.yaml, on app/data/text.py's characters).

Token and position embeddings, pre-norm causal self-attention blocks (torch.nn's
TransformerEncoderLayer with a causal mask), a final norm and a linear head: logits
[batch, length, classes] for inputs [batch, length] of class indices. The builder takes the
app's model contract, `num_classes` (the vocabulary) and `channels` (unused: a sequence of
indices has one), and the sizes as keyword arguments.
"""

from __future__ import annotations

import torch
from torch import nn

MAX_CONTEXT = 256  # the longest input the position embedding covers


class CharTransformer(nn.Module):
    def __init__(
        self,
        num_classes: int,
        channels: int = 1,
        width: int = 96,
        heads: int = 4,
        layers: int = 2,
        context: int = MAX_CONTEXT,
    ) -> None:
        super().__init__()
        self.context = context
        self.tokens = nn.Embedding(num_classes, width)
        self.positions = nn.Embedding(context, width)
        block = nn.TransformerEncoderLayer(
            width, heads, dim_feedforward=4 * width, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[-1]
        if length > self.context:
            raise ValueError(f"input of {length} positions; this model covers at most {self.context}")
        h = self.tokens(x) + self.positions(torch.arange(length, device=x.device))
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=x.device, dtype=h.dtype)
        h = self.blocks(h, mask=mask, is_causal=True)
        return self.head(self.norm(h))
