"""The app's Config, declared field by field for the type checker.

Written by app/config.py `type_stub` from app/options.py (`make docs`); do not edit.
app/config.py builds the real class at run time and imports this under TYPE_CHECKING alone.
"""

import dataclasses

@dataclasses.dataclass(frozen=True)
class Config:
    """Everything a process of the app needs: its role and one field per option of app/options.py."""

    role: str
    rank: int = 1
    world_size: int = 3
    max_workers: int = 0
    master_addr: str = "localhost"
    master_port: int = 6100
    device: str = "cpu"
    model: str = "resnet18"
    dataset: str = "imagefolder"
    data_dir: str = "./imagenette2/val"
    batch_size: int = 256
    lr: float = 0.01
    momentum: float = 0.0
    num_epochs: int = 150
    max_steps: int = 0
    strategy: str = "async"
    staleness: int = 4
    staleness_lr: bool = False
    overlap: bool = False
    exchange: str = "auto"
    partition_values: int = 1048576
    shm_dir: str = "/dev/shm"
    compress: str = "none"
    seed: int = 0
    eval_every: int = 100
    log_every: int = 10
    loader_workers: str = "auto"
    rpc_timeout: float = 60.0
    join_timeout: float = 300.0
    checkpoint_every: int = 1000
    checkpoint_dir: str = "./runs/app/checkpoints"
    metrics_dir: str = "./runs/app/metrics"
    shards: int = 1
    image_size: int = 224
    host_workers: int = 1
    image_cache: str = "auto"
    cache_dir: str = "./runs/app/cache"
    export_dir: str = "./runs/app/model"
    init_weights: str = ""
    precision: str = "fp32"
    channels_last: bool = False
    weight_decay: float = 0.0
    shard: int = 0
    run_id: str = ""
    resume: bool = False

    @property
    def num_trainers(self) -> int: ...
    @property
    def max_trainers(self) -> int: ...
    @property
    def name(self) -> str: ...
