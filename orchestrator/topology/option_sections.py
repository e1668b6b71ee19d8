"""The topology's train and ps sections: app/options.py's `TrainOptions` and `PSOptions`, which
pydantic validates directly, with the host paths and the checks only a topology has (the
model and dataset names, every option's value as the file gives it, no coercion). The
Topology that holds them is in model.py, the other sections in fields.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Annotated, Any, Optional

from pydantic import Strict, ValidationInfo, field_validator

from app.contract import DATASETS, ENTRY_POINT
from app.option_table import BY_NAME, in_topology
from app.options import PSOptions, TrainOptions
from app.recipes import spec_of
from orchestrator.topology.values import SECTION_CONFIG, Size, exact_value, loader_workers, yaml_float

_MODEL = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")


def _image_cache(v: Any) -> Any:
    """image_cache was a boolean: YAML's bare true/false (on/off) still mean memory/off."""
    aliases = BY_NAME["image_cache"].bool_aliases
    return aliases[int(v)] if isinstance(v, bool) else v


def _plain(section: str) -> list[str]:
    """The keys of a section's options of a plain kind (int, float, bool, str without choices)."""
    return [o.key for o in in_topology(section) if o.kind in ("int", "float", "bool", "str") and not o.choices]


def _spec(v: Any) -> Any:
    """An optimizer, schedule or loss: a name, or a mapping with its name and keyword arguments
    (a number PyYAML read as text, `3e-4`, is the number it means)."""
    if isinstance(v, str) and not v.strip().startswith("{"):
        return spec_of(v)
    if not (isinstance(v, dict) and isinstance(v.get("name"), str)):
        raise ValueError("must be a name, or a mapping with a name and its keyword arguments")
    return spec_of({k: _numbers(x) for k, x in v.items()})


def _numbers(v: Any) -> Any:
    return [_numbers(x) for x in v] if isinstance(v, list) else yaml_float(v)


def _exact(v: Any, info: ValidationInfo) -> Any:
    """An option's value as the file gives it: no coercion (values.exact_value)."""
    assert info.field_name is not None
    return exact_value(BY_NAME[info.field_name].kind, v)


@dataclass(frozen=True, kw_only=True)
class Train(TrainOptions):
    """The training job: model, data, optimizer and strategy."""

    __pydantic_config__ = SECTION_CONFIG
    # The host paths a topology gives beside the app's options (the render mounts them).
    data_dir: Optional[str] = field(
        default=None,
        metadata={
            "min_length": 1,
            "description": (
                "Host directory of the data (relative: to the directory of compose.yaml / where you run). Mounted "
                "read-only at /data. For imagefolder: class folders (10% held out), or train/ and val/ of class "
                "folders (Imagenette's layout: the PS evaluates on val/). For webdataset: a brace pattern of tar "
                "shards (its folder is mounted). A URL (http(s)://, s3://; webdataset and your own dataset) is not "
                "mounted: every process reads it as given, and with s3:// gets AWS_* from the caller by name."
            ),
        },
    )
    init_weights: Optional[str] = field(
        default=None,
        metadata={
            "min_length": 1,
            "description": (
                "A state dict file (or a final.pt of an earlier run) the model starts from (relative: like data_dir). "
                "Mounted read-only."
            ),
        },
    )

    @field_validator("model")
    @classmethod
    def _model(cls, v: str) -> str:
        if not (_MODEL.match(v) or ENTRY_POINT.match(v)):
            raise ValueError("must be a model name like cnn or resnet18, or an entry point package.module:factory")
        return v

    @field_validator("dataset")
    @classmethod
    def _dataset(cls, v: str) -> str:
        if v not in DATASETS and not ENTRY_POINT.match(v):
            raise ValueError(f"must be one of {', '.join(DATASETS)}, or an entry point package.module:factory")
        return v

    _plain_values = field_validator(*_plain("train"), mode="before")(_exact)
    _specs = field_validator(*[o.key for o in in_topology("train") if o.kind == "spec"], mode="before")(_spec)
    _cache = field_validator("image_cache", mode="before")(_image_cache)
    _loaders = field_validator("loader_workers", mode="before")(loader_workers)


@dataclass(frozen=True, kw_only=True)
class PS(PSOptions):
    """The parameter server (rank 0). Under strategy allreduce there is none: worker1 makes the rendezvous (on one host
    files on the job's private volume; across hosts a TCPStore on rpc_port) and checkpoints every checkpoint_every
    steps."""

    __pydantic_config__ = SECTION_CONFIG
    shm_size: Size = field(default="1g", metadata={"description": "/dev/shm of the PS container."})
    gpu: Optional[Annotated[int, Strict()]] = field(
        default=None,
        metadata={"ge": 0, "description": "GPU id for the PS (cuda only); default none: the PS runs on CPU."},
    )
    rpc_port: Annotated[int, Strict()] = field(
        default=29500,
        metadata={
            "ge": 1024,
            "le": 65535,
            "description": "The PS's rendezvous port (inside the network; published only if network.publish_rpc_port).",
        },
    )

    _plain_values = field_validator(*_plain("ps"), mode="before")(_exact)
