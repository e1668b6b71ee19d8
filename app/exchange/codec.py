"""What crosses the job's own transport (app.exchange.node): a small typed header, JSON, and the raw
bytes of each tensor in a frame of its own. Nothing received is ever unpickled: a value is
rebuilt only from the JSON kinds and the types listed in `TYPES`; anything else is `Malformed`.

A value is encoded as a JSON tree where every non-scalar says what it is:

    None, bool, int, float, str     as themselves
    tuple / list / dict             {"t": [...]} / {"l": [...]} / {"d": {str: ...}}
    a NamedTuple of TYPES           {"n": "Push", "v": [field, ...]}
    an Enum of TYPES                {"e": "Refused", "v": "stale"}
    a tensor                        {"x": frame, "d": "float32", "s": [shape]}
    a tensor in `c` frames          {"x": first frame, "c": count, "d": ..., "s": ...}

A tensor's bytes are sent from where they are (no copy on the way out, a frame sent zero-copy) and
read where they arrive (the tensor is a view of the received frame: no copy on the way in).

Over an encrypted link (`pack(..., chunk=n)`), a large tensor goes in consecutive frames of about
n bytes (at most CHUNKS of them): ZeroMQ's CURVE encrypts and decrypts a frame at a time, so the
sender encrypts the next frame while the link carries the last, and the receiver decrypts each as
it lands, instead of the whole tensor before and after the link. The receiver copies the frames
into one tensor (it decrypted them into buffers of their own anyway).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from enum import Enum
from typing import Any

import torch

from app.exchange.segment import Offer
from app.exchange.wire import (
    InSlot,
    Joined,
    NotReady,
    Progress,
    Push,
    Refusal,
    Refused,
    Reply,
    Share,
    SlotReply,
    Start,
    Taken,
)

TYPES: dict[str, type] = {
    t.__name__: t
    for t in (InSlot, Joined, NotReady, Offer, Progress, Push, Refusal, Refused, Reply, Share, SlotReply, Start, Taken)
}
DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}
MAX_HEADER_BYTES = 1 << 20  # a header is a few hundred bytes; the values travel in frames
MAX_DEPTH = 16
MAX_FRAMES = 256
CHUNKS = 32  # the most frames one tensor is cut into (pack's `chunk`)


class Malformed(ValueError):
    """A message that is not one this transport sends: dropped (or its call failed), never acted on."""


def pack(header: dict[str, Any], value: Any = None, chunk: int = 0) -> list[Any]:
    """[the header with `value` under "v", then one buffer per tensor in it], ready to send; with
    `chunk`, a tensor of more bytes than that in several frames of about `chunk` bytes."""
    frames: list[Any] = []
    body = dict(header, v=_Encoder(frames, chunk).encode(value, 0))
    return [json.dumps(body, separators=(",", ":")).encode(), *frames]


def unpack(frames: Sequence[Any]) -> tuple[dict[str, Any], Any]:
    """(the header, its value rebuilt with the tensors as views of their frames); Malformed when
    the frames are not a message this module packed."""
    if not frames or len(frames) > MAX_FRAMES + 1:
        raise Malformed(f"{len(frames)} frames")
    first = _bytes(frames[0])
    if len(first) > MAX_HEADER_BYTES:
        raise Malformed(f"a header of {len(first)} bytes")
    try:
        header = json.loads(first)
    except (UnicodeDecodeError, ValueError) as error:
        raise Malformed(f"the header is not JSON ({error})") from None
    if not isinstance(header, dict):
        raise Malformed("the header is not an object")
    return header, _decode(header.get("v"), frames[1:], 0)


def header_of(frames: Sequence[Any]) -> dict[str, Any]:
    """The header alone (its value still encoded), for a message whose value cannot be decoded."""
    header = json.loads(_bytes(frames[0]))
    if not isinstance(header, dict):
        raise Malformed("the header is not an object")
    return header


def _bytes(frame: Any) -> bytes:
    return frame.bytes if hasattr(frame, "bytes") else bytes(frame)


class _Encoder:
    """A value as its JSON tree, its tensors' bytes appended to `frames`."""

    def __init__(self, frames: list[Any], chunk: int) -> None:
        self.frames, self.chunk = frames, chunk

    def encode(self, value: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise TypeError("a value nested too deep to send")
        if value is None or isinstance(value, (bool, int, float, str)) and not isinstance(value, Enum):
            return value
        if isinstance(value, torch.Tensor):
            return self.tensor(value)
        if isinstance(value, Enum):
            if TYPES.get(type(value).__name__) is not type(value):
                raise TypeError(f"{type(value).__name__} is not a type this transport sends")
            return {"e": type(value).__name__, "v": value.value}
        if isinstance(value, tuple) and hasattr(value, "_fields"):
            if TYPES.get(type(value).__name__) is not type(value):
                raise TypeError(f"{type(value).__name__} is not a type this transport sends")
            return {"n": type(value).__name__, "v": [self.encode(v, depth + 1) for v in value]}
        if isinstance(value, tuple):
            return {"t": [self.encode(v, depth + 1) for v in value]}
        if isinstance(value, list):
            return {"l": [self.encode(v, depth + 1) for v in value]}
        if isinstance(value, dict) and all(isinstance(k, str) for k in value):
            return {"d": {k: self.encode(v, depth + 1) for k, v in value.items()}}
        raise TypeError(f"a {type(value).__name__} is not a value this transport sends")

    def tensor(self, tensor: torch.Tensor) -> dict[str, Any]:
        name = str(tensor.dtype).removeprefix("torch.")
        if name not in DTYPES:
            raise TypeError(f"a {name} tensor is not a value this transport sends")
        if tensor.device.type != "cpu":
            raise TypeError("only CPU tensors travel (a GPU worker stages its message in pinned memory)")
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        first = len(self.frames)
        size = flat.numel()
        if not size:
            self.frames.append(b"")
        elif self.chunk and size > self.chunk:
            step = max(self.chunk, -(-size // CHUNKS))
            self.frames.extend(flat[k : k + step].numpy().data for k in range(0, size, step))
        else:
            self.frames.append(flat.numpy().data)
        count = len(self.frames) - first
        if count == 1:
            return {"x": first, "d": name, "s": list(tensor.shape)}
        return {"x": first, "c": count, "d": name, "s": list(tensor.shape)}


def _decode(value: Any, frames: Sequence[Any], depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise Malformed("a value nested too deep")
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if not isinstance(value, dict) or len(value) not in (1, 2, 3, 4):
        raise Malformed(f"a {type(value).__name__} where a tagged value belongs")
    if "x" in value:
        return _tensor_in(value, frames)
    if "t" in value and len(value) == 1:
        return tuple(_decode(v, frames, depth + 1) for v in _items(value["t"]))
    if "l" in value and len(value) == 1:
        return [_decode(v, frames, depth + 1) for v in _items(value["l"])]
    if "d" in value and len(value) == 1 and isinstance(value["d"], dict):
        return {str(k): _decode(v, frames, depth + 1) for k, v in value["d"].items()}
    if "n" in value and "v" in value and len(value) == 2:
        cls = _type(value["n"])
        fields = [_decode(v, frames, depth + 1) for v in _items(value["v"])]
        names = getattr(cls, "_fields", None)
        required = len(names or ()) - len(getattr(cls, "_field_defaults", {}))
        if names is None or not required <= len(fields) <= len(names):
            raise Malformed(f"{value['n']} with {len(fields)} fields")
        return cls(*fields)
    if "e" in value and "v" in value and len(value) == 2:
        cls = _type(value["e"])
        if not issubclass(cls, Enum):
            raise Malformed(f"{value['e']} is not an enumeration")
        try:
            return cls(value["v"])
        except ValueError:
            raise Malformed(f"{value['v']!r} is not a {value['e']}") from None
    raise Malformed(f"an object with keys {sorted(value)[:4]}")


def _items(value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise Malformed(f"a {type(value).__name__} where a list belongs")
    return value


def _type(name: Any) -> type:
    cls = TYPES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise Malformed(f"{str(name)[:40]!r} is not a type this transport sends")
    return cls


def _tensor_in(value: dict[str, Any], frames: Sequence[Any]) -> torch.Tensor:
    index, count, name, shape = value.get("x"), value.get("c", 1), value.get("d"), value.get("s")
    if not isinstance(index, int) or not isinstance(count, int) or isinstance(index, bool) or isinstance(count, bool):
        raise Malformed(f"a tensor in frame {str(index)[:20]} ({str(count)[:20]} frames)")
    if not (0 <= index and 1 <= count and index + count <= len(frames)):
        raise Malformed(f"a tensor in frame {index} ({count} frames) of {len(frames)}")
    dtype = DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None or len(value) != (3 if "c" not in value else 4):
        raise Malformed(f"a tensor of dtype {str(name)[:20]!r}")
    if not isinstance(shape, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        raise Malformed(f"a tensor of shape {str(shape)[:40]}")
    numel = 1
    for n in shape:
        numel *= n
    buffers = [_buffer(frames[k]) for k in range(index, index + count)]
    size = numel * torch.empty((), dtype=dtype).element_size()
    if sum(b.nbytes for b in buffers) != size:
        raise Malformed(f"a {name} tensor of shape {shape} in {sum(b.nbytes for b in buffers)} bytes")
    if not numel:
        return torch.empty(shape, dtype=dtype)
    if count > 1:  # frames of an encrypted link: put together (ZeroMQ decrypted each into its own buffer)
        whole = torch.empty(size, dtype=torch.uint8)
        into, at = whole.numpy().data, 0
        for buffer in buffers:
            into[at : at + buffer.nbytes] = buffer.cast("B")
            at += buffer.nbytes
        return whole.view(dtype).reshape(shape)
    buffer = buffers[0]
    if buffer.readonly:  # bytes (a message made here, not received): a copy the tensor may own
        buffer = memoryview(bytearray(buffer))
    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).reshape(shape)


def _buffer(frame: Any) -> memoryview:
    return frame.buffer if hasattr(frame, "buffer") else memoryview(frame)
