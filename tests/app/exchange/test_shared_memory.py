"""The same-host exchange: the PS's shared-memory segment (app.exchange.segment, app.exchange.ps_end) and a
worker's route through it (app.exchange.shared_route), in one process and between real processes."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from app.contract import exchange_bytes, exchange_regions
from app.exchange.ps_end import NO_SEGMENT, SharedExchange, open_exchange, region_names
from app.exchange.route import Pusher
from app.exchange.segment import Offer, Segment, ShmUnavailable, filesystem_of, segment_bytes, sweep
from app.exchange.shared_route import SharedMemoryRoute
from app.exchange.wire import Reply, SlotReply
from app.training.flat import FlatModel

from app_testkit import REPO, digits, ps_server, submit


@pytest.fixture
def shm_dir(tmp_path):
    """A directory of its own in /dev/shm (a tmpfs, as in production), removed afterwards. Not
    named psc-*: a PS of another test sweeps those in /dev/shm and may take its files."""
    path = Path("/dev/shm") / f"test-psc-{os.getpid()}-{tmp_path.name}"
    path.mkdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))


# --- the segment ---------------------------------------------------------------------------

ATTACH = """
import sys
from app.exchange.segment import Offer, Segment
offer = Offer(sys.argv[1], sys.argv[2], int(sys.argv[3]), tuple(sys.argv[4:]))
segment = Segment.attach(offer)
segment.region("b").fill_(7.0)
print(float(segment.region("a").sum()))
"""


def _python(script: str, *args: str, **kw) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, env=env, timeout=60, **kw
    )


def test_another_process_maps_the_segment_and_the_owner_removes_it(shm_dir):
    segment = Segment.create(str(shm_dir), 1000, ["a", "b"])
    assert os.path.getsize(segment.path) == 4096 + 2 * 4096  # a header page, each region on its own pages
    segment.region("a").fill_(1.0)
    offer = segment.offer()
    out = _python(ATTACH, offer.path, offer.nonce, str(offer.floats), *offer.names)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout) == 1000.0  # it read what the owner wrote
    assert torch.equal(segment.region("b"), torch.full((1000,), 7.0))  # and the owner reads what it wrote
    segment.close()
    assert list(shm_dir.iterdir()) == []


def test_a_file_of_that_name_that_is_not_the_segment_is_refused(shm_dir):
    segment = Segment.create(str(shm_dir), 10, ["a"])
    try:
        with pytest.raises(ShmUnavailable, match="another segment than the parameter server's"):
            Segment.attach(segment.offer()._replace(nonce="00" * 8))
        with pytest.raises(ShmUnavailable, match="No such file"):
            Segment.attach(Offer(str(shm_dir / "psc-1-gone.shm"), "00" * 8, 10, ("a",)))
    finally:
        segment.close()


OWN_AND_WAIT = """
import sys, time
from app.exchange.segment import Segment
segment = Segment.create(sys.argv[1], 100, ["a"])
print(segment.path, flush=True)
time.sleep(600)
"""


def test_sweep_removes_the_segment_of_a_killed_owner_and_keeps_a_live_ones(shm_dir):
    owner = subprocess.Popen(
        [sys.executable, "-c", OWN_AND_WAIT, str(shm_dir)],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    dead = Path(owner.stdout.readline().strip())
    live = Segment.create(str(shm_dir), 100, ["a"])
    try:
        assert sweep(str(shm_dir)) == []  # both owners live: nothing goes
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        assert dead.exists()  # SIGKILL ran no cleanup
        assert sweep(str(shm_dir)) == [str(dead)]
        assert Path(live.path).exists()
    finally:
        owner.stdout.close()
        live.close()


def test_a_killed_runs_directory_is_swept_by_the_next_run_subdirectories_included(shm_dir):
    """`orchestrator local` gives each run its own directory; SIGKILL of a run left its segment
    there, and each later PS swept only its own run's directory: it survived every later run.
    Now the next run's PS removes it and its directory; a live run's stay."""
    killed, live_run, empty_run = shm_dir / "psc-job-run1", shm_dir / "psc-job-run2", shm_dir / "psc-job-run0"
    killed.mkdir()
    empty_run.mkdir()  # a live run that has not made its segment yet
    owner = subprocess.Popen(
        [sys.executable, "-c", OWN_AND_WAIT, str(killed)],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    dead = Path(owner.stdout.readline().strip())
    live = Segment.create(str(live_run), 100, ["a"])
    try:
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        assert dead.exists()  # SIGKILL ran no cleanup
        nxt = Segment.create(str(shm_dir / "psc-job-run3"), 100, ["a"])  # the next run
        nxt.close()
        assert not killed.exists()
        assert Path(live.path).exists() and empty_run.is_dir()
    finally:
        owner.stdout.close()
        live.close()


def test_the_shm_dir_is_a_tmpfs_directory_and_nothing_is_made_elsewhere(tmp_path, shm_dir, caplog):
    """A missing --shm_dir was made with makedirs, parents and all (as root, /nonexistent
    appeared at /), on any filesystem (the segment went to disk). Now: made only inside a tmpfs
    directory, else one line saying why and the job's sockets instead, and nothing created."""
    assert filesystem_of("/dev/shm") == "tmpfs" and filesystem_of(str(tmp_path)) != "tmpfs"
    on_disk = tmp_path / "nonexistent" / "shm"
    for where in (on_disk, tmp_path):
        with pytest.raises(ShmUnavailable, match="not a tmpfs|does not exist"):
            Segment.create(str(where), 10, ["a"])
    assert not (tmp_path / "nonexistent").exists() and list(tmp_path.iterdir()) == []
    with caplog.at_level(logging.INFO, logger="app.ps"):
        assert open_exchange("auto", str(on_disk), 10, 1, overlap=False, sync=False, who="ps") is NO_SEGMENT
    [line] = caplog.messages
    assert line == (
        f"ps: no shared memory for the exchange ({on_disk} does not exist, nor does {on_disk.parent}); "
        "workers push over the job's sockets"
    )
    inside = Segment.create(str(shm_dir / "psc-run"), 10, ["a"])  # a run's own, in a tmpfs directory: made
    inside.close()
    assert (shm_dir / "psc-run").is_dir()


TOO_SMALL = """
import resource, signal, sys
from app.exchange.segment import Segment, ShmUnavailable
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit: EFBIG, as a full tmpfs gives ENOSPC
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
try:
    Segment.create(sys.argv[1], 1 << 20, ["a"])
except ShmUnavailable as e:
    print("unavailable:", e)
"""


def test_a_segment_that_does_not_fit_is_one_line_and_leaves_no_file(shm_dir):
    out = _python(TOO_SMALL, str(shm_dir))
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"unavailable: {shm_dir} has ") and "the exchange needs 4 MB" in out.stdout
    assert list(shm_dir.iterdir()) == []


def test_the_segment_has_the_size_the_render_plans_for():
    for workers, overlap, sync in [(1, False, False), (3, True, False), (4, False, True), (8, True, True)]:
        names = region_names(workers, overlap, sync)
        assert len(names) == len(set(names)) == exchange_regions(workers, overlap, sync)
        needed = segment_bytes(1234, len(names))  # what SharedExchange.open makes for them
        assert needed == exchange_bytes(1234, workers, overlap, sync)


# --- the PS's replies and the worker's slots, in one process ---------------------------------


def _shared_server(shm_dir: Path, strategy: str, momentum: float = 0.9, overlap: bool = False):
    model = _bn_model()
    size = FlatModel(model, with_grads=False).size
    exchange = SharedExchange.open(str(shm_dir), size, 2, overlap=overlap, sync=strategy == "sync")
    server = ps_server(model, lr=0.1, momentum=momentum, num_trainers=1, strategy=strategy, shared=exchange)
    return server, exchange


@pytest.mark.parametrize("strategy", ["async", "ssp", "sync"])
def test_a_push_from_a_slot_is_torch_sgd_value_for_value_and_the_reply_names_a_region(shm_dir, strategy):
    reference = _bn_model()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    server, exchange = _shared_server(shm_dir, strategy)
    link = SharedMemoryRoute.attach(exchange.offer(), Pusher(1, "worker1"))
    server.join(1, "worker1")
    n = server.state.num_params
    torch.manual_seed(2)
    try:
        for step in range(4):
            message = torch.randn(server.state.size)
            for p, g in zip(reference.parameters(), message[:n].split([p.numel() for p in reference.parameters()])):
                p.grad = g.view_as(p).clone()
            optimizer.step()
            slot = link.place(message)
            pushed = exchange.push(1, slot, "float32", message.numel())
            answer = exchange.answer(submit(server, 1, pushed, step).wait())
            assert isinstance(answer, SlotReply)  # only the region's name crosses
            assert answer.region.startswith("round." if strategy == "sync" else "reply1.")
            reply = link.reply(answer)
            assert torch.equal(reply.vector[:n], nn.utils.parameters_to_vector(reference.parameters()))
            assert torch.equal(reply.vector[n:], message[n:])
            assert torch.equal(server.snapshot()[0], reply.vector)
    finally:
        exchange.close()


def test_without_a_segment_the_ps_end_offers_nothing_holds_nothing_and_refuses_a_slot():
    """NO_SEGMENT (--exchange transport, or no shared memory): the same questions as a segment,
    each answered as a PS whose workers all push over the job's sockets."""
    assert NO_SEGMENT.offer() is None
    assert NO_SEGMENT.reply_buffers(1) is None and NO_SEGMENT.reply_buffers(0) is None
    assert not NO_SEGMENT.holds(torch.zeros(4))
    reply = Reply(torch.zeros(4), 3, 0, 0)
    assert NO_SEGMENT.answer(reply) is reply
    with pytest.raises(RuntimeError, match="^this parameter server has no shared-memory segment$"):
        NO_SEGMENT.push(1, 0, "float32", 4)
    NO_SEGMENT.close()  # nothing to remove
    server = ps_server(_bn_model(), lr=0.1)  # a server given no segment keeps its replies itself
    assert server.shared is NO_SEGMENT
    assert server.replies.take(1).numel() == server.state.size and not server.replies.in_segment(server.replies.take(1))


def test_a_state_outside_the_segment_goes_as_a_tensor(shm_dir):
    _, exchange = _shared_server(shm_dir, "async")
    try:
        reply = Reply(torch.zeros(exchange.floats), 3, 0, 0)
        assert exchange.answer(reply) is reply
    finally:
        exchange.close()


def test_a_new_process_of_a_rank_does_not_change_the_held_push_of_its_old_one(shm_dir):
    """sync: worker1's push is held (the round waits for worker2); worker1 is killed and its new
    process joins and starts writing its own gradient into the same push slot. The round still
    averages the old process's push, as it was pushed."""
    model = nn.Linear(4, 1, bias=False)
    nn.init.zeros_(model.weight)
    exchange = SharedExchange.open(str(shm_dir), 4, 2, overlap=False, sync=True)
    server = ps_server(model, lr=1.0, momentum=0.0, num_trainers=2, strategy="sync", shared=exchange)
    try:
        link = SharedMemoryRoute.attach(exchange.offer(), Pusher(1, "worker1"))
        server.join(1, "worker1")
        server.join(2, "worker2")
        held = submit(server, 1, exchange.push(1, link.place(torch.ones(4)), "float32", 4), 0, "worker1")
        server.join(1, "worker1_r2")  # the new process of rank 1
        link.slots[0].fill_(100.0)  # ... writes its next gradient where the old push was
        # a round that does not close as it was folded is averaged again from the held pushes
        server.drop(2, "worker2")
        assert isinstance(held.wait(), Reply) and torch.equal(server.state.vector, torch.full((4,), -1.0))
    finally:
        exchange.close()


def test_a_worker_computing_on_a_shared_reply_leaves_it_as_the_ps_wrote_it():
    """The worker's parameters are views of the PS's reply (no copy); its BatchNorm running
    stats, which the forward updates in place, stay in its own memory."""
    model = _bn_model()
    flat = FlatModel(model, own_buffers=True)
    shared = torch.arange(flat.size, dtype=torch.float32)
    before = shared.clone()
    flat.adopt(shared)
    assert model[0].weight.data_ptr() == shared.data_ptr()  # the parameters: no copy
    model.train()
    model(torch.randn(8, 3)).sum().backward()
    assert torch.equal(shared, before)
    assert not torch.equal(flat.buffers, before[flat.num_params :])  # the running stats moved, in its memory
    assert torch.equal(flat.pack_message()[flat.num_params :], flat.buffers)


def test_backward_writes_the_gradient_into_the_push_slot(shm_dir):
    _, exchange = _shared_server(shm_dir, "async", overlap=True)
    try:
        link = SharedMemoryRoute.attach(exchange.offer(), Pusher(1, "worker1"))
        model = _bn_model()
        flat = FlatModel(model, own_buffers=True)
        flat.use_messages(link.slots)
        for k in (0, 1, 0):  # --overlap alternates the two slots
            flat.zero_grads()
            model(torch.randn(8, 3)).sum().backward()
            message = flat.pack_message()
            assert link.place(message) == k  # already in the slot: nothing copied
            assert torch.equal(exchange.push(1, k, "float32", flat.size), message)
            flat.flip()
    finally:
        exchange.close()


# --- real processes ----------------------------------------------------------------------------

DIGITS = digits(lr=0.1, seed=1)


def _cluster(tmp_path: Path, shm_dir: Path, workers: int, *args: str, **kw):
    from app_testkit import app_env, run_cluster

    env = app_env(PSC_SHM_DIR=str(shm_dir), **kw.pop("env", {}))
    return run_cluster(tmp_path, workers=workers, args=[*DIGITS, "--rpc_timeout", "30", *args], timeout=240, env=env)


@pytest.mark.slow
def test_processes_exchange_through_shared_memory_and_leave_nothing_behind(tmp_path, shm_dir):
    procs = _cluster(tmp_path, shm_dir, 2, "--num_epochs", "6")
    for p in procs.values():
        assert p.returncode == 0, f"{p.name}: {p.stderr}"
    assert f"ps: exchange through shared memory {shm_dir}/psc-" in procs["ps"].stderr
    for name in ("worker1", "worker2"):
        lines = [line for line in procs[name].stderr.splitlines() if "exchange" in line]
        assert len(lines) == 1 and f"{name}: exchange with ps through shared memory ({shm_dir}/psc-" in lines[0]
    assert float(procs["ps"].stdout.split("Accuracy: ")[-1].split()[0]) >= 0.90
    assert list(shm_dir.iterdir()) == []  # the PS removed its segment as it ended


@pytest.mark.slow
@pytest.mark.parametrize(
    "workers,args",
    [(1, ["--strategy", "async"]), (2, ["--strategy", "sync", "--momentum", "0.5"]), (1, ["--overlap", "true"])],
    ids=["async-1", "sync-2", "overlap-1"],
)
def test_both_exchanges_train_the_same_values(tmp_path, shm_dir, workers, args):
    """Through shared memory or over the job's sockets, the PS applies the same pushes to the same
    state: final.pt is the same, bit for bit (one worker; or sync, whose round is the same
    whatever order its two pushes land in; --overlap pushes from two slots in turn)."""
    finals = {}
    for mode in ("auto", "transport"):
        run = tmp_path / mode
        run.mkdir()
        procs = _cluster(run, shm_dir, workers, "--num_epochs", "2", "--exchange", mode, *args)
        assert all(p.returncode == 0 for p in procs.values()), {n: p.stderr[-2000:] for n, p in procs.items()}
        said = procs["worker1"].stderr
        assert ("through shared memory" in said) == (mode == "auto"), said
        finals[mode] = torch.load(run / "checkpoints" / "final.pt")
    assert finals["auto"]["version"] == finals["transport"]["version"] > 0
    for key, value in finals["auto"]["model"].items():
        assert torch.equal(value, finals["transport"]["model"][key]), key


NOT_SHARED = """
mount -t tmpfs -o size=1m tmpfs {shm}
exec {python} -m app "$@"
"""


def _as_root_in_own_mount_namespace() -> None:
    from needs import unavailable

    if os.geteuid() != 0 or subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode != 0:
        unavailable("not root with unshare: cannot give a process a /dev/shm of its own")


@pytest.mark.slow
def test_a_worker_that_does_not_share_the_ps_memory_pushes_over_the_socket(tmp_path, shm_dir):
    """worker2 runs with a /dev/shm of its own (a mount namespace with its own tmpfs there, as
    another host or container has): it says so in one line and trains over the job's socket, beside
    worker1 on shared memory."""
    _as_root_in_own_mount_namespace()
    wrapper = tmp_path / "own_shm.sh"
    wrapper.write_text(NOT_SHARED.format(shm=shm_dir, python=sys.executable))
    from app_testkit import app_env, free_port, start_app, wait_for

    common = ["--world_size", "3", "--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    common += ["--metrics_dir", str(tmp_path / "m"), "--checkpoint_dir", str(tmp_path / "c"), *DIGITS]
    common += ["--num_epochs", "4", "--rpc_timeout", "30"]
    env = app_env(PSC_SHM_DIR=str(shm_dir))
    procs = {
        "ps": start_app(tmp_path, "ps", ["ps", *common], env),
        "worker1": start_app(tmp_path, "worker1", ["worker", "--rank", "1", *common], env),
    }
    with open(tmp_path / "worker2.out", "w") as out, open(tmp_path / "worker2.err", "w") as err:
        procs["worker2"] = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "sh", str(wrapper), "worker", "--rank", "2", *common],
            stdout=out,
            stderr=err,
            env=env,
            cwd=REPO,
        )
    wait_for(procs, 240)
    for name, proc in procs.items():
        assert proc.returncode == 0, (name, (tmp_path / f"{name}.err").read_text())
    said = [line for line in (tmp_path / "worker2.err").read_text().splitlines() if "exchange" in line]
    assert len(said) == 1 and "ps's shared memory is not reachable from here" in said[0], said
    assert "No such file or directory); exchange over the job's transport" in said[0]
    assert "worker1: exchange with ps through shared memory" in (tmp_path / "worker1.err").read_text()


@pytest.mark.slow
def test_a_ps_without_room_for_its_segment_says_so_and_the_job_trains_over_the_sockets(tmp_path):
    """The PS's /dev/shm is too small for the exchange: one warning line, and every worker pushes
    over the job's sockets (they are told of no segment)."""
    _as_root_in_own_mount_namespace()
    shm = Path("/dev/shm") / f"test-psc-small-{os.getpid()}"
    shm.mkdir()
    try:
        script = f'mount -t tmpfs -o size=64k tmpfs {shm} && exec {sys.executable} -m app "$@"'
        from app_testkit import app_env, free_port, start_app, wait_for

        common = ["--world_size", "2", "--master_addr", "127.0.0.1", "--master_port", str(free_port())]
        common += ["--metrics_dir", str(tmp_path / "m"), "--checkpoint_dir", str(tmp_path / "c"), *DIGITS]
        common += ["--num_epochs", "2", "--rpc_timeout", "30"]
        env = app_env(PSC_SHM_DIR=str(shm))
        with open(tmp_path / "ps.out", "w") as out, open(tmp_path / "ps.err", "w") as err:
            ps = subprocess.Popen(
                ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "app", "ps", *common],
                stdout=out,
                stderr=err,
                env=env,
                cwd=REPO,
            )
        procs = {"ps": ps, "worker1": start_app(tmp_path, "worker1", ["worker", "--rank", "1", *common], env)}
        wait_for(procs, 240)
        ps_err = (tmp_path / "ps.err").read_text()
        assert ps.returncode == 0 and procs["worker1"].returncode == 0, ps_err
        warnings = [line for line in ps_err.splitlines() if "no shared memory for the exchange" in line]
        assert (
            len(warnings) == 1
            and "the exchange needs" in warnings[0]
            and "workers push over the job's sockets" in warnings[0]
        )
        assert "exchange" not in (tmp_path / "worker1.err").read_text()  # no segment offered, nothing to say
    finally:
        shm.rmdir()
