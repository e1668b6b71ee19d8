"""The option-built topology sections, declared field by field for the type checker.

Written by `python -m orchestrator.topology.stub` from app/options.py (`make docs`); do not
edit. orchestrator/topology/model.py builds the real classes at run time and imports these
under TYPE_CHECKING alone.
"""

from typing import Literal, Optional, Union

from orchestrator.topology.model import _PS, _Train

class Train(_Train):
    model: str
    dataset: str
    data_dir: Optional[str] = None
    init_weights: Optional[str] = None
    batch_size: int
    lr: float
    momentum: float = 0.0
    epochs: int
    max_steps: int = 0
    strategy: Literal["async", "sync", "ssp", "allreduce"] = "async"
    staleness: int = 4
    staleness_lr: bool = False
    overlap: bool = False
    compress: Literal["none", "bf16", "fp16"] = "none"
    seed: int = 0
    eval_every: int = 100
    log_every: int = 10
    loader_workers: Union[Literal["auto"], int] = "auto"
    image_size: int = 224
    image_cache: Literal["auto", "off", "memory", "file"] = "auto"
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    channels_last: bool = False
    weight_decay: float = 0.0

class PS(_PS):
    rpc_timeout: int = 60
    join_timeout: int = 300
    checkpoint_every: int = 1000
    shards: int = 1
