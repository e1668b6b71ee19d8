"""`python -m app check`: the cluster's connectivity check (a message-passing test of every rank).

Every rank 0..world_size-1 runs it. Rank 0 hosts a TCPStore at
master_addr:master_port; every other rank connects and registers its name,
host and address. Rank 0 waits up to `rpc_timeout` seconds; a rank that never
registered fails the check with one line naming it. Then a plain Gloo process
group over that store (as allreduce uses): rank 0 sends the classic
`tensor([42.])` and an 8 MiB tensor to each rank in turn, the rank sends them
back, rank 0 checks they came back unchanged and prints one line per rank:
name, host, address, round-trip times and GB/s (bytes both ways / round trip).

Rank names are the cluster's process names: `ps`, the PS's shards
`ps-shard1..` (`--shards`), `worker1..N`; with strategy `allreduce` there is
no PS and rank r is `worker<r+1>`.

Exit status: 0 passed; 1 failed (one line on stderr starting `check failed:`). The
last line on stdout is the rank's result for the orchestrator (app/contract.py
CHECK_RECORD: a mark, then JSON); the others are for people.
"""

from __future__ import annotations

import json
import socket
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from app.config import Config
from app.contract import CHECK_RECORD, service_names
from app.runtime import lifecycle, machine, words

SMALL = torch.tensor([42.0])  # the message of the classic torchrun message-passing check
LARGE_BYTES = 8 << 20
SMALL_REPS = 5  # round trips per size (after one warm-up); the median is reported
LARGE_REPS = 3
POLL = 0.05
ACK_WAIT = 3.0  # how long rank 0 keeps the store up for the others to read its verdict

KEY_CLAIM = "check/claim/{rank}"
KEY_RANK = "check/rank/{rank}"
KEY_VERDICT = "check/verdict"
KEY_DONE = "check/done"


class CheckFailed(Exception):
    """The check failed: the message is the one line printed after `check failed: `;
    `blame`: the ranks' names it holds responsible (empty: the one that raised it);
    `unreachable`: rank 0 was never reached; `called_off`: rank 0 ended the check."""

    def __init__(
        self, message: str, blame: list[str] | None = None, unreachable: bool = False, called_off: bool = False
    ) -> None:
        super().__init__(message)
        self.blame, self.unreachable, self.called_off = blame or [], unreachable, called_off


REPORT: list[str] = []  # rank 0's `check:` lines, repeated in its result record


def _say(line: str) -> None:
    print(line, flush=True)
    REPORT.append(line)


@dataclass(frozen=True)
class Member:
    rank: int
    name: str
    host: str
    addr: str

    def label(self) -> str:
        return f"{self.name} (rank {self.rank})"


def rank_names(world_size: int, strategy: str, shards: int = 1) -> list[str]:
    """The cluster's process names in rank order (the compose service names): `ps`, its
    shards `ps-shard1..`, then the workers."""
    return service_names(world_size, strategy, shards)


def local_addr(master_addr: str, port: int) -> str:
    """The address this host uses to reach `master_addr` (a UDP connect sends nothing)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master_addr, port))
            return s.getsockname()[0]
    except OSError:
        return "?"


def run(config: Config) -> int:
    """Run the check as `config.rank` and end the process with its exit status (at
    once: the interpreter's teardown of torch takes seconds, longer than the check)."""
    status = _run(config)
    lifecycle.exit_now(status)
    return status


def _run(config: Config) -> int:
    names = rank_names(config.world_size, config.strategy, config.shards)
    me = Member(
        config.rank, names[config.rank], socket.gethostname(), local_addr(config.master_addr, config.master_port)
    )
    machine.set_gloo_interface(config.master_addr)
    record = {
        "rank": me.rank,
        "name": me.name,
        "passed": False,
        "failed": None,
        "blame": [],
        "unreachable": False,
        "called_off": False,
        "report": REPORT,
    }
    try:
        if config.rank == 0:
            _rank0(config, names, me)
        else:
            _other(config, names, me)
        record["passed"] = True
    except CheckFailed as error:
        print(f"check failed: {error}", file=sys.stderr, flush=True)
        record.update(failed=str(error), blame=error.blame, unreachable=error.unreachable, called_off=error.called_off)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        print(CHECK_RECORD + json.dumps(record), flush=True)
    return 0 if record["passed"] else 1


def _where(config: Config) -> str:
    return f"{config.master_addr}:{config.master_port}"


# --- rank 0 ----------------------------------------------------------------


def _rank0(config: Config, names: list[str], me: Member) -> None:
    start = time.monotonic()
    timeout = timedelta(seconds=config.rpc_timeout)
    try:
        store = dist.TCPStore("127.0.0.1", config.master_port, None, True, timeout, wait_for_workers=False)
    except Exception as error:  # noqa: BLE001 - port taken, no permission...
        raise CheckFailed(
            f"{me.label()} cannot host the store on port {config.master_port}: {words.first_line(error)}"
        ) from None
    _say(
        f"check: {me.label()} on {me.host} {me.addr} waits for {words.counted(config.world_size - 1, 'rank')} "
        f"at {_where(config)} (at most {config.rpc_timeout:g} s)"
    )
    members = _wait_registered(store, config, names)
    missing = [r for r in range(1, config.world_size) if r not in members]
    if missing:
        who = ", ".join(f"{names[r]} (rank {r})" for r in missing)
        message = (
            f"{who} did not reach {_where(config)} within {config.rpc_timeout:g} s "
            f"({len(members) + 1} of {config.world_size} ranks registered)"
        )
        _abort(store, message, registered=len(members))
        raise CheckFailed(message, blame=[names[r] for r in missing])
    _say(f"check: all {config.world_size} ranks registered in {time.monotonic() - start:.2f} s")
    store.set(KEY_VERDICT, "go")
    _init_group(store, config, me)
    large = torch.arange(LARGE_BYTES // 4, dtype=torch.float32)
    _say(
        f"check: round trips from {me.name} over gloo (median of {SMALL_REPS} for 4 B, "
        f"of {LARGE_REPS} for {LARGE_BYTES >> 20} MiB; GB/s = bytes both ways / round trip):"
    )
    for rank in range(1, config.world_size):
        m = members[rank]
        try:
            small_ms = _round_trips(SMALL, rank, SMALL_REPS)
            large_ms = _round_trips(large, rank, LARGE_REPS)
        except CheckFailed as error:
            raise CheckFailed(f"{m.label()} on {m.host} {m.addr}: {error}", blame=[m.name]) from None
        except Exception as error:  # noqa: BLE001 - gloo: connection reset, timeout
            raise CheckFailed(
                f"no round trip with {m.label()} on {m.host} {m.addr}: {words.first_line(error)}", blame=[m.name]
            ) from None
        gbps = 2 * LARGE_BYTES / (large_ms / 1e3) / 1e9
        _say(
            f"check: {m.name:<8} rank {rank:<2} host {m.host} {m.addr}: 4 B {small_ms:.2f} ms, "
            f"{LARGE_BYTES >> 20} MiB {large_ms:.2f} ms, {gbps:.2f} GB/s"
        )
    _wait_count(store, KEY_DONE, config.world_size - 1, ACK_WAIT)
    _say(
        f"check passed: {config.world_size} ranks, every tensor came back unchanged ({time.monotonic() - start:.1f} s)"
    )


def _wait_registered(store: dist.TCPStore, config: Config, names: list[str]) -> dict[int, Member]:
    deadline = time.monotonic() + config.rpc_timeout
    members: dict[int, Member] = {}
    while True:
        for rank in range(1, config.world_size):
            key = KEY_RANK.format(rank=rank)
            if rank not in members and store.check([key]):
                info = json.loads(store.get(key))
                members[rank] = Member(rank, names[rank], info["host"], info["addr"])
        if len(members) == config.world_size - 1 or time.monotonic() >= deadline:
            return members
        time.sleep(POLL)


def _abort(store: dist.TCPStore, message: str, registered: int) -> None:
    """Tell the ranks that did register, and give them a moment to read it."""
    store.set(KEY_VERDICT, "abort: " + message)
    _wait_count(store, KEY_DONE, registered, ACK_WAIT)


def _wait_count(store: dist.TCPStore, key: str, count: int, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while store.add(key, 0) < count and time.monotonic() < deadline:
        time.sleep(POLL)


def _round_trips(tensor: torch.Tensor, rank: int, reps: int) -> float:
    """Median round trip in ms of `tensor` to `rank` and back (after one warm-up)."""
    back = torch.empty_like(tensor)
    times = []
    for i in range(reps + 1):
        t0 = time.perf_counter()
        dist.send(tensor, dst=rank)
        dist.recv(back, src=rank)
        if i:
            times.append((time.perf_counter() - t0) * 1e3)
        if not torch.equal(back, tensor):
            raise CheckFailed(f"the {tensor.numel() * 4} B tensor came back changed")
    return statistics.median(times)


# --- ranks 1..N -------------------------------------------------------------


def _reach(config: Config, names: list[str], me: Member) -> None:
    """Wait until rank 0's port accepts a TCP connection; CheckFailed at rpc_timeout."""
    try:
        machine.wait_for_port(config.master_addr, config.master_port, config.rpc_timeout)
    except machine.PortUnreachable as error:
        raise CheckFailed(
            f"{me.label()} could not reach {names[0]} (rank 0) at {_where(config)} "
            f"within {config.rpc_timeout:g} s: {error}",
            unreachable=True,
        ) from None


def _other(config: Config, names: list[str], me: Member) -> None:
    timeout = timedelta(seconds=config.rpc_timeout)
    _reach(config, names, me)
    try:
        store = dist.TCPStore(config.master_addr, config.master_port, None, False, timeout)
    except Exception as error:  # noqa: BLE001 - refused, unknown host, timeout
        raise CheckFailed(
            f"{me.label()} could not reach {names[0]} (rank 0) at {_where(config)} "
            f"within {config.rpc_timeout:g} s: {words.first_line(error)}",
            unreachable=True,
        ) from None
    if store.add(KEY_CLAIM.format(rank=me.rank), 1) > 1:
        raise CheckFailed(f"{me.label()}: another process already registered as rank {me.rank}")
    store.set(KEY_RANK.format(rank=me.rank), json.dumps({"host": me.host, "addr": me.addr}))
    # Rank 0 decides within rpc_timeout of its start; it may have started after us.
    try:
        store.wait([KEY_VERDICT], timedelta(seconds=2 * config.rpc_timeout + 5))
        verdict = store.get(KEY_VERDICT).decode()
    except Exception as error:  # noqa: BLE001
        raise CheckFailed(
            f"{me.label()}: no word from {names[0]} (rank 0) at {_where(config)}: {words.first_line(error)}"
        ) from None
    if verdict != "go":
        store.add(KEY_DONE, 1)
        raise CheckFailed(
            f"{me.label()}: {names[0]} (rank 0) called the check off: {verdict[len('abort: ') :]}", called_off=True
        )
    _init_group(store, config, me)
    large = torch.empty(LARGE_BYTES // 4, dtype=torch.float32)
    small = torch.empty_like(SMALL)
    try:
        for buf, reps in ((small, SMALL_REPS), (large, LARGE_REPS)):
            for _ in range(reps + 1):
                dist.recv(buf, src=0)
                dist.send(buf, dst=0)
    except Exception as error:  # noqa: BLE001
        raise CheckFailed(f"{me.label()}: exchange with {names[0]} (rank 0) broke: {words.first_line(error)}") from None
    print(
        f"check: {me.label()} on {me.host} {me.addr} received {small} from {names[0]} and sent back both tensors",
        flush=True,
    )
    store.add(KEY_DONE, 1)


def _init_group(store: dist.TCPStore, config: Config, me: Member) -> None:
    try:
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore("check/pg", store),
            rank=me.rank,
            world_size=config.world_size,
            timeout=timedelta(seconds=config.rpc_timeout),
        )
    except Exception as error:  # noqa: BLE001
        raise CheckFailed(f"{me.label()}: the gloo group did not form: {words.first_line(error)}") from None
