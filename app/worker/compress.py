"""--compress bf16|fp16: a push's wire format, with error feedback."""

from __future__ import annotations

import torch


class Compressor:
    """The message for the wire as one 16-bit tensor: the gradients cast to bf16/fp16
    (their rounding error is kept and added to the next gradient: error feedback),
    then the float32 buffers bit for bit, each as two 16-bit values (the PS reads
    them back: app.ps.server.ParameterServer, when it checks a push). A gradient that is
    not finite on the wire (NaN, inf, or past fp16's range) leaves no residual: the PS
    refuses that push, the batch is skipped, and the next push starts clean."""

    DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

    def __init__(self, kind: str, num_params: int, device: torch.device) -> None:
        self.dtype = self.DTYPES[kind]
        self.num_params = num_params
        self.residual = torch.zeros(num_params, device=device)

    def __call__(self, message: torch.Tensor) -> torch.Tensor:
        n = self.num_params
        grads = message[:n]
        grads.add_(self.residual)
        wire = torch.empty(n + 2 * (message.numel() - n), dtype=self.dtype, device=message.device)
        wire[:n].copy_(grads)
        wire[n:].copy_(message[n:].view(self.dtype))
        if torch.isfinite(wire[:n]).all():
            torch.sub(grads, wire[:n].float(), out=self.residual)
        else:  # NaN or inf, or a value past fp16's 65504: the PS refuses this push and the
            self.residual.zero_()  # batch is skipped; a residual holding it would spoil every later one
        return wire

    @staticmethod
    def slice(wire: torch.Tensor, num_params: int, start: int, end: int) -> torch.Tensor:
        """Values start..end of the state vector in a compressed message (a PS shard's part)."""

        def at(i: int) -> int:
            return i if i <= num_params else num_params + 2 * (i - num_params)

        return wire[at(start) : at(end)]
