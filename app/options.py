"""Every option of the app, declared once: a field of one of three dataclasses.

- `TrainOptions`: the topology's `train` section (the training job);
- `PSOptions`: its `ps` section (the parameter server's own options);
- `ProcessOptions`: what the render (or whoever starts a process by hand) places
  for one process: its rank, the PS's address, the directories, the run's id.

A field is an option: its name gives the flag `--name` and the environment
variable `PSC_NAME` (`flag=` where the flag users know differs: `epochs` is
`--num_epochs`), its type the kind and the allowed values (a `Literal` lists
them), `option(...)` its default, bounds and help. Everything else reads these:

- the app's `Config` (app/config.py) is one frozen dataclass of all three, and
  its parser reads `OPTIONS` (app/option_table.py), derived from the fields;
- the topology's `train` and `ps` sections (orchestrator/topology/model.py)
  subclass `TrainOptions` and `PSOptions`, and pydantic validates them directly:
  the field metadata holds pydantic's own keys (description, ge/gt/le/lt);
- the render's environment (orchestrator/render/compose.py `app_environment`), and
  docs/topology.md, generated from the sections.

Adding a training option is one field here (and the code that uses it).
`tests/orchestrator/test_options.py` fails when the parser, the topology, the
render and docs/topology.md disagree. The rules between options (`RULES`) are
declared beside it, in app/option_rules.py, and both the parser and the topology
evaluate them. Standard library only: the orchestrator reads this module on a host
without torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

from app.contract import (
    Compression,
    Device,
    Exchange,
    ImageCache,
    Precision,
    StrategyName,
)
from app.recipes import (
    Problem,
    Spec,
    loss_problem,
    metric_problem,
    optimizer_problem,
    schedule_problem,
)

# Where a process started by hand (no --checkpoint_dir, --metrics_dir, --cache_dir) keeps its
# state: under runs/, which git ignores, never in the tree's own folders (the render and `make
# local` always give the three).
BY_HAND = "./runs/app"
# How the render passes a topology option on: always, or only when it differs from the
# app's default (the app then uses that default: the rendered file stays short).
ALWAYS, CHANGED = "always", "changed"
AutoInt = Union[Literal["auto"], int]  # `auto`, or a whole number >= 0
OPTION_KEY = "psc_option"  # the field metadata key of what is the app's alone (pydantic ignores it)


@dataclass(frozen=True)
class Extra:
    """What an option declares beyond pydantic's keys: see `option`."""

    flag: str = ""
    required: bool = False
    emit: str = ALWAYS
    bool_aliases: tuple[str, str] = ("", "")
    check: Optional[Callable[[Any], Optional[Problem]]] = None  # a spec's (app/recipes.py)


def option(
    default: Any,
    help: str,
    *,
    low: Optional[float] = None,
    low_open: bool = False,
    high: Optional[float] = None,
    high_open: bool = False,
    flag: str = "",
    required: bool = False,
    emit: str = ALWAYS,
    bool_aliases: tuple[str, str] = ("", ""),
    check: Optional[Callable[[Any], Optional[Problem]]] = None,
) -> Any:
    """One option as a dataclass field.

    `default`: the app's value when nothing sets it; `help`: one paragraph, the flag's help
    and the topology key's description; `low`/`high`: the smallest and largest allowed
    values (`*_open`: excluded); `flag`: the flag's name when it is not the field's
    (`--num_epochs` for `epochs`, as PyTorch's examples spell it); `required`: the topology file must give it;
    `emit`: ALWAYS, or CHANGED (the render writes it only when it is not `default`);
    `bool_aliases`: (false, true) -> these choices, for a field that was a boolean;
    `check`: a spec's checks (app/recipes.py), the Problem with a value or None. A mapping
    default (a spec) is copied for each instance."""
    meta: dict[str, Any] = {"description": help, OPTION_KEY: Extra(flag, required, emit, bool_aliases, check)}
    if low is not None:
        meta["gt" if low_open else "ge"] = low
    if high is not None:
        meta["lt" if high_open else "le"] = high
    if isinstance(default, dict):
        return dataclasses.field(default_factory=lambda: dict(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclass(frozen=True, kw_only=True)
class ProcessOptions:
    """What one process is and where its job is: placed by the render, `make local`, or by hand."""

    rank: int = option(
        1,
        "worker rank, 1..world_size-1 (the PS is always 0); under Kubernetes, JOB_COMPLETION_INDEX + 1 when unset",
        low=0,
    )
    world_size: int = option(3, "PS + workers", low=2)
    max_workers: int = option(
        0,
        "the most workers the job may be scaled to while it runs (workers.max): the PS admits ranks up to it, and "
        "each worker takes a fair share of the data of every epoch from the live set; 0: world_size-1",
        low=0,
    )
    master_addr: str = option("localhost", "the PS's address")
    master_port: int = option(6100, "the PS's rendezvous port", low=1, high=65535)
    secret_file: str = option(
        "",
        "A file holding the run's secret (at least 32 hex characters), readable by the job's processes "
        "alone; the orchestrator makes one for each run, and the main PS makes one where the file is missing.",
    )
    socket_dir: str = option(
        "",
        "A directory for the job's UNIX sockets (every process on one host; made 0700 when missing): only "
        "who may open it may connect; empty: TCP at --master_addr:--master_port. Strategy allreduce: its "
        "rendezvous, a c10d FileStore, in it (Gloo and NCCL on the loopback) instead of a TCPStore.",
    )
    encrypt: bool = option(
        True,
        "Over TCP: encrypt every message (CURVE); false: authenticate only (PLAIN, the password derived from "
        "the secret crosses in the clear), for a network no one else reads.",
    )
    device: Device = option("cpu", "cpu or cuda (cuda:0, the one GPU a container sees)")
    data_dir: str = option(
        "./imagenette2/val",
        "data root (unused by digits and synthetic): a local path, or a URL (http(s)://, s3://) for webdataset "
        "and your own dataset",
    )
    exchange: Exchange = option(
        "auto",
        "How pushes and replies cross between a worker and the PS: auto: through shared memory the PS "
        "offers (/dev/shm) when the worker can map it (the same host and /dev/shm: local processes, one "
        "compose project), else over the job's sockets, chosen per worker and logged once; "
        "transport: always over the job's sockets.",
    )
    shm_dir: str = option(
        "/dev/shm",
        "Where the PS makes its shared-memory segment for --exchange auto: an absolute path on a tmpfs the "
        "workers share (made there when missing, only inside a tmpfs directory; elsewhere: the job's sockets).",
    )
    checkpoint_dir: str = option(f"{BY_HAND}/checkpoints", "the PS writes its checkpoints and final.pt here")
    metrics_dir: str = option(f"{BY_HAND}/metrics", "JSON lines, one file per process")
    host_workers: int = option(
        1, "workers of this job sharing this host's CPUs (--loader_workers auto divides by it)", low=1
    )
    cache_dir: str = option(f"{BY_HAND}/cache", "--image_cache file: where the decoded shards are kept")
    export_dir: str = option(f"{BY_HAND}/model", "the export role writes model.pt and model.json here")
    init_weights: str = option("", "a state dict file (or a final.pt) the model starts from; empty: none")
    shard: int = option(
        0,
        "ps: which shard this process serves; 0 is the main PS at --master_addr; under "
        "Kubernetes, JOB_COMPLETION_INDEX when unset",
        low=0,
    )
    run_id: str = option(
        "",
        "this run's identity, written into every checkpoint: a PS resumes only its own "
        "run's checkpoints (a new run sets older ones aside); empty: resume any",
    )
    resume: bool = option(
        False,
        "a new run continues the newest checkpoint of an unfinished run (another run "
        "id's) instead of starting at version 0",
    )


@dataclass(frozen=True, kw_only=True)
class TrainOptions:
    """The training job: model, data, optimizer and strategy."""

    model: str = option(
        "resnet18",
        "cnn (built in), a torchvision classification model, e.g. resnet18, or your "
        "own as package.module:factory (needs `code`).",
        required=True,
    )
    dataset: str = option(
        "imagefolder",
        "imagefolder, mnist, cifar10 read data_dir; webdataset reads tar shards of <key>.png (or .jpg) and <key>.cls "
        "from data_dir's brace pattern (a URL or a path), its held-out ones from eval_data; digits and synthetic "
        "need no files; or your own as package.module:factory (needs `code`; it reads data_dir when given; it may "
        "return an IterableDataset).",
        required=True,
    )
    eval_data: str = option(
        "",
        "webdataset: the held-out shards the PS evaluates on, a brace pattern as data_dir's (a URL or a local "
        "path, e.g. https://host/val-{0..1}.tar).",
        emit=CHANGED,
    )
    batch_size: int = option(256, "Samples per batch, per worker.", low=1, required=True)
    eval_batch_size: int = option(
        0,
        "Samples per batch of the held-out evaluation (the PS's, allreduce's rank 0's, the export's): "
        "a model that fits a larger batch without gradients evaluates faster; 0: batch_size.",
        low=0,
        emit=CHANGED,
    )
    lr: float = option(0.01, "SGD learning rate, applied on the PS.", low=0, low_open=True, required=True)
    momentum: float = option(0.0, "SGD momentum, on the PS.", low=0, high=1, high_open=True)
    epochs: int = option(150, "Epochs each worker runs over its shard.", low=1, flag="num_epochs", required=True)
    max_steps: int = option(
        0, "Stop each worker after this many pushes (diloco, diloco_async: batches); 0: no cap.", low=0
    )
    strategy: StrategyName = option(
        "async",
        "async: the PS applies each gradient as it arrives; sync: one averaged "
        "update per round of one gradient from every worker; ssp: async, but no worker gets more than "
        "`staleness` pushes ahead of the slowest; allreduce: no PS, the workers average their gradients with "
        "DistributedDataParallel; diloco: each worker takes local_steps steps of `optimizer` (its inner one, "
        "on the worker), then pushes the change of its parameters, and the PS applies outer_optimizer to the "
        "average of one change per worker a round (Douillard et al. 2023); diloco_async: the PS applies each "
        "change as it arrives, with delayed Nesterov momentum (Liu et al. 2024) (docs/strategies.md).",
    )
    local_steps: int = option(
        16,
        "diloco and diloco_async: the steps a worker takes with its own optimizer between two pushes (H).",
        low=1,
        emit=CHANGED,
    )
    outer_optimizer: Spec = option(
        {"name": "sgd", "lr": 0.7, "momentum": 0.9, "nesterov": True},
        "diloco and diloco_async: the optimizer the PS steps with each change (the pseudo-gradient: the "
        "parameters at the pull minus those after the local steps), as `optimizer` is given; its lr is its own "
        "(0.7 unless given) and it is not scheduled. SGD with Nesterov momentum (the default) is applied as "
        "delayed Nesterov under diloco_async: each change at lr / workers as it arrives, and momentum's part "
        "once every `workers` arrivals.",
        emit=CHANGED,
        check=optimizer_problem,
    )
    staleness: int = option(
        4,
        "ssp only: how many pushes a worker may run ahead of the slowest live worker before it waits.",
        low=0,
    )
    staleness_lr: bool = option(
        False, "async and ssp: divide each push's learning rate by its staleness (Zhang et al. 2016)."
    )
    overlap: bool = option(
        False,
        "async and ssp: compute the next batch while the gradient and the fresh "
        "parameters are on the wire (one more step of staleness).",
    )
    compress: Compression = option(
        "none", "Gradients on the wire: none (float32), bf16 or fp16, with error feedback on the worker."
    )
    seed: int = option(0, "Model init, shuffling and synthetic data.", low=0)
    eval_every: int = option(
        100, "The PS evaluates on the held-out split every this many updates (and at the end).", low=1
    )
    log_every: int = option(10, "A worker prints a line every this many batches.", low=1)
    loader_workers: AutoInt = option(
        "auto",
        "DataLoader processes in each container (they pass batches "
        "through /dev/shm: shm_size): a number, or auto: the CPUs the container may use (affinity, cgroup "
        "cpu.max) / the workers on its host, minus 1 for training, at most 8 (2 CPUs and 2 workers: 0). The "
        "PS's evaluation follows the same rule. Each process logs the figure and why.",
    )
    image_size: int = option(
        224,
        "imagefolder and webdataset: side of the square training crop in pixels; the shorter side "
        "is resized to 8/7 of it first (256 for 224).",
        low=8,
        high=4096,
        emit=CHANGED,
    )
    image_cache: ImageCache = option(
        "auto",
        "imagefolder: decode each image once into uint8 at 8/7 of image_size "
        "(196 KB an image at 256 px); crop, flip and normalise on the training device. A worker then keeps one "
        "shard of the images for all epochs (shuffled within it each epoch) and holds only that; the PS caches "
        "its held-out set. memory: in /dev/shm (size shm_size for it); file: decoded once into a file on the "
        "state volume keyed by the file list and the size, mapped again by a restarted worker or a later run on "
        "the same data (old files are kept: delete them from the volume); in a job that may be scaled (workers.max "
        "above workers.count) the file holds the whole training split, one file every worker maps, and each "
        "epoch's share follows the workers training; off: decode every image every epoch. "
        "auto (the default): memory when the decoded images take at most half of the container's free "
        "/dev/shm and of its available RAM, else off with one log line saying what to set (processes that share "
        "one /dev/shm choose one at a time, each after the others' reservations); so the fast path is "
        "on wherever it fits, and never makes a container run out of shm. true/false mean memory/off.",
        emit=CHANGED,
        bool_aliases=("off", "memory"),
    )
    precision: Precision = option(
        "fp32",
        "Forward/backward under autocast: fp32 (off), bf16 (CPU or GPU) or fp16 "
        "(GPU workers only, with loss scaling). Parameters and pushed gradients stay float32.",
        emit=CHANGED,
    )
    channels_last: bool = option(
        False,
        "GPU workers: images (and, under allreduce, the model) in channels-last memory format.",
        emit=CHANGED,
    )
    weight_decay: float = option(
        0.0,
        "SGD weight decay (L2), applied on the PS with the learning rate: each "
        "update adds weight_decay x the parameters to the gradient.",
        low=0,
        emit=CHANGED,
    )
    optimizer: Spec = option(
        {"name": "sgd"},
        "The optimizer the PS steps its vector with: a torch.optim optimizer by name (sgd, adam, adamw, adamax, "
        "adagrad, adadelta, adafactor, asgd, nadam, radam, rmsprop, rprop), or as a mapping with its keyword "
        "arguments ({name: adamw, lr: 3e-4, betas: [0.9, 0.95], weight_decay: 0.1}), or your own "
        "package.module:factory (factory(param_groups, **kwargs) -> a torch.optim.Optimizer). Its lr is train.lr "
        "unless it gives one; train.momentum and train.weight_decay, where not 0, are its momentum and "
        "weight_decay. norm_and_bias_decay: false leaves norms and biases out of weight decay (adamw's "
        "default). The fused kernels where torch has them; the optimizer's state is in every checkpoint.",
        emit=CHANGED,
        check=optimizer_problem,
    )
    schedule: Spec = option(
        {"name": "constant"},
        "The learning rate by the PS's version (the updates applied): constant, cosine (eta_min: the last rate), "
        "step (step_size: updates or a fraction of the run; gamma), linear (end_factor) or plateau (torch's "
        "ReduceLROnPlateau on the headline metric at each evaluation: mode min or max, by default max for "
        "accuracy and min otherwise; factor, patience and cooldown in evaluations, threshold, threshold_mode, "
        "min_lr; one PS process), or your own package.module:factory (factory(optimizer, total_updates, **kwargs) -> "
        "a torch.optim.lr_scheduler, stepped once an update; a PS strategy), after a linear "
        "warmup of warmup updates (or that fraction of the run) from warmup_start_factor (1/3) of the rate, "
        "as torch's LinearLR, CosineAnnealingLR and StepLR. The run's length is the updates it plans at its "
        "start: epochs x the batches of an epoch over the whole training split (sync: divided by the workers), "
        "or max_steps; make scale leaves it as it is.",
        emit=CHANGED,
        check=schedule_problem,
    )
    clip_grad_norm: float = option(
        0.0,
        "Clip each push's gradient to this global L2 norm (as torch.nn.utils.clip_grad_norm_): the worker "
        "computes the norm on its device and sends it with the push, so every PS shard scales its slice alike; "
        "0: no clipping.",
        low=0,
        emit=CHANGED,
    )
    cuda_graphs: bool = option(
        False,
        "GPU workers: the step's forward and backward captured once as a CUDA graph and replayed each step "
        "(a batch of another shape, the last partial one, runs eagerly); on a CPU worker the step runs eagerly.",
        emit=CHANGED,
    )
    loss: Spec = option(
        {"name": "cross_entropy"},
        "The loss the workers train with: cross_entropy (label_smoothing, ignore_index), nll, mse, l1, "
        "smooth_l1 (beta), huber (delta), bce_with_logits, or your own package.module:factory "
        "(factory(**kwargs) -> a callable loss(outputs, targets)). A sequence model's outputs [batch, length, "
        "classes] against targets [batch, length] are taken position by position.",
        emit=CHANGED,
        check=loss_problem,
    )
    metrics: str = option(
        "accuracy",
        "The PS's evaluation of the held-out split: accuracy, perplexity (exp of the mean cross-entropy), loss "
        "(the mean loss alone), or your own package.module:function (function(model, batches, loss) -> "
        "{name: value, ...}). Its first metric is the run's headline: the eval line, progress, status, MLflow, "
        "the export and the report.",
        emit=CHANGED,
        check=metric_problem,
    )


@dataclass(frozen=True, kw_only=True)
class PSOptions:
    """The parameter server's own options (the topology's ps section)."""

    rpc_timeout: float = option(60.0, "Seconds for every RPC and every wait, in every process.", low=0, low_open=True)
    join_timeout: float = option(
        300.0,
        "Seconds the PS waits for a missing worker to join or rejoin before it ends without it, "
        "counted while a worker can join (the PS listens and every shard is up); also how long a "
        "worker or PS shard started before its PS waits for it.",
        low=0,
        low_open=True,
    )
    checkpoint_every: int = option(
        1000,
        "The PS saves a checkpoint every this many updates (and at the end, and on SIGTERM); 0: only at the end.",
        low=0,
    )
    shards: int = option(
        1,
        "PS processes the model's state is split across (services ps, ps-shard1..); helps "
        "when they sit on several hosts or NICs. Every process of the job needs it.",
        low=1,
        high=8,
        emit=CHANGED,
    )


# The topology section each dataclass is ("": none, the render places them), in the order
# the render writes their options into a service's environment.
SECTIONS: tuple[tuple[type, str], ...] = ((ProcessOptions, ""), (TrainOptions, "train"), (PSOptions, "ps"))
