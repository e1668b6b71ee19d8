"""ImageFolder on real folders: Pillow's modes, undecodable files, empty classes, torchvision's order."""

from __future__ import annotations

import io
import logging
import re
from pathlib import Path

import pytest
import torch
from PIL import Image

from app.config import UsageError
from app.data import datasets
from app.data.imagefolder import MEAN, STD, ImageFolderData, find_samples, to_rgb
from app.training.metrics import read

from app_testkit import run_app, run_cluster

RED = (200, 30, 10)


def _rgb_of(x: torch.Tensor) -> tuple[int, ...]:
    """The colour of a normalised 3xHxW tensor of one colour, back in 0..255."""
    pixel = (x * STD + MEAN)[:, x.shape[1] // 2, x.shape[2] // 2] * 255
    return tuple(round(v) for v in pixel.tolist())


def _modes(root: Path) -> dict[str, tuple[int, int, int]]:
    """One file per Pillow mode under root/<mode>/, and the RGB each must decode to."""
    files: dict[str, tuple[Image.Image, str, tuple[int, int, int]]] = {
        "L": (Image.new("L", (20, 12), 90), "png", (90, 90, 90)),
        "LA-transparent": (Image.new("LA", (20, 12), (90, 0)), "png", (255, 255, 255)),
        "RGBA-opaque": (Image.new("RGBA", (20, 12), RED + (255,)), "png", RED),
        "RGBA-transparent": (Image.new("RGBA", (20, 12), RED + (0,)), "png", (255, 255, 255)),
        "P": (Image.new("RGB", (20, 12), RED).quantize(4), "png", RED),
        "CMYK-jpeg": (Image.new("CMYK", (20, 12), (255, 0, 0, 0)), "jpg", (0, 255, 255)),
        "CMYK-tiff": (Image.new("CMYK", (20, 12), (0, 255, 0, 0)), "tiff", (255, 0, 255)),
        "I16": (Image.new("I;16", (20, 12), 65535), "png", (255, 255, 255)),
    }
    palette = Image.new("P", (20, 12), 1)  # a palette image whose colour 1 is transparent
    palette.putpalette([0, 0, 0, *RED] + [0] * 762)
    files["P-transparent"] = (palette, "png", (255, 255, 255))
    expected = {}
    for name, (img, ext, rgb) in files.items():
        (root / name).mkdir(parents=True)
        kwargs = {"transparency": 1} if name == "P-transparent" else {}
        img.save(root / name / f"x.{ext}", **kwargs)
        expected[name] = rgb
    return expected


def test_every_pillow_mode_decodes_to_rgb(tmp_path):
    expected = _modes(tmp_path)
    classes, samples = find_samples(tmp_path)
    assert classes == sorted(expected)
    for path, _label in samples:
        with Image.open(path) as img:
            assert to_rgb(img).mode == "RGB"
    dataset = ImageFolderData(samples, train=False)
    for i, (path, label) in enumerate(samples):
        x, y = dataset[i]
        assert x.shape == (3, 224, 224) and y == label
        got, want = _rgb_of(x), expected[classes[label]]
        tolerance = 6 if path.endswith(".jpg") else 1  # JPEG is lossy
        assert all(abs(g - w) <= tolerance for g, w in zip(got, want)), (classes[label], got, want)
    assert dataset.skipped_images == 0


def _tree_with_bad_files(root: Path) -> list[str]:
    """Two classes of 6 good PNGs each, and 3 files Pillow cannot decode; their paths."""
    for c, colour in (("a", (250, 0, 0)), ("b", (0, 0, 250))):
        (root / c).mkdir(parents=True)
        for i in range(6):
            Image.new("RGB", (16, 16), colour).save(root / c / f"{i}.png")
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (0, 250, 0)).save(buf, "PNG")
    (root / "a" / "0t-truncated.png").write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    (root / "a" / "0z-garbage.jpg").write_bytes(b"not a jpeg at all")
    (root / "b" / "0-empty.png").write_bytes(b"")
    return [str(root / "a" / "0t-truncated.png"), str(root / "a" / "0z-garbage.jpg"), str(root / "b" / "0-empty.png")]


def test_an_undecodable_file_is_skipped_warned_once_and_counted(tmp_path, caplog):
    bad = _tree_with_bad_files(tmp_path)
    _, samples = find_samples(tmp_path)
    dataset = ImageFolderData(samples, train=False)
    paths = [p for p, _ in samples]
    with caplog.at_level(logging.WARNING, logger="app.imagefolder"):
        for _ in range(2):  # two epochs: still one warning per file
            got = [dataset[i] for i in range(len(dataset))]
    assert dataset.skipped_images == 3
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 3 and all(any(f"skipping {p}: cannot decode it" in w for w in warned) for p in bad)
    for p in bad:  # the next good sample stands in: same label, a real image
        i = paths.index(p)
        following = next(j for j in range(i + 1, len(paths)) if paths[j] not in bad)
        assert got[i][1] == samples[following][1]
        assert torch.equal(got[i][0], got[following][0])


def test_skipped_files_are_counted_across_dataloader_processes(tmp_path):
    _tree_with_bad_files(tmp_path)
    _, samples = find_samples(tmp_path)
    dataset = ImageFolderData(samples, train=False)
    loader = datasets.eval_loader(dataset, 4, loader_workers=2)  # every index, in two loader processes
    for _ in range(2):
        seen = sum(len(y) for _, y in datasets.batches(loader, str(tmp_path)))
        assert seen == len(dataset)
        # The loader processes marked the files they met in memory shared with this process.
        assert dataset.skipped_images == 3


def test_an_empty_class_folder_is_an_error(tmp_path):
    (tmp_path / "cat").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "cat" / "1.png")
    (tmp_path / "dog").mkdir()
    (tmp_path / "dog" / "readme.txt").write_text("no images here")
    with pytest.raises(
        UsageError,
        match=r"^data dir: class folder 'dog' has no images \(.jpg, .*\); "
        rf"put images in it or remove it: {tmp_path}$",
    ):
        find_samples(tmp_path)


def test_one_class_is_an_error(tmp_path):
    """A single class trained to an accuracy of 1.0000 without a word (it was accepted)."""
    (tmp_path / "a").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "a" / "1.png")
    with pytest.raises(
        UsageError,
        match=rf"^data dir: one class folder \('a'\); a classifier needs at least two classes, .*: {tmp_path}$",
    ):
        find_samples(tmp_path)


def test_a_symlink_loop_is_one_line_naming_the_link(tmp_path):
    """(before: os.walk's way, followed until `OSError: [Errno 40] Too many levels of symbolic
    links: '.../loop/loop/loop/...'`, a 476-character line and exit 1)"""
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        Image.new("RGB", (8, 8)).save(tmp_path / name / "1.png")
    (tmp_path / "a" / "loop").symlink_to(tmp_path / "a")
    (tmp_path / "b" / "also-a").symlink_to(tmp_path / "a")  # a link to a folder it is not in: followed
    with pytest.raises(UsageError) as e:
        find_samples(tmp_path)
    assert str(e.value) == (
        f"data dir: {tmp_path}/a/loop leads back to {tmp_path}/a, a folder it is in (a symlink loop); remove the link"
    )
    (tmp_path / "a" / "loop").unlink()
    classes, samples = find_samples(tmp_path)
    assert classes == ["a", "b"] and [p for p, _ in samples] == [
        f"{tmp_path}/a/1.png",
        f"{tmp_path}/b/1.png",
        f"{tmp_path}/b/also-a/1.png",
    ]


@pytest.mark.parametrize("cache", ["off", "memory"])
def test_a_split_where_nothing_decodes_is_one_line_from_the_loader_processes(tmp_path, cache):
    """(before: `OSError: Caught OSError in DataLoader worker process 0.`, exit 1)"""
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "1.jpg").write_text("not an image")
    _, samples = find_samples(tmp_path)
    if cache == "off":
        dataset = ImageFolderData(samples, train=False)
    else:
        from app.data.imagecache import CachedImageFolder

        dataset = CachedImageFolder(samples, train=False, crop=32)
    loader = datasets.eval_loader(dataset, 2, loader_workers=1)
    with pytest.raises(UsageError) as e:
        list(datasets.batches(loader, str(tmp_path)))
    assert str(e.value) == (
        f"data dir: none of the 2 images of this split decodes (the first: {tmp_path}/a/1.jpg); "
        "put images Pillow reads there"
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout, expected",
    [
        ("empty-class", "app: error: data dir: class folder 'dog' has no images"),
        ("no-class-folder", "app: error: data dir has no class folders with images"),
        ("one-class", "app: error: data dir: one class folder ('a'); a classifier needs at least two classes"),
    ],
)
def test_no_images_is_one_line_and_exit_2(tmp_path, layout, expected):
    (tmp_path / "cat").mkdir()
    if layout == "one-class":  # Imagenette's layout, one class in each split
        (tmp_path / "cat").rmdir()
        for split in ("train", "val"):
            (tmp_path / split / "a").mkdir(parents=True)
            for i in range(8):
                Image.new("RGB", (8, 8), (i * 30, 0, 0)).save(tmp_path / split / "a" / f"{i}.png")
    elif layout == "empty-class":
        Image.new("RGB", (8, 8)).save(tmp_path / "cat" / "1.png")
        (tmp_path / "dog").mkdir()
        (tmp_path / "dog" / "notes.txt").write_text("x")
    else:
        (tmp_path / "cat").rmdir()
        (tmp_path / "notes.txt").write_text("x")
    r = run_app("ps", "--model", "cnn", "--dataset", "imagefolder", "--data_dir", str(tmp_path))
    assert r.returncode == 2, r.stderr
    errors = [line for line in r.stderr.splitlines() if not re.match(r"^\d{4}-\d\d-\d\d ", line)]
    assert len(errors) == 1 and errors[0].startswith(expected), r.stderr


def test_order_equals_torchvision_imagefolder(tmp_path):
    from torchvision.datasets import ImageFolder

    # Traps for a sort of whole paths: files at a class's top level next to subfolders,
    # `sub` vs `sub-2` ('-' sorts before '/'), upper-case extensions, non-image files.
    layout = [
        "b/z.png",
        "b/sub/x.png",
        "b/sub-2/y.PNG",
        "b/sub/deeper/w.jpg",
        "b/A.jpeg",
        "a/2.png",
        "a/10.png",
        "a/1.png",
        "a/notes.txt",
        "a/Sub/0.bmp",
        "c-1/q.png",
        "c/p.png",
    ]
    for rel in layout:
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if rel.endswith(".txt"):
            path.write_text("x")
        else:
            Image.new("RGB", (4, 4)).save(
                path,
                format="PNG"
                if not rel.lower().endswith((".jpg", ".jpeg", ".bmp"))
                else ("BMP" if rel.endswith(".bmp") else "JPEG"),
            )
    theirs = ImageFolder(str(tmp_path))
    classes, samples = find_samples(tmp_path)
    assert classes == theirs.classes
    assert samples == [(p, c) for p, c in theirs.samples]


@pytest.mark.slow
def test_a_run_with_undecodable_files_ends_well_and_counts_them(tmp_path):
    root = tmp_path / "data"
    bad = _tree_with_bad_files(root)
    for c in ("a", "b"):
        for i in range(6, 20):
            Image.new("RGB", (16, 16), (250, 0, 0) if c == "a" else (0, 0, 250)).save(root / c / f"{i}.png")
    held_out = {p for p, _ in datasets.load("imagefolder", str(root), "test", seed=0).data.samples}  # type: ignore[attr-defined]
    args = [
        "--model",
        "cnn",
        "--dataset",
        "imagefolder",
        "--data_dir",
        str(root),
        "--batch_size",
        "4",
        "--lr",
        "0.01",
        "--num_epochs",
        "2",
        "--loader_workers",
        "1",
        "--rpc_timeout",
        "30",
    ]
    procs = run_cluster(tmp_path, workers=2, args=args, timeout=180)
    assert {p.name: p.returncode for p in procs.values()} == {"ps": 0, "worker1": 0, "worker2": 0}, procs["ps"].stderr[
        -3000:
    ]
    ps_end = read(tmp_path / "metrics" / "ps.jsonl")[-1]
    assert ps_end["event"] == "end" and ps_end["skipped_images"] == len(held_out & set(bad))
    ends = [read(tmp_path / "metrics" / f"worker{r}.jsonl")[-1] for r in (1, 2)]
    assert all(e["event"] == "end" and "skipped_images" in e for e in ends)
    if set(bad) - held_out:  # a bad training file is met by the worker whose shard holds it
        assert sum(e["skipped_images"] for e in ends) >= 1
    warnings = "".join(p.stderr for p in procs.values())
    assert all(warnings.count(f"skipping {p}: cannot decode it") <= 2 for p in bad)  # once per process at most
