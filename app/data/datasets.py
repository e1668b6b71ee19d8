"""Datasets by name, each with a held-out split for the PS, and per-worker shards.

Nothing is downloaded: mnist, cifar10, digits and synthetic are read into one tensor
(app/data/builtin.py), imagefolder reads an image tree (app/data/imagefolder.py, its cache
app/data/imagecache.py), stdlib_text is Python's own standard library source, read as
characters (app/data/text.py), webdataset is a stream of tar shards from a pattern, a URL or a
path (app/data/tarshards.py), and your own comes from its factory (app/plugins.py); a stream
(an IterableDataset: webdataset's, or your own) is split by app/data/streams.py.
Held-out splits are fixed (they do not depend on --seed), so accuracies of
different runs compare.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sized
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler, IterableDataset, Sampler

from app import plugins
from app.config import Config, UsageError
from app.contract import DATASETS
from app.data import builtin, host, location, streams, tarshards, text
from app.data.imagefolder import CROP, ImageFolderData, find_samples
from app.data.prefetch import ReceivedAhead, wants_thread

SPLITS = ("train", "test")
FILE_DATASETS = ("imagefolder", "mnist", "cifar10", "webdataset")  # webdataset: a pattern of shards
# InMemoryData, TextWindows: no decoding to spread over processes
IN_MEMORY = ("mnist", "cifar10", "digits", "synthetic", "stdlib_text")

log = logging.getLogger(__name__)


class DataUnavailable(RuntimeError):
    """Reading the data failed mid-run (the data directory vanished, a file went bad)."""


def batches(loader: DataLoader, data_dir: str) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """One epoch of `loader`'s batches; a read that fails mid-run is one clear error. Batches
    from loader processes are received one ahead, in a thread (app.data.prefetch)."""
    iterator: Iterator[tuple[torch.Tensor, torch.Tensor]] = iter(loader)
    ahead = ReceivedAhead(iterator) if wants_thread(loader) else None
    try:
        while True:
            try:
                yield next(ahead if ahead is not None else iterator)
            except StopIteration:
                return
            except OSError as error:
                raise DataUnavailable(f"reading the data under {data_dir} failed (did it vanish?): {error}") from error
    finally:
        if ahead is not None:
            ahead.close()


@dataclass(frozen=True)
class LabeledData:
    """One split of a dataset, and what a model needs to know about it."""

    data: Dataset
    channels: int
    num_classes: int
    sharded: bool = False  # `data` holds one worker's shard only (`stable_shard`), not the split

    @property
    def stream(self) -> bool:
        """The data is read as one pass (app/data/streams.py), not indexed."""
        return isinstance(self.data, streams.Stream)


def check_data_dir(dataset: str, data_dir: str) -> None:
    """UsageError naming the path when a file dataset's directory is missing or empty."""
    if plugins.is_entry_point(dataset):
        return  # the user's factory reads (or ignores) its root itself
    if dataset not in DATASETS:
        raise UsageError(f"unknown dataset {dataset!r}; datasets that exist: {', '.join(DATASETS)}")
    if dataset not in FILE_DATASETS:
        return
    location.check("data_dir", data_dir)
    if dataset in tarshards.DATASETS:
        return  # a pattern of shards, each checked as it is named (app.data.tarshards.load)
    if location.is_url(data_dir):
        raise UsageError(
            f"--data_dir {data_dir}: dataset {dataset} reads a local directory; "
            "a URL is read by webdataset or by your own dataset"
        )
    path = Path(data_dir)
    if not path.is_dir():
        raise UsageError(f"data dir not found: {data_dir}")
    if not any(path.iterdir()):
        raise UsageError(f"data dir is empty: {data_dir}")


def load(
    dataset: str,
    data_dir: str,
    split: str,
    seed: int,
    image_size: int = CROP,
    image_cache: str | bool = "off",
    shard: tuple[int, int] | None = None,
    cache_dir: str = "./cache",
    threads: int = 1,
    pad: bool = False,
    follow: bool = False,
    eval_data: str = "",
) -> LabeledData:
    """The `train` split (workers shard it) or the held-out `test` split (the PS's).
    `image_size`: the crop side of imagefolder's images (the others have their own size);
    `image_cache`: off | memory | file | auto (True/False: memory/off): imagefolder
    decodes each file once into uint8 (app/data/imagecache.py), in /dev/shm or in
    a file under `cache_dir` (decoded with `threads` threads);
    `shard`: (index, count) of a worker's shard: with the cache on, the data holds
    only that shard's samples (`stable_shard`, `pad`ded to equal sizes) and says so (`sharded`);
    `follow` (a job that may be scaled): the file cache holds the whole split instead;
    `eval_data`: webdataset's held-out shards (its `train` ones are `data_dir`'s)."""
    check_data_dir(dataset, data_dir)
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, not {split!r}")
    if dataset in tarshards.DATASETS:
        return _webdataset(data_dir, eval_data, split == "train", image_size, seed)
    if plugins.is_entry_point(dataset):
        location.check("data_dir", data_dir)
        got = plugins.load_dataset(dataset, data_dir, split == "train", seed)
        if isinstance(got.data, IterableDataset):
            return LabeledData(streams.EveryNth(got.data, seed), got.channels, got.num_classes)
        return LabeledData(got.data, got.channels, got.num_classes)
    if dataset == "imagefolder":
        mode = image_cache if isinstance(image_cache, str) else ("memory" if image_cache else "off")
        return _imagefolder(
            Path(data_dir),
            split == "train",
            image_size,
            ImageCacheSettings(str(mode), cache_dir, shard, seed, threads, pad, follow),
        )
    if dataset == "stdlib_text":
        return LabeledData(text.load(split == "train"), 1, text.NUM_CLASSES)
    return LabeledData(*builtin.read(dataset, Path(data_dir), split == "train", seed))


def _webdataset(data_dir: str, eval_data: str, train: bool, crop: int, seed: int) -> LabeledData:
    """webdataset's training shards (data_dir) or held-out ones (eval_data); its classes are counted
    from the held-out shards (app/data/tarshards.py)."""
    classes = tarshards.count_classes(eval_data, "eval_data")
    flag, pattern = ("data_dir", data_dir) if train else ("eval_data", eval_data)
    return LabeledData(tarshards.load(pattern, flag, train, crop, seed), 3, classes)


@dataclass(frozen=True)
class ImageCacheSettings:
    """How imagefolder caches: `mode` (off | memory | file | auto), the file cache's
    directory, the worker's shard (index, count) or None (the whole split), the shard's
    seed, the file cache's decoding threads, whether shards are padded to one size, and
    whether the file cache holds the whole split for a job that may be scaled (`follow`)."""

    mode: str = "off"
    directory: str = "./cache"
    shard: tuple[int, int] | None = None
    seed: int = 0
    threads: int = 1
    pad: bool = False
    follow: bool = False  # the job may be scaled: a worker's share of each epoch follows the live set


def stable_shard(size: int, num_shards: int, shard: int, seed: int = 0, pad: bool = False) -> list[int]:
    """Shard `shard`'s indices of 0..size-1, in increasing order: the same every epoch (one
    permutation of `seed`, not of the epoch), disjoint, together all of them, sizes
    differing by at most one. With the image cache a worker keeps its shard, so it
    decodes and holds ~1/num_shards of the images once; ShardSampler(len, 1, 0) then
    shuffles within it each epoch. `pad` (DDP: every rank must take as many steps): the
    permutation is extended by its own start, as DistributedSampler pads, so every
    shard has ceil(size / num_shards) indices (one may repeat another shard's).

    Membership: the shard depends on (size, num_shards, shard, seed) only. A worker that
    leaves and comes back (same rank, same world size) gets the same shard, and the file
    cache it wrote; a run with another number of workers repartitions: every rank gets a
    new shard (a new file cache key: decoded again, the old files stay). While a rank is
    away its shard is not trained on (without the cache, a different 1/num_shards of
    each epoch is missed instead)."""
    if not 0 <= shard < num_shards:
        raise ValueError(f"shard {shard} not in 0..{num_shards - 1}")
    if size < 1:
        raise ValueError("no samples to shard")
    order = torch.randperm(size, generator=torch.Generator().manual_seed(seed))
    if pad:  # as DistributedSampler: repeated (more than once when size < num_shards) up to a multiple
        total = -(-size // num_shards) * num_shards
        order = order.repeat(-(-total // size))[:total]
    return sorted(order[shard::num_shards].tolist())


def _imagefolder(root: Path, train: bool, crop: int, cache: ImageCacheSettings = ImageCacheSettings()) -> LabeledData:
    """Imagenette's layout (`train/` and `val/`, each of class folders): workers read
    train/, the PS evaluates on val/. Class folders directly under the root: 10% of
    the images, fixed, are held out. `cache`: decoded once into uint8 (app/data/imagecache.py)."""
    if (root / "train").is_dir() and (root / "val").is_dir():
        classes, chosen = find_samples(root / "train")
        if not train:
            val_classes, chosen = find_samples(root / "val")
            if val_classes != classes:
                raise UsageError(
                    f"{root}: val/ has classes {val_classes[:5]}..., train/ has {classes[:5]}...; "
                    "both must hold the same class folders"
                )
    else:
        classes, samples = find_samples(root)
        held_out = builtin.held_out_mask(len(samples), 0.1)
        chosen = [s for s, out in zip(samples, held_out.tolist()) if out != train]
    if cache.mode == "off":
        return LabeledData(ImageFolderData(chosen, train, crop), 3, len(classes))
    data, sharded = _cached(chosen, train, crop, cache)
    if data is None:
        return LabeledData(ImageFolderData(chosen, train, crop), 3, len(classes))
    return LabeledData(data, 3, len(classes), sharded=sharded)


def _cached(
    chosen: list[tuple[str, int]], train: bool, crop: int, cache: ImageCacheSettings
) -> tuple[Dataset | None, bool]:
    """(the image cache of `chosen`, or of this worker's stable shard of it; whether it holds
    the shard only), or (None, False) when `auto` chose off. `auto` chooses and reserves its
    /dev/shm under a lock that every process on that /dev/shm takes, one at a time, so each
    sees the others' reservations.
    In a job that may be scaled (`follow`) the file cache holds the whole split, one file
    every worker maps, so that each epoch's share can follow the live set."""
    from app.data import imagecache, store

    mine = chosen
    if cache.shard is not None:
        index, count = cache.shard
        mine = [chosen[i] for i in stable_shard(len(chosen), count, index, cache.seed, cache.pad)]
    with store.shm_choice(cache.mode):
        mode, why = store.choose_mode(
            cache.mode, store.cache_bytes(len(mine), crop), host.shm_free(), host.memory_available()
        )
        if mode == "file" and cache.follow:
            mine = chosen
            why += "; the whole split, shared: the job may be scaled, each epoch's share follows the live set"
        crops = (
            "training crops from the centre square"
            if mode != "off"
            else "decoded every epoch, crops from the whole resized image"
        )
        log.info("image cache %s for %d images (%s); %s", mode, len(mine), why, crops)
        if mode == "memory":  # its /dev/shm reserved now, before the next process measures
            return imagecache.CachedImageFolder(mine, train, crop=crop, threads=cache.threads), mine is not chosen
    if mode == "off":
        return None, False
    try:
        data = imagecache.CachedImageFolder(mine, train, crop=crop, cache_dir=cache.directory, threads=cache.threads)
    except imagecache.NoRoom as error:  # a full volume is a warning: the images are decoded as they come
        log.warning("image cache: %s; decoding the images every epoch instead (free space there for the cache)", error)
        return None, False
    return data, mine is not chosen


def to_device(x: torch.Tensor, dataset: Dataset | None, device: torch.device) -> torch.Tensor:
    """A batch's input on `device`, turned into the model's input there when the dataset
    hands over raw uint8 (CachedImageFolder.on_device: crop, flip, normalise)."""
    x = x.to(device, non_blocking=True)
    prepare = getattr(dataset, "on_device", None)
    return prepare(x) if prepare is not None else x


class ShardSampler(Sampler[int]):
    """This worker's disjoint share of one permutation per epoch (DistributedSampler
    without the padding: shards differ by at most one sample, and together they
    cover the data exactly once)."""

    def __init__(self, size: int, num_shards: int, shard: int, seed: int = 0, shuffle: bool = True) -> None:
        if not 0 <= shard < num_shards:
            raise ValueError(f"shard {shard} not in 0..{num_shards - 1}")
        self.size, self.num_shards, self.shard = size, num_shards, shard
        self.seed, self.shuffle, self.epoch, self.skip = seed, shuffle, 0, 0
        self.fixed = False  # the data is this worker's stable shard: its share cannot follow the live set

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        """Shuffle for `epoch`; leave out its first `skip` samples (already trained on)."""
        self.epoch, self.skip = epoch, skip

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.size, generator=g)
        else:
            order = torch.arange(self.size)
        return iter(order[self.shard :: self.num_shards][self.skip :].tolist())

    def __len__(self) -> int:
        return len(range(self.shard, self.size, self.num_shards))


def shard_sampler(
    train: LabeledData, num_shards: int, shard: int, seed: int, batch_size: int = 1
) -> ShardSampler | streams.StreamSampler:
    """The sampler of worker `shard`'s share: a permutation of the whole split per epoch
    (ShardSampler), or, when the data holds the worker's stable shard already (the image
    cache), a permutation of that shard per epoch; a stream's share, handed to the stream
    (streams.StreamSampler)."""
    if isinstance(train.data, streams.Stream):
        return streams.StreamSampler(train.data, num_shards, shard, batch_size)
    if train.sharded:
        sampler = ShardSampler(size_of(train.data), 1, 0, seed)
        sampler.fixed = True
        return sampler
    return ShardSampler(size_of(train.data), num_shards, shard, seed)


def train_loader(
    data: Dataset,
    sampler: ShardSampler | DistributedSampler | streams.StreamSampler,
    batch_size: int,
    loader_workers: int,
    pin_memory: bool,
) -> DataLoader:
    """Batches of this worker's shard (its ShardSampler, or the allreduce job's DistributedSampler);
    the last short batch is dropped when the shard holds at least one full batch (BatchNorm
    cannot train on a batch of one). A stream's: every sample of its share, in the batches its
    loader processes make."""
    if isinstance(sampler, streams.StreamSampler):
        return stream_loader(data, batch_size, loader_workers, pin_memory)
    drop_last = len(sampler) >= batch_size
    return _loader(data, sampler, batch_size, drop_last, loader_workers, pin_memory)


def eval_loader(data: Dataset, batch_size: int, loader_workers: int) -> DataLoader:
    if isinstance(data, streams.Stream):
        data.place(0, 1, epoch=0)
        return stream_loader(data, batch_size, loader_workers, False)
    sampler = ShardSampler(size_of(data), 1, 0, shuffle=False)
    return _loader(data, sampler, batch_size, False, loader_workers, False)


def stream_loader(data: Dataset, batch_size: int, loader_workers: int, pin_memory: bool) -> DataLoader:
    """A stream's batches; its loader processes start again each epoch (not persistent), so each
    takes the share the stream was `place`d at for it."""
    return DataLoader(data, batch_size=batch_size, num_workers=loader_workers, pin_memory=pin_memory)


def _loader(
    data: Dataset, sampler: Sampler[int], batch_size: int, drop_last: bool, loader_workers: int, pin_memory: bool
) -> DataLoader:
    persistent = loader_workers > 0
    # one indexing op a batch
    if isinstance(data, (builtin.InMemoryData, text.TextWindows)) or hasattr(data, "on_device"):
        batches = BatchSampler(sampler, batch_size, drop_last)
        return DataLoader(
            data,
            sampler=batches,
            batch_size=None,
            num_workers=loader_workers,
            pin_memory=pin_memory,
            persistent_workers=persistent,
        )
    return DataLoader(
        data,
        batch_size=batch_size,
        sampler=sampler,
        drop_last=drop_last,
        num_workers=loader_workers,
        pin_memory=pin_memory,
        persistent_workers=persistent,
    )


def skipped(dataset: Dataset) -> dict[str, int]:
    """`{"skipped_images": n}` for a dataset that skips undecodable files (imagefolder), else {}:
    the field of the metrics records that counts them."""
    count = getattr(dataset, "skipped_images", None)
    return {} if count is None else {"skipped_images": int(count)}


def loader_choice(config: Config) -> tuple[int, str]:
    """(DataLoader processes, why) for --loader_workers (a number, or auto from the host's
    CPUs: app.data.host; auto is 0 for the datasets held in one tensor, whose batches
    are one indexing op)."""
    if config.loader_workers == "auto" and config.dataset in IN_MEMORY:
        return 0, f"auto: {config.dataset} is held in memory, a batch is one indexing op"
    return host.loader_workers(config.loader_workers, config.host_workers)


def log_loader(name: str, workers: int, why: str) -> None:
    """The one line saying how many DataLoader processes `name` runs and why; logged once
    the data has loaded, so bad input stays the only line on stderr."""
    log.info("%s: %d DataLoader process(es) (%s)", name, workers, why)


def test_split(config: Config) -> LabeledData | None:
    """The dataset's test split, where it gives one (a factory that takes `split`:
    app.plugins.load_test_split); the PS scores the final model on it once. None without one."""
    if not plugins.is_entry_point(config.dataset):
        return None
    got = plugins.load_test_split(config.dataset, config.data_dir, config.seed)
    if got is None:
        return None
    data = streams.EveryNth(got.data, config.seed) if isinstance(got.data, IterableDataset) else got.data
    return LabeledData(data, got.channels, got.num_classes)


def load_for(
    config: Config, split: str, loader_workers: int, shard: tuple[int, int] | None = None, pad: bool = False
) -> LabeledData:
    """`load` with the process's flags: the image cache in --cache_dir, decoded by the
    CPUs the process took (its loader processes and itself); a worker's share follows the
    live set when the job may be scaled (--max_workers above the workers)."""
    return load(
        config.dataset,
        config.data_dir,
        split,
        config.seed,
        config.image_size,
        config.image_cache,
        shard=shard,
        cache_dir=config.cache_dir,
        threads=loader_workers + 1,
        pad=pad,
        follow=shard is not None and config.max_trainers > config.num_trainers,
        eval_data=config.eval_data,
    )


def describe(data: LabeledData) -> str:
    size = streams.declared_length(data.data)
    if not data.stream:
        samples = f"{size} samples"
    else:
        samples = "a stream of no declared length" if size is None else f"a stream of {size} samples"
    return f"{samples}, {data.channels} channel(s), {data.num_classes} classes"


def share_size(sampler: ShardSampler | streams.StreamSampler) -> str:
    """A worker's share, in words: its samples, where they can be counted."""
    size = streams.declared_length(sampler)
    return "a share of a stream" if size is None else f"shard of {size} samples"


def plan_problem(data: LabeledData, max_steps: int, strategy: str) -> str | None:
    """Why a stream cannot train as asked (one line), or None: a run is planned from an epoch's
    length or --max_steps, and DDP's ranks must take as many steps each."""
    if not data.stream:
        return None
    if strategy == "allreduce":
        return "strategy allreduce needs a map-style dataset (its ranks take as many steps each); a stream is not one"
    if max_steps == 0 and streams.declared_length(data.data) is None:
        return (
            "the training dataset is a stream with no declared length: give it a __len__ (its samples a pass) "
            "or give --max_steps (train.max_steps), which plan the run"
        )
    return None


def size_of(data: Dataset) -> int:
    """len(data): torch's Dataset declares no __len__, though every dataset the app trains on has one."""
    if not isinstance(data, Sized):
        raise TypeError(f"the dataset {type(data).__name__} has no len()")
    return len(data)
