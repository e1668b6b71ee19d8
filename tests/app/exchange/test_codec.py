"""What crosses the job's own transport (app.exchange.codec): a typed JSON header and raw tensor
buffers, rebuilt only as the JSON kinds and the wire's own types; nothing is unpickled."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch

from app.exchange import codec
from app.exchange.segment import Offer
from app.exchange.wire import InSlot, Joined, Progress, Push, Refusal, Refused, Reply, Share, SlotReply


def round_trip(value):
    frames = codec.pack({"k": "r", "i": 7}, value)
    # as they arrive: each frame its own bytes, none shared with the sender's tensors
    header, got = codec.unpack([bytes(f) for f in frames])
    assert header["k"] == "r" and header["i"] == 7
    return got


def test_every_wire_type_comes_back_equal_and_of_its_type():
    vector = torch.arange(12, dtype=torch.float32)
    joined = Joined(vector, 3, Progress(2, 5, 40), Offer("/dev/shm/x.shm", "ab", 12, ("reply1.0", "slot1")), (0, 6))
    got = round_trip((joined, [Push(1, "worker1", 3, samples=32, finite=True), None], {"share": Share(2, 1, 3)}))
    assert type(got) is tuple and type(got[0]) is Joined and type(got[0].progress) is Progress
    assert torch.equal(got[0].vector, vector) and got[0].exchange == joined.exchange and got[0].part == (0, 6)
    assert got[1] == [Push(1, "worker1", 3, samples=32, finite=True), None]
    assert got[2] == {"share": Share(2, 1, 3)}
    refusal = round_trip(Refusal(Refused.STALE, "worker1_r2 replaced it"))
    assert refusal.kind is Refused.STALE
    assert round_trip(InSlot(1, "bfloat16", 99)) == InSlot(1, "bfloat16", 99)
    assert round_trip(SlotReply("reply1.0", 4, 1, 0)) == SlotReply("reply1.0", 4, 1, 0)
    assert round_trip(Reply(torch.zeros(0), (1, 2), 0, 0)).version == (1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool])
def test_a_tensor_travels_as_its_raw_bytes_in_a_frame_of_its_own(dtype):
    tensor = (torch.arange(24).reshape(2, 3, 4) % 5).to(dtype)
    frames = codec.pack({"k": "c", "i": 1}, (tensor,))
    assert len(frames) == 2 and bytes(frames[1]) == tensor.view(torch.uint8).numpy().tobytes()
    assert b"%s" % str(dtype).removeprefix("torch.").encode() in frames[0]
    got = codec.unpack([frames[0], bytearray(frames[1])])[1][0]
    assert got.dtype == dtype and got.shape == (2, 3, 4) and torch.equal(got, tensor)


@pytest.mark.parametrize("size", [1 << 20, 3 * (1 << 20) + 12, 40 * (1 << 20) + 4])
def test_over_an_encrypted_link_a_large_tensor_travels_in_frames_of_about_the_chunk(size):
    tensor = torch.randn(size // 4)
    chunk = 1 << 20
    frames = codec.pack({"k": "c", "i": 1}, (tensor, torch.ones(3)), chunk=chunk)
    parts = frames[1:-1]
    expected = 1 if size <= chunk else min(codec.CHUNKS, -(-size // chunk))
    assert len(parts) == expected
    assert b"".join(bytes(f) for f in parts) == tensor.numpy().tobytes()  # in order, every byte once
    got = codec.unpack([frames[0], *(bytearray(f) for f in frames[1:])])[1]
    assert torch.equal(got[0], tensor) and torch.equal(got[1], torch.ones(3))
    assert len(codec.pack({"k": "c", "i": 1}, (tensor,))) == 2  # no chunk: one frame, whatever its size


def test_a_tensors_frames_must_add_up_to_its_shape():
    header = json.dumps({"k": "r", "i": 1, "v": {"x": 0, "c": 2, "d": "float32", "s": [3]}}).encode()
    with pytest.raises(codec.Malformed, match="in 16 bytes"):
        codec.unpack([header, b"\0" * 8, b"\0" * 8])
    assert codec.unpack([header, b"\0" * 8, b"\0" * 4])[1].tolist() == [0.0, 0.0, 0.0]


def test_a_received_tensor_is_a_view_of_its_frame_not_a_copy():
    frame = bytearray(torch.ones(4).numpy().tobytes())
    header = json.dumps({"k": "r", "i": 1, "v": {"x": 0, "d": "float32", "s": [4]}}).encode()
    got = codec.unpack([header, memoryview(frame)])[1]
    frame[0:4] = torch.tensor([5.0]).numpy().tobytes()
    assert got[0].item() == 5.0


def test_a_pickle_is_not_a_message():
    payload = pickle.dumps(("os", "system", "id"))
    with pytest.raises(codec.Malformed, match="not JSON"):
        codec.unpack([payload])


@pytest.mark.parametrize(
    "value,why",
    [
        ({"n": "Popen", "v": ["id"]}, "not a type this transport sends"),
        ({"n": "__main__.Push", "v": []}, "not a type"),
        ({"n": "Push", "v": []}, "Push with 0 fields"),
        ({"n": "Push", "v": list(range(40))}, "Push with 40 fields"),
        ({"e": "Refused", "v": "rm -rf"}, "not a Refused"),
        ({"e": "Push", "v": 1}, "not an enumeration"),
        ({"x": 3, "d": "float32", "s": [1]}, "frame 3"),
        ({"x": 0, "d": "object", "s": [1]}, "dtype 'object'"),
        ({"x": 0, "d": "float32", "s": [1000]}, "in 4 bytes"),
        ({"x": 0, "d": "float32", "s": [-1]}, "shape"),
        ({"x": 0, "c": 2, "d": "float32", "s": [1]}, "frame 0 \\(2 frames\\) of 1"),
        ({"x": 0, "c": 0, "d": "float32", "s": [1]}, "0 frames"),
        ({"x": 0, "c": True, "d": "float32", "s": [1]}, "frame 0"),
        ({"y": 1}, "keys"),
        ([1, 2], "a list where a tagged value belongs"),
    ],
)
def test_what_is_not_a_value_of_this_transport_is_malformed(value, why):
    header = json.dumps({"k": "r", "i": 1, "v": value}).encode()
    with pytest.raises(codec.Malformed, match=why):
        codec.unpack([header, b"\0\0\0\0"])


def test_random_bytes_and_oversized_or_nested_headers_are_malformed():
    with pytest.raises(codec.Malformed):
        codec.unpack([os.urandom(256 * 1024)])
    with pytest.raises(codec.Malformed, match="a header of"):
        codec.unpack([b" " * (codec.MAX_HEADER_BYTES + 1)])
    deep: object = 1
    for _ in range(codec.MAX_DEPTH + 2):
        deep = {"t": [deep]}
    with pytest.raises(codec.Malformed, match="nested too deep"):
        codec.unpack([json.dumps({"v": deep}).encode()])
    with pytest.raises(codec.Malformed, match="frames"):
        codec.unpack([b"{}"] * (codec.MAX_FRAMES + 2))


def test_only_the_transports_own_values_are_sent():
    for value in (object(), {1: 2}, torch.zeros(2, dtype=torch.complex64), lambda: 0):
        with pytest.raises(TypeError, match="not a value this transport sends|not a type"):
            codec.pack({"k": "c", "i": 1}, value)
