"""The data pipeline's choices: loader processes from the host's CPUs, one stable cached
shard per worker, the file cache on the state volume, and the `auto` cache mode."""

from __future__ import annotations

import logging
import os
import pickle
import threading
from pathlib import Path

import pytest
import torch
from PIL import Image

from app.config import UsageError, parse
from app.data import datasets, decode, host, imagecache, store
from app.data.imagecache import CachedImageFolder
from app.data.store import choose_mode
from app.data.imagefolder import ImageFolderData, find_samples
from needs import unavailable

SIZE = 16  # crop; decoded at 18 px


def _tree(root: Path, per_class: int = 10, classes: int = 2) -> Path:
    g = torch.Generator().manual_seed(0)
    for c in range(classes):
        (root / f"c{c}").mkdir(parents=True)
        for i in range(per_class):
            pixels = torch.randint(0, 256, (30, 26, 3), generator=g, dtype=torch.uint8).numpy()
            Image.fromarray(pixels).save(root / f"c{c}" / f"{i:02d}.png")
    return root


@pytest.fixture
def decodes(monkeypatch) -> list[str]:
    """Every path imagecache decodes (from any thread), in call order."""
    calls: list[str] = []
    lock = threading.Lock()
    real = decode.decode

    def counting(path: str, size: int = decode.RESIZE) -> torch.Tensor:
        with lock:
            calls.append(path)
        return real(path, size)

    monkeypatch.setattr(imagecache, "decode", counting)  # the memory cache's fill
    monkeypatch.setattr(decode, "decode", counting)  # the file cache's one pass
    return calls


# --- loader processes: auto --------------------------------------------------------------


@pytest.mark.parametrize(
    ("affinity", "quota", "workers", "expected"),
    [
        (2, None, 2, 0),  # the 2-core CI host with 2 workers: load in the training process, as before
        (2, None, 1, 1),
        (16, None, 2, 7),
        (16, 4.0, 1, 3),  # docker run --cpus 4 on a 16-core host
        (16, 2.5, 1, 1),  # a fractional quota counts whole CPUs
        (64, None, 1, 8),  # capped
        (1, None, 3, 0),  # never below 0
        (8, 0.5, 1, 0),
    ],
)
def test_auto_loader_workers_share_the_cpus_among_the_hosts_workers(affinity, quota, workers, expected):
    chosen, why = host.auto_loader_workers(affinity, quota, workers)
    assert chosen == expected
    assert f"affinity {affinity}" in why and f"/ {workers} worker(s)" in why
    assert ("cgroup quota" in why) == (quota is not None)


@pytest.mark.parametrize("controller", ["cpu", "cpu,cpuacct"])
def test_cpu_quota_is_read_from_cgroup_v1_files_too(tmp_path, controller):
    """A cgroup v1 host (no cpu.max): cpu.cfs_quota_us / cpu.cfs_period_us; -1 is no limit."""
    d = tmp_path / controller
    d.mkdir()
    (d / "cpu.cfs_period_us").write_text("100000\n")
    (d / "cpu.cfs_quota_us").write_text("150000\n")
    assert host.cpu_quota(tmp_path) == 1.5
    assert host.usable_cpus(8, host.cpu_quota(tmp_path)) == 1
    (d / "cpu.cfs_quota_us").write_text("-1\n")
    assert host.cpu_quota(tmp_path) is None


def test_cpu_quota_and_memory_are_read_from_cgroup_v2_files(tmp_path):
    assert host.cpu_quota(tmp_path) is None  # no cgroup v2
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert host.cpu_quota(tmp_path) is None
    (tmp_path / "cpu.max").write_text("250000 100000\n")
    assert host.cpu_quota(tmp_path) == 2.5
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 8000000 kB\nMemAvailable: 4000000 kB\n")
    assert host.memory_available(meminfo, tmp_path) == 4000000 * 1024
    (tmp_path / "memory.max").write_text("3000000000\n")
    (tmp_path / "memory.current").write_text("1000000000\n")
    assert host.memory_available(meminfo, tmp_path) == 2000000000


def test_loader_workers_flag_takes_auto_or_a_number():
    assert parse(["worker"], {}).loader_workers == "auto"
    assert parse(["worker", "--loader_workers", "3"], {}).loader_workers == 3
    assert host.loader_workers("3", 4) == (3, "set by --loader_workers")
    for bad in ("-1", "many", "1.5"):
        with pytest.raises(UsageError, match=rf"^--loader_workers: '{bad}' is not auto or a whole number >= 0$"):
            parse(["worker", "--loader_workers", bad], {})


def test_auto_is_no_loader_process_for_data_held_in_memory(caplog):
    config = parse(["worker", "--dataset", "digits", "--host_workers", "1"], {})
    with caplog.at_level(logging.INFO, logger="app.data.datasets"):
        workers, why = datasets.loader_choice(config)
        datasets.log_loader("worker1", workers, why)
    assert workers == 0
    assert "worker1: 0 DataLoader process(es) (auto: digits is held in memory" in caplog.text


# --- the image cache flag ----------------------------------------------------------------


def test_image_cache_takes_its_modes_and_the_old_booleans():
    assert parse(["worker"], {}).image_cache == "auto"
    assert parse(["worker", "--image_cache", "true"], {}).image_cache == "memory"
    assert parse(["worker"], {"PSC_IMAGE_CACHE": "false"}).image_cache == "off"
    assert parse(["worker", "--image_cache", "file"], {}).image_cache == "file"
    with pytest.raises(UsageError, match="^--image_cache: 'disk' is not one of auto, off, memory, file$"):
        parse(["worker", "--image_cache", "disk"], {})


def test_auto_is_memory_when_it_fits_in_half_the_free_shm_and_memory():
    gib = 2**30
    assert choose_mode("auto", gib, 4 * gib, 8 * gib)[0] == "memory"
    assert choose_mode("auto", gib, None, None)[0] == "memory"  # a host that does not say
    mode, why = choose_mode("auto", 3 * gib, 4 * gib, 64 * gib)
    assert mode == "off" and "/dev/shm" in why and "shm_size" in why and "train.image_cache: file" in why
    mode, why = choose_mode("auto", 3 * gib, 64 * gib, 4 * gib)
    assert mode == "off" and "available memory" in why
    assert choose_mode("file", 100 * gib, gib, gib)[0] == "file"  # an explicit mode is kept


# --- one stable shard per worker ---------------------------------------------------------


def test_stable_shards_are_disjoint_cover_everything_and_do_not_depend_on_the_epoch():
    shards = [datasets.stable_shard(23, 3, s, seed=5) for s in range(3)]
    assert sorted(i for shard in shards for i in shard) == list(range(23))
    assert sorted(len(s) for s in shards) == [7, 8, 8]
    assert shards[1] == datasets.stable_shard(23, 3, 1, seed=5)
    padded = [datasets.stable_shard(23, 3, s, seed=5, pad=True) for s in range(3)]
    assert [len(s) for s in padded] == [8, 8, 8] and set().union(*map(set, padded)) == set(range(23))


@pytest.mark.parametrize("size,ranks", [(3, 8), (1, 4), (5, 5), (7, 3), (2, 3)])
def test_padded_shards_are_never_empty_even_with_fewer_samples_than_ranks(size, ranks):
    """Under allreduce every rank must take as many steps: ceil(size / ranks) indices each,
    every sample in some shard (3 samples on 8 ranks gave shards 6 and 7 nothing)."""
    padded = [datasets.stable_shard(size, ranks, s, seed=1, pad=True) for s in range(ranks)]
    assert [len(s) for s in padded] == [-(-size // ranks)] * ranks
    assert set().union(*map(set, padded)) == set(range(size))
    with pytest.raises(ValueError, match="no samples"):
        datasets.stable_shard(0, ranks, 0, pad=True)


def test_with_the_cache_a_worker_keeps_its_shard_every_epoch_and_holds_only_it(tmp_path):
    root = _tree(tmp_path / "data")
    whole = datasets.load("imagefolder", str(root), "train", 0, SIZE)
    shard = datasets.load("imagefolder", str(root), "train", 0, SIZE, "memory", shard=(1, 3))
    n = len(whole.data)
    assert shard.sharded and len(shard.data) in (n // 3, n // 3 + 1)
    cache = shard.data
    assert cache.nbytes == len(cache) * 3 * 18 * 18  # allocated for the shard, not the split
    sampler = datasets.shard_sampler(shard, 3, 1, seed=0)
    epochs = []
    for epoch in (1, 2, 3):
        sampler.set_epoch(epoch)
        epochs.append(list(sampler))
    assert all(sorted(e) == list(range(len(cache))) for e in epochs)  # the whole shard every epoch
    assert epochs[0] != epochs[1]  # shuffled within it
    others = {
        p
        for r in (0, 2)
        for p, _ in datasets.load("imagefolder", str(root), "train", 0, SIZE, "memory", shard=(r, 3)).data.samples
    }
    assert not others & {p for p, _ in cache.samples}
    loader = datasets.train_loader(cache, sampler, 2, 0, pin_memory=False)
    for _ in loader:
        pass
    assert int(cache.filled.sum()) == len(cache)  # one epoch decoded the shard, nothing else


def test_without_the_cache_the_sampler_is_todays(tmp_path):
    root = _tree(tmp_path / "data")
    train = datasets.load("imagefolder", str(root), "train", 0, SIZE, "off", shard=(1, 3))
    assert isinstance(train.data, ImageFolderData) and not train.sharded
    sampler = datasets.shard_sampler(train, 3, 1, seed=0)
    today = datasets.ShardSampler(len(train.data), 3, 1, 0)
    for epoch in (1, 2):
        sampler.set_epoch(epoch)
        today.set_epoch(epoch)
        assert list(sampler) == list(today)


# --- the file cache ----------------------------------------------------------------------


def test_the_file_cache_is_written_once_and_mapped_by_the_next_process(tmp_path, decodes, caplog):
    root = _tree(tmp_path / "data")
    cache_dir = tmp_path / "state" / "cache"
    first = datasets.load(
        "imagefolder", str(root), "train", 0, SIZE, "file", shard=(0, 2), cache_dir=str(cache_dir), threads=2
    )
    n = len(first.data)
    assert sorted(decodes) == sorted(p for p, _ in first.data.samples)  # each file of the shard, once
    files = list(cache_dir.iterdir())
    assert [f.suffix for f in files] == [".u8"]  # no temporary file left
    decodes.clear()
    again = datasets.load("imagefolder", str(root), "train", 0, SIZE, "file", shard=(0, 2), cache_dir=str(cache_dir))
    assert decodes == []  # a restarted worker maps the file
    everything = list(range(n))
    assert torch.equal(first.data[everything][0], again.data[everything][0])
    assert torch.equal(first.data[everything][1], again.data[everything][1])
    spawned = pickle.loads(pickle.dumps(again.data))  # what a spawned loader process receives: it maps the file
    assert torch.equal(spawned[everything][0], again.data[everything][0])

    changed = Path(first.data.samples[0][0])
    Image.new("RGB", (40, 30), (9, 9, 9)).save(changed)  # new size and mtime
    with caplog.at_level(logging.INFO, logger="app.data.imagecache"):
        datasets.load("imagefolder", str(root), "train", 0, SIZE, "file", shard=(0, 2), cache_dir=str(cache_dir))
    assert len(decodes) == n and len(list(cache_dir.iterdir())) == 2  # a new key; the old file stays ...
    assert "also holds 1 other cache file(s)" in caplog.text  # ... and the log says so
    decodes.clear()
    datasets.load("imagefolder", str(root), "train", 0, SIZE + 8, "file", shard=(0, 2), cache_dir=str(cache_dir))
    assert len(decodes) == n  # another size: another key


def test_the_file_cache_gives_a_bad_file_a_stand_in(tmp_path):
    root = _tree(tmp_path / "data", per_class=3)
    samples = find_samples(root)[1]
    Path(samples[1][0]).write_bytes(b"not a png")
    cached = CachedImageFolder(samples, train=False, crop=SIZE, cache_dir=tmp_path / "cache")
    x, y = cached[list(range(len(samples)))]
    assert cached.skipped_images == 1
    assert torch.equal(x[1], x[2]) and y[1] == y[2] == samples[2][1]


def test_the_held_out_set_is_cached_the_same_way_for_the_ps(tmp_path, decodes):
    root = _tree(tmp_path / "data")
    config = parse(
        [
            "ps",
            "--dataset",
            "imagefolder",
            "--data_dir",
            str(root),
            "--image_size",
            str(SIZE),
            "--image_cache",
            "file",
            "--cache_dir",
            str(tmp_path / "cache"),
        ],
        {},
    )
    held_out = datasets.load_for(config, "test", 0)
    assert isinstance(held_out.data, CachedImageFolder) and held_out.data.path is not None
    assert not held_out.sharded and len(decodes) == len(held_out.data) == 2  # 10% of 20
    decodes.clear()
    again = datasets.load_for(config, "test", 0)
    assert decodes == [] and again.data.path == held_out.data.path
    batches = list(datasets.eval_loader(again.data, 4, 0))
    assert sum(len(y) for _, y in batches) == 2 and batches[0][0].dtype == torch.uint8


def test_auto_caches_in_memory_where_it_fits(tmp_path):
    if host.shm_free() is not None and host.shm_free() < 2**20:
        unavailable("this host's /dev/shm is nearly full")
    root = _tree(tmp_path / "data")
    train = datasets.load("imagefolder", str(root), "train", 0, SIZE, "auto", shard=(0, 2))
    assert isinstance(train.data, CachedImageFolder) and train.data.path is None and train.sharded


def test_cache_files_are_named_by_the_file_list_and_the_size(tmp_path):
    samples = find_samples(_tree(tmp_path / "data", per_class=2))[1]
    key = store.cache_key(samples, 18)
    assert key == store.cache_key(list(samples), 18)
    assert key != store.cache_key(samples, 20)
    assert key != store.cache_key(samples[1:], 18)
    os.utime(samples[0][0], ns=(0, 10**9))
    assert key != store.cache_key(samples, 18)


def test_a_memory_cache_that_does_not_fit_in_shm_is_one_line_saying_what_to_set(tmp_path, monkeypatch):
    samples = find_samples(_tree(tmp_path / "data", per_class=2))[1]

    def full(nbytes: int) -> torch.UntypedStorage:
        raise RuntimeError("unable to allocate shared memory(shm) for file </torch_1>: No space left on device (28)")

    monkeypatch.setattr(torch.UntypedStorage, "_new_shared", full)
    with pytest.raises(UsageError) as error:
        CachedImageFolder(samples, train=True, crop=SIZE)
    message = str(error.value)
    assert "\n" not in message and message.startswith("--image_cache memory: cannot reserve 0.00 GiB in /dev/shm")
    assert "shm_size" in message and "file or auto" in message


# --- the file cache on a full disk, a damaged file, a writer that died ------------------

FULL_DISK = """
import logging, resource, signal, sys
from app.data import datasets
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(levelname)s %(name)s: %(message)s")
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit: EFBIG, as a full disk gives ENOSPC
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
got = datasets.load("imagefolder", sys.argv[1], "train", 0, 16, "file", shard=(0, 2), cache_dir=sys.argv[2])
x, y = got.data[0]
print("decoded", type(got.data).__name__, datasets.size_of(got.data), tuple(x.shape))
"""


def test_a_file_cache_that_does_not_fit_is_one_warning_and_the_images_are_decoded_as_they_come(tmp_path):
    """The file is reserved before it is mapped: no room is one line, not a SIGBUS (exit 135) on
    the first page written, and the temporary file goes. A full volume is no failure: it was
    exit 2 (`--image_cache file: cannot reserve`), and compose started the worker again and
    again; now the worker trains, decoding each image as it comes."""
    import subprocess
    import sys

    root = _tree(tmp_path / "data", per_class=20)
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    r = subprocess.run(
        [sys.executable, "-c", FULL_DISK, str(root), str(cache_dir)],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[3])),
        timeout=120,
    )
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)
    lines = [line for line in r.stdout.splitlines() if line.startswith("WARNING")]
    assert len(lines) == 1, r.stdout
    assert lines[0].startswith(
        f"WARNING app.data.datasets: image cache: no room for the 0.00 GiB cache file in {cache_dir}"
    )
    assert lines[0].endswith("; decoding the images every epoch instead (free space there for the cache)")
    assert "decoded ImageFolderData" in r.stdout and "(3, 16, 16)" in r.stdout, r.stdout
    assert list(cache_dir.iterdir()) == []


def test_a_damaged_cache_file_is_decoded_again_with_one_line(tmp_path, decodes, caplog):
    root = _tree(tmp_path / "data", per_class=3)
    samples = find_samples(root)[1]
    first = CachedImageFolder(samples, train=False, crop=SIZE, cache_dir=tmp_path / "cache")
    expected = first[list(range(len(samples)))][0].clone()
    first.path.write_bytes(b"")  # truncated: a disk that filled, a copy cut short
    decodes.clear()
    with caplog.at_level(logging.WARNING, logger="app.data.imagecache"):
        again = CachedImageFolder(samples, train=False, crop=SIZE, cache_dir=tmp_path / "cache")
    assert len(decodes) == len(samples)
    assert torch.equal(again[list(range(len(samples)))][0], expected)
    damaged = [r for r in caplog.records if "is damaged" in r.getMessage()]
    assert len(damaged) == 1 and "(0 bytes" in damaged[0].getMessage()


def test_a_temporary_file_nobody_writes_is_removed_and_a_live_writers_is_kept(tmp_path):
    import fcntl

    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    dead = cache_dir / ".images-16px-3-abc.u8.4242.tmp"
    dead.write_bytes(b"\0" * 100)
    live = cache_dir / ".images-16px-3-def.u8.4343.tmp"
    live.write_bytes(b"\0" * 100)
    fd = os.open(live, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a writer still at work
    try:
        assert store.remove_stale_temp_files(cache_dir) == [dead]
        assert not dead.exists() and live.exists()
    finally:
        os.close(fd)
    root = _tree(tmp_path / "data", per_class=3)
    CachedImageFolder(find_samples(root)[1], train=False, crop=SIZE, cache_dir=cache_dir)
    assert not live.exists() and [p.suffix for p in cache_dir.iterdir()] == [".u8"]


# --- a job that may be scaled: the file cache holds the whole split -----------------------


def test_a_scalable_jobs_file_cache_holds_the_whole_split_and_its_share_follows(tmp_path):
    """A rank added above the first ones got a stable shard of its own (1/3 of the images),
    whose sampler could not take the live set's share; `memory` keeps the stable shard."""
    root = _tree(tmp_path / "data", per_class=9)
    whole = datasets.load("imagefolder", str(root), "train", 0, SIZE, "file", cache_dir=str(tmp_path / "c"))
    got = datasets.load(
        "imagefolder", str(root), "train", 0, SIZE, "file", shard=(2, 3), cache_dir=str(tmp_path / "c"), follow=True
    )
    assert not got.sharded and len(got.data) == len(whole.data) and got.data.path == whole.data.path
    sampler = datasets.shard_sampler(got, 3, 2, 0)
    assert (sampler.num_shards, sampler.shard, sampler.fixed) == (3, 2, False)
    assert [p.name for p in (tmp_path / "c").iterdir()] == [whole.data.path.name]  # one file, no lock left
    memory = datasets.load("imagefolder", str(root), "train", 0, SIZE, "memory", shard=(2, 3), follow=True)
    assert memory.sharded and len(memory.data) == 5 and datasets.shard_sampler(memory, 3, 2, 0).fixed
