"""The user's own model and dataset (entry points `pkg.module:factory`) and starting weights.

The contract (README, "Your own model and dataset"):

    model(num_classes: int, channels: int) -> torch.nn.Module
    dataset(root: str, train: bool, seed: int) -> (torch.utils.data.Dataset, channels: int, num_classes: int)

The dataset may be an IterableDataset (a stream: its whole pass each time it is iterated; the app
splits it by rank and DataLoader process, app/data/streams.py).
The module is imported from sys.path: the topology's `code` directory is put
there (PYTHONPATH) by the render and by `make local`. The dataset's samples are
(x, y) pairs: x a float tensor, y an int class index. Workers shard the
`train=True` dataset; the PS evaluates on the `train=False` one. `root` is
--data_dir (/data in a container). A NamedTuple of the three values is a tuple
and is accepted too.

Every failure to honour the contract (import, attribute, call, return type) is a
UsageError whose one line starts with the flag and the entry point, so the
process exits 2 before any RPC starts.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset

from app.config import UsageError
from app.contract import ENTRY_POINT
from app.runtime.words import first_line


class DatasetSpec(NamedTuple):
    """What a dataset factory returns (any 3-tuple in this order will do)."""

    data: Dataset
    channels: int
    num_classes: int


def is_entry_point(name: str) -> bool:
    """True for `pkg.module:factory`; built-in names have no colon."""
    return ":" in name


def one_line(error: BaseException) -> str:
    text = first_line(error)
    return text if text == type(error).__name__ else f"{type(error).__name__}: {text}"


def resolve(flag: str, spec: str) -> Callable[..., Any]:
    """The callable `spec` names; UsageError `--flag spec: why` when it cannot be had."""
    where = f"--{flag} {spec}"
    if not ENTRY_POINT.match(spec):
        raise UsageError(f"{where}: not an entry point; must be package.module:function")
    module_name, attr = spec.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        raise UsageError(
            f"{where}: cannot import {module_name!r}: {error} "
            "(is the topology's `code` directory the one that holds it?)"
        ) from None
    except Exception as error:  # noqa: BLE001 - the user's module failed while importing
        raise UsageError(f"{where}: importing {module_name!r} failed: {one_line(error)}") from None
    if not hasattr(module, attr):
        raise UsageError(f"{where}: module {module_name!r} has no attribute {attr!r}")
    factory = getattr(module, attr)
    if not callable(factory):
        raise UsageError(f"{where}: {attr!r} is a {type(factory).__name__}, not a callable")
    return factory


def call(where: str, factory: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`factory(*args, **kwargs)`; UsageError `where: calling it failed: why` when it raises."""
    try:
        return factory(*args, **kwargs)
    except UsageError:
        raise
    except Exception as error:  # noqa: BLE001 - the user's factory failed
        raise UsageError(f"{where}: calling it failed: {one_line(error)}") from None


def build_model(spec: str, channels: int, num_classes: int) -> nn.Module:
    """`factory(num_classes, channels)`, checked to be an nn.Module."""
    model = call(f"--model {spec}", resolve("model", spec), num_classes, channels)
    if not isinstance(model, nn.Module):
        raise UsageError(f"--model {spec}: returned a {type(model).__name__}; must return a torch.nn.Module")
    complex_ = [name for name, p in model.named_parameters() if p.is_complex()]
    if complex_:
        raise UsageError(
            f"--model {spec}: parameter {complex_[0]} is complex ({len(complex_)} in all); the PS holds real "
            "parameters only: keep a complex one as its real and imaginary parts (torch.view_as_real)"
        )
    return model


def takes_split(factory: Callable[..., Any]) -> bool:
    """Whether a dataset factory takes the keyword `split` (it then names its splits, a test
    one among them: `load_test_split`)."""
    try:
        return "split" in inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin or C callable: no signature to read
        return False


def load_dataset(spec: str, root: str, train: bool, seed: int) -> DatasetSpec:
    """`factory(root, train, seed)` (and `split="train"` or `"val"` where it takes one),
    checked to be (Dataset, channels, num_classes)."""
    factory = resolve("dataset", spec)
    named = {"split": "train" if train else "val"} if takes_split(factory) else {}
    return _checked(f"--dataset {spec}", call(f"--dataset {spec}", factory, root, train, seed, **named), train)


def load_test_split(spec: str, root: str, seed: int) -> DatasetSpec | None:
    """The factory's test split, `factory(root, False, seed, split="test")`, where it takes
    `split` and gives one (None: it has none, or it returned None)."""
    factory = resolve("dataset", spec)
    if not takes_split(factory):
        return None
    got = call(f"--dataset {spec} (split test)", factory, root, False, seed, split="test")
    return None if got is None else _checked(f"--dataset {spec} (split test)", got, False)


def _checked(where: str, got: Any, train: bool) -> DatasetSpec:
    if not isinstance(got, tuple) or len(got) != 3:
        shape = f"a tuple of {len(got)}" if isinstance(got, tuple) else f"a {type(got).__name__}"
        raise UsageError(f"{where}: returned {shape}; must return (Dataset, channels, num_classes)")
    data, channels, num_classes = got
    if not isinstance(data, Dataset):
        raise UsageError(
            f"{where}: returned a {type(data).__name__} as the dataset; must be a torch.utils.data.Dataset"
        )
    for name, value in (("channels", channels), ("num_classes", num_classes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UsageError(f"{where}: returned {name} {value!r}; must be an int >= 1")
    if isinstance(data, IterableDataset):  # a stream: its length, where it declares one, plans the run
        size = getattr(data, "__len__", None)
        if size is None or size() != 0:
            return DatasetSpec(data, channels, num_classes)
        size = 0
    else:
        try:
            size = len(data)  # type: ignore[arg-type]
        except TypeError:
            raise UsageError(
                f"{where}: the dataset has no len(); it must be a map-style Dataset or an IterableDataset"
            ) from None
    if size == 0:
        split = "train" if train else "held-out"
        raise UsageError(f"{where}: the {split} dataset (train={train}) is empty")
    return DatasetSpec(data, channels, num_classes)


# --- starting weights ------------------------------------------------------


def read_weights(path: str) -> Mapping[str, torch.Tensor]:
    """A state dict from `path`: a plain one, or the "model" entry of the project's final.pt
    or checkpoints. Loaded with weights_only (no code runs)."""
    where = f"--init_weights {path}"
    if not Path(path).is_file():
        raise UsageError(f"{where}: no such file")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - not a torch file, truncated, pickled code
        raise UsageError(
            f"{where}: not a readable state dict ({type(error).__name__}): must be a file of "
            "torch.save(model.state_dict()) or a final.pt, loadable with weights_only"
        ) from None
    if isinstance(obj, Mapping) and isinstance(obj.get("model"), Mapping) and obj["model"]:
        obj = obj["model"]  # final.pt / a checkpoint: {"model": state_dict, "version": ...}
    if not isinstance(obj, Mapping) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise UsageError(
            f"{where}: holds a {type(obj).__name__}, not a state dict (a mapping of names to tensors, or final.pt)"
        )
    return obj


def load_weights(model: nn.Module, path: str) -> None:
    """Copy the file's tensors into `model`; every key must match, name and shape.
    UsageError naming the first mismatch otherwise (the model is then unchanged)."""
    where = f"--init_weights {path}"
    given = read_weights(path)
    own = model.state_dict()
    for key, value in own.items():
        if key not in given:
            raise UsageError(f"{where}: key {key!r} (shape {list(value.shape)} in the model) is missing from the file")
        if tuple(given[key].shape) != tuple(value.shape):
            raise UsageError(
                f"{where}: key {key!r} has shape {list(given[key].shape)} in the file, {list(value.shape)} in the model"
            )
    extra = [key for key in given if key not in own]
    if extra:
        raise UsageError(
            f"{where}: key {extra[0]!r} (shape {list(given[extra[0]].shape)} in the file) "
            f"is not in the model ({len(extra)} unexpected key(s))"
        )
    model.load_state_dict(dict(given), strict=True)
