"""What crosses the job's own transport (app.exchange.node): a small typed header, JSON, and the raw
bytes of each tensor in a frame of its own. Nothing received is ever unpickled: a value is
rebuilt only from the JSON kinds and the types listed in `TYPES`; anything else is `Malformed`.

A value is encoded as a JSON tree where every non-scalar says what it is:

    None, bool, int, float, str     as themselves
    tuple / list / dict             {"t": [...]} / {"l": [...]} / {"d": {str: ...}}
    a NamedTuple of TYPES           {"n": "Push", "v": [field, ...]}
    an Enum of TYPES                {"e": "Refused", "v": "stale"}
    a tensor                        {"x": frame, "d": "float32", "s": [shape]}

A tensor's bytes are sent from where they are (no copy on the way out, a frame sent zero-copy) and
read where they arrive (the tensor is a view of the received frame: no copy on the way in).
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
MAX_FRAMES = 64


class Malformed(ValueError):
    """A message that is not one this transport sends: dropped (or its call failed), never acted on."""


def pack(header: dict[str, Any], value: Any = None) -> list[Any]:
    """[the header with `value` under "v", then one buffer per tensor in it], ready to send."""
    frames: list[Any] = []
    body = dict(header, v=_encode(value, frames, 0))
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


def _encode(value: Any, frames: list[Any], depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise TypeError("a value nested too deep to send")
    if value is None or isinstance(value, (bool, int, float, str)) and not isinstance(value, Enum):
        return value
    if isinstance(value, torch.Tensor):
        return _tensor_out(value, frames)
    if isinstance(value, Enum):
        if TYPES.get(type(value).__name__) is not type(value):
            raise TypeError(f"{type(value).__name__} is not a type this transport sends")
        return {"e": type(value).__name__, "v": value.value}
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        if TYPES.get(type(value).__name__) is not type(value):
            raise TypeError(f"{type(value).__name__} is not a type this transport sends")
        return {"n": type(value).__name__, "v": [_encode(v, frames, depth + 1) for v in value]}
    if isinstance(value, tuple):
        return {"t": [_encode(v, frames, depth + 1) for v in value]}
    if isinstance(value, list):
        return {"l": [_encode(v, frames, depth + 1) for v in value]}
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {"d": {k: _encode(v, frames, depth + 1) for k, v in value.items()}}
    raise TypeError(f"a {type(value).__name__} is not a value this transport sends")


def _tensor_out(tensor: torch.Tensor, frames: list[Any]) -> dict[str, Any]:
    name = str(tensor.dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise TypeError(f"a {name} tensor is not a value this transport sends")
    if tensor.device.type != "cpu":
        raise TypeError("only CPU tensors travel (a GPU worker stages its message in pinned memory)")
    flat = tensor.detach().contiguous().reshape(-1)
    frames.append(flat.view(torch.uint8).numpy().data if flat.numel() else b"")
    return {"x": len(frames) - 1, "d": name, "s": list(tensor.shape)}


def _decode(value: Any, frames: Sequence[Any], depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise Malformed("a value nested too deep")
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if not isinstance(value, dict) or len(value) not in (1, 2, 3):
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
    index, name, shape = value.get("x"), value.get("d"), value.get("s")
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(frames):
        raise Malformed(f"a tensor in frame {index!r} of {len(frames)}")
    dtype = DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None or len(value) != 3:
        raise Malformed(f"a tensor of dtype {str(name)[:20]!r}")
    if not isinstance(shape, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        raise Malformed(f"a tensor of shape {str(shape)[:40]}")
    numel = 1
    for n in shape:
        numel *= n
    frame = frames[index]
    buffer = frame.buffer if hasattr(frame, "buffer") else memoryview(frame)
    size = numel * torch.empty((), dtype=dtype).element_size()
    if buffer.nbytes != size:
        raise Malformed(f"a {name} tensor of shape {shape} in {buffer.nbytes} bytes")
    if not numel:
        return torch.empty(shape, dtype=dtype)
    if buffer.readonly:  # bytes (a message made here, not received): a copy the tensor may own
        buffer = memoryview(bytearray(buffer))
    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).reshape(shape)
