"""The soak's plan, drawn from its seed (pure): which faults, in which order, after which pauses,
and how long the job must be to outlive the soak.

The faults come in rounds: each round injects every kind once, in an order shuffled by the
seed, each after a pause drawn from the seed. A soak is replayed by its seed: the same kinds
in the same order, the same targets (by rank among the running ones) and the same pauses and
holds; the moments themselves follow the job (each fault starts once the previous one has
recovered, then its pause).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice

# Every kind of fault, in the order the tables list them.
KINDS: dict[str, str] = {
    "worker-kill": "SIGKILL a worker's app: Docker restarts it and it rejoins",
    "worker-term": "SIGTERM a worker's app: it leaves the job; started again, it rejoins",
    "ps-kill": "SIGKILL the PS's app: workers and shards exit, all restart, the PS resumes",
    "shard-kill": "SIGKILL a PS shard's app: Docker restarts it and it takes its slice back",
    "scale": "make scale up to a count <= workers.max, then back down",
    "pause": "docker pause a worker past the RPC timeout (the PS drops it), then unpause it",
    "fill": "fill the state volume's free space for a few seconds",
    "corrupt": "SIGKILL the PS and damage its newest checkpoint before it restarts",
}
PAUSE_S = (3.0, 12.0)  # before each fault, after the previous one recovered
FILL_HOLD_S = (3.0, 8.0)  # how long the volume stays full
PAUSE_HOLD_S = (2.0, 6.0)  # how long a paused worker stays paused after the PS dropped it
SEED_RANGE = 1_000_000


@dataclass(frozen=True)
class Step:
    """One fault of the plan."""

    kind: str
    pause_s: float  # wait this long before injecting it
    pick: float  # in [0, 1): which target among the candidates (sorted), and the scale's count
    hold_s: float  # fill: how long the volume stays full; pause: how long past the drop


def new_seed() -> int:
    """A seed for a soak that was given none (printed, so that it can be replayed)."""
    return random.SystemRandom().randrange(1, SEED_RANGE)


def schedule(seed: int) -> Iterator[Step]:
    """The endless plan of a soak with this seed: rounds of every kind, each round shuffled."""
    rng = random.Random(seed)
    while True:
        order = list(KINDS)
        rng.shuffle(order)
        for kind in order:
            hold = FILL_HOLD_S if kind == "fill" else PAUSE_HOLD_S
            yield Step(kind, round(rng.uniform(*PAUSE_S), 1), rng.random(), round(rng.uniform(*hold), 1))


def first(seed: int, count: int) -> list[Step]:
    """The first `count` steps of the plan of `seed`."""
    return list(islice(schedule(seed), count))


def choose(candidates: list[str], pick: float) -> str:
    """The target a step's `pick` names among `candidates` (sorted, so the same set gives the same one)."""
    ordered = sorted(candidates)
    return ordered[min(int(pick * len(ordered)), len(ordered) - 1)]


def scale_to(count: int, most: int, pick: float) -> int:
    """The worker count a scale step grows to: count + 1 .. most, by `pick`."""
    return count + 1 + min(int(pick * (most - count)), most - count - 1)


def job_epochs(minutes: float, epochs_per_minute: float) -> int:
    """Epochs for a job that, undisturbed, trains for `minutes` at `epochs_per_minute`: faults only
    slow it, so it outlives the soak, then ends on its own."""
    return max(1, math.ceil(minutes * epochs_per_minute))
