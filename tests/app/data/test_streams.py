"""Streams (app/data/streams.py), shard patterns and URLs (app/data/location.py) and tar shards
(app/data/tarshards.py): how a pass is split by rank and by DataLoader process, with real loader
processes and real tar files."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from app.config import UsageError
from app.data import datasets, location, streams, tarshards


class Numbers(IterableDataset):
    """0..size-1, as a user's stream would yield them (the whole pass each time)."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __iter__(self):
        for i in range(self.size):
            yield torch.tensor([float(i)]), i % 3


class Parts(streams.Stream):
    """A stream of parts, each part a range of numbers."""

    def read(self, part):
        for i in part:
            yield torch.tensor([float(i)]), 0


def seen(stream: streams.Stream, index: int, count: int, loaders: int, epoch: int = 1, skip: int = 0) -> list[int]:
    stream.place(index, count, epoch, skip, batch_size=4)
    loader = DataLoader(stream, batch_size=4, num_workers=loaders)
    return [int(v) for x, _ in loader for v in x.flatten().tolist()]


def test_brace_patterns_expand_as_bash_does():
    assert location.expand("data_dir", "s3://b/train-{000000..000002}.tar") == [
        "s3://b/train-000000.tar",
        "s3://b/train-000001.tar",
        "s3://b/train-000002.tar",
    ]
    assert location.expand("data_dir", "https://h/{a,b}-{0..1}.tar") == [
        "https://h/a-0.tar",
        "https://h/a-1.tar",
        "https://h/b-0.tar",
        "https://h/b-1.tar",
    ]
    assert location.expand("data_dir", "./one.tar") == ["./one.tar"]


def test_unbalanced_braces_are_one_line():
    with pytest.raises(UsageError) as error:
        location.expand("data_dir", "./train-{0..3.tar")
    assert str(error.value).startswith("--data_dir ./train-{0..3.tar: ") and "\n" not in str(error.value)


def test_a_url_of_another_scheme_is_one_line_naming_the_schemes_read():
    with pytest.raises(UsageError) as error:
        datasets.load("webdataset", "ftp://host/train-{0..1}.tar", "train", 0, eval_data="ftp://host/val.tar")
    assert str(error.value) == (
        "--data_dir ftp://host/train-{0..1}.tar: the app does not read ftp:// URLs; "
        "give http://, https://, s3:// or a local path"
    )


def test_a_directory_dataset_refuses_a_url_in_one_line():
    with pytest.raises(UsageError) as error:
        datasets.load("imagefolder", "https://host/imagenette", "train", 0)
    assert "dataset imagefolder reads a local directory" in str(error.value)


@pytest.mark.parametrize("loaders", [0, 2])
def test_a_stream_of_one_part_is_split_every_nth_sample_by_rank_and_loader_process(loaders):
    stream = streams.EveryNth(Numbers(50), seed=0)
    shares = [seen(stream, rank, 3, loaders) for rank in range(3)]
    assert sorted(sum(shares, [])) == list(range(50))  # each sample once in the epoch
    assert all(set(s) == set(range(rank, 50, 3)) for rank, s in enumerate(shares))


@pytest.mark.parametrize("loaders", [0, 2])
@pytest.mark.parametrize("ranks", [2, 3])
def test_parts_are_split_by_rank_then_by_loader_process_each_sample_once(loaders, ranks):
    parts = [range(k * 10, k * 10 + 10) for k in range(4)]  # 4 shards of 10 samples
    stream = Parts(parts, seed=5, shuffle=True)
    for epoch in (1, 2):
        shares = [seen(stream, rank, ranks, loaders, epoch) for rank in range(ranks)]
        assert sorted(sum(shares, [])) == list(range(40)), (epoch, shares)
        if ranks == 2:  # enough shards: a rank reads whole shards, 2 of the 4
            assert all(len({v // 10 for v in share}) == 2 for share in shares)


def test_a_resumed_share_skips_the_batches_its_loader_processes_made():
    stream = streams.EveryNth(Numbers(64), seed=0)
    whole = seen(stream, 0, 1, 2)
    assert sorted(seen(stream, 0, 1, 2, skip=3 * 4)) == sorted(whole[3 * 4 :])  # the rest, each once
    assert [streams.skipped_batches(3, 2, loader) for loader in (0, 1)] == [2, 1]


def test_a_stream_without_a_length_and_without_max_steps_is_one_line():
    data = datasets.LabeledData(streams.EveryNth(Numbers(10), 0), 1, 3)
    assert datasets.plan_problem(data, max_steps=0, strategy="async") == (
        "the training dataset is a stream with no declared length: give it a __len__ (its samples a pass) "
        "or give --max_steps (train.max_steps), which plan the run"
    )
    assert datasets.plan_problem(data, max_steps=10, strategy="async") is None
    assert "allreduce" in str(datasets.plan_problem(data, max_steps=10, strategy="allreduce"))


def _shard(path: Path, samples: list[tuple[str, bytes, str]]) -> None:
    with tarfile.open(path, "w") as tar:
        for key, image, label in samples:
            for name, data in ((f"{key}.png", image), (f"{key}.cls", label.encode())):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def _png(value: int) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("L", (8, 8), value).save(buffer, "PNG")
    return buffer.getvalue()


def test_a_tar_shard_gives_each_key_its_image_and_class(tmp_path):
    _shard(tmp_path / "s-0.tar", [("a/000", _png(10), "2"), ("a/001", _png(20), " 0\n")])
    assert [(key, label) for key, _, label in tarshards.labelled(str(tmp_path / "s-0.tar"))] == [
        ("a/000", 2),
        ("a/001", 0),
    ]
    _shard(tmp_path / "v-0.tar", [("k", _png(1), "6")])
    assert tarshards.count_classes(str(tmp_path / "v-{0..0}.tar"), "eval_data") == 7
    data = tarshards.load(str(tmp_path / "s-{0..0}.tar"), "data_dir", train=False, crop=8, seed=0)
    assert [(tuple(x.shape), y) for x, y in data] == [((3, 8, 8), 2), ((3, 8, 8), 0)]


def test_a_missing_local_shard_and_a_bad_class_are_one_line(tmp_path):
    _shard(tmp_path / "s-0.tar", [("k", _png(1), "cat")])
    with pytest.raises(UsageError, match=r"no shard at .*s-1.tar \(1 of 2 missing\)"):
        tarshards.load(str(tmp_path / "s-{0..1}.tar"), "data_dir", train=True, crop=8, seed=0)
    with pytest.raises(UsageError, match=r"k.cls holds b'cat'; must be a class index"):
        tarshards.count_classes(str(tmp_path / "s-0.tar"), "eval_data")


def test_a_stream_without_a_length_is_planned_by_max_steps():
    from app.recipes import planned_updates

    assert planned_updates("async", epochs=10, epoch_batches=0, workers=2, max_steps=50) == 100
    assert planned_updates("sync", epochs=10, epoch_batches=0, workers=2, max_steps=50) == 50
    assert planned_updates("async", epochs=10, epoch_batches=7, workers=2, max_steps=0) == 70  # a length plans it
