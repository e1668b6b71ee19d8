"""The run in MLflow: where MLFLOW_TRACKING_URI is set (MLflow's own convention), the PS logs
its run there: the training parameters, loss, accuracy and samples/s at each evaluation with the
version as the step, each worker's training loss and samples/s as its pushes carry them
(`worker1/loss`, `worker1/samples_per_s`), the model as an artifact, and how the run ended.

A tracker that is down or slow never stops or slows training: every call only queues, and one
thread of the tracker's own sends (MLflow is imported there too: it takes seconds); the
evaluations queued while it waited for an answer go in one request. A server that does not
answer (down, restarting, refusing) is tried again, 1 s then up to 30 s apart, until the run
ends, with one warning when it stops answering and one line when it answers again; at most
`MAX_QUEUED` records wait meanwhile. An answer that no retry can change (a bad value, no
permission) ends the tracking with one warning, and the run goes on. At the end the PS waits for
the tracker to send what is left while it keeps sending (a slow server that takes each request
still gets the whole run): until `CLOSE_SECONDS` pass with nothing taken, or `CLOSE_MOST_SECONDS`
in all.

Writes are safe to repeat: MLflow's client retries a request whose answer was lost, so an
experiment that already exists is the one, and the run is found by its tag before one is made
(a second one made by a retried request is deleted). A URI's user and password are never
printed.

The experiment is MLFLOW_EXPERIMENT_NAME's (the render sets the topology's name), else
`ps-compose`; the run is named after the run id (a process started without one: `unnamed-`
and a suffix of its own, so that two such runs are two MLflow runs)."""

from __future__ import annotations

import collections
import logging
import os
import queue
import tempfile
import threading
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from app.contract import MLFLOW_RUN_TAG, MLFLOW_SERVER_ENV, MLFLOW_UI_ENV, mlflow_points, shown
from app.training import tracking_pending

log = logging.getLogger("app.tracking")
URI_ENV, EXPERIMENT_ENV = "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME"
DEFAULT_EXPERIMENT = "ps-compose"
CLOSE_SECONDS = 15.0  # the end's wait for the tracker, without a request taken meanwhile
CLOSE_MOST_SECONDS = 120.0  # ... and in all
# The eval and end records queued while a request was out go in one log_batch (MLflow takes up to
# 1000 metrics a request; a record holds at most a dozen).
BATCH_RECORDS = 50
# A request waits up to a minute for its answer (a server whose disk or CPU is busy took over
# 10 s for a write) and is tried twice more, 0-1 then 2-3 s later, where MLflow retries (refused,
# 429 and 5xx answers, timeouts): seconds, not MLflow's default of 7 retries with backoff
# (minutes), before the first failure ends the tracking. The waits are this thread's alone; the
# PS's end waits CLOSE_SECONDS without progress at most. Set unless the user set them.
HTTP_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "60",
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    # MLflow's own "View run at" line would name the URI the PS reaches, which the host may not;
    # the tracker logs the run's address as the host sees it instead.
    "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
}
RETRY_SECONDS = (1.0, 2.0, 4.0, 8.0, 15.0, 30.0)  # between tries of one request while MLflow does not answer
MAX_QUEUED = 10_000  # records kept while MLflow does not answer (an eval each); later ones are dropped
# MLflow's answers that say the request itself is wrong: trying it again cannot help.
FINAL_ERRORS = frozenset(
    {
        "INVALID_PARAMETER_VALUE",
        "BAD_REQUEST",
        "RESOURCE_DOES_NOT_EXIST",
        "PERMISSION_DENIED",
        "UNAUTHENTICATED",
        "CUSTOMER_UNAUTHORIZED",
        "INVALID_STATE",
        "ENDPOINT_NOT_FOUND",
    }
)
# Besides the run's own metrics (an eval record's `metrics`: accuracy, perplexity, the user's).
# A worker's training loss and samples/s, as its pushes carry them (MetricsWriter.worker): logged
# as `<worker>/loss` and `<worker>/samples_per_s` at the PS's version (app.contract.mlflow_points).
WORKER = "worker"
RECORDS = ("eval", "end", WORKER)  # the records queued meanwhile go in one request


class Tracker:
    """Queues a run's records for MLflow; a thread sends them (`record`, `model`, `close`)."""

    def __init__(self, uri: str, experiment: str, run_name: str, ui: str = "", keep: Path | None = None) -> None:
        self.uri, self.experiment, self.run_name = uri, experiment, run_name
        self.keep = keep  # where what MLflow did not take by the end is kept (tracking_pending), or None
        # Every item queued and not yet done with, in order: the sender takes them in that order,
        # so each one sent (or dropped for good) is the journal's first.
        self._journal: collections.deque[tuple[str, Any]] = collections.deque()
        self._journal_lock = threading.Lock()
        self._kept = False  # the end kept the journal on disk: the sender sends nothing more
        self.ended = False  # an `end` record ended the MLflow run FINISHED
        self.shown = shown(uri)  # the URI as logs print it
        self.ui = shown(ui or uri).rstrip("/")  # the server as the host reaches it
        self.address = ""  # the run's page, once it is open
        self._queue: queue.Queue[tuple[str, Any] | None] = queue.Queue()
        self.failed = False  # MLflow refused a request for good: the tracking has ended
        self.unanswered = False  # the last try of a request got no answer; tried again
        self.dropped = 0  # records not kept while MLflow did not answer (MAX_QUEUED)
        self.sent = 0  # calls MLflow took
        self._thread = threading.Thread(target=self._send_all, name="mlflow", daemon=True)
        self._thread.start()

    @classmethod
    def from_env(cls, env: Mapping[str, str], run_id: str, keep: Path | None = None) -> Tracker | None:
        """A tracker where MLFLOW_TRACKING_URI is set, else None; `keep`: the directory what
        MLflow has not taken by the end is written to."""
        uri = env.get(URI_ENV, "").strip()
        if not uri:
            return None
        name = run_id or f"unnamed-{uuid.uuid4().hex[:8]}"
        ui = env.get(MLFLOW_UI_ENV, "") if uri.rstrip("/") == env.get(MLFLOW_SERVER_ENV, "").rstrip("/") else ""
        return cls(uri, env.get(EXPERIMENT_ENV, "").strip() or DEFAULT_EXPERIMENT, name, ui, keep)

    def record(self, event: str, step: int, fields: Mapping[str, Any]) -> None:
        """A metrics record (app.training.metrics): `start` opens the run with its parameters,
        `eval` and `end` log their numbers at `step` (the version), `end` ends it FINISHED;
        `worker`, a worker's loss and samples/s (its `worker` field names it)."""
        if event in ("eval", WORKER) and self._queue.qsize() >= MAX_QUEUED:
            self.dropped += 1
            if self.dropped == 1:
                log.warning(
                    "MLflow at %s: %d records wait for it; later evaluations are not kept", self.shown, MAX_QUEUED
                )
            return
        # stamped now: a record sent again later (a sync of what was kept) is the same point
        self._put((event, (step, {"time": round(time.time(), 3), **fields})))

    def params(self, values: Mapping[str, Any]) -> None:
        self._put(("params", dict(values)))

    def model(self, files: Mapping[str, bytes], path: str = "model") -> None:
        """A model's files (relative path -> bytes), logged as the run's artifact directory `path`:
        `model`, the MLflow model (app/checkpoint/mlflow_model.py); `export`, `make export`'s files."""
        self._put(("model", (path, dict(files))))

    def close(self, status: str = "FAILED", timeout: float = CLOSE_SECONDS) -> None:
        """End the run with `status` unless an `end` record ended it FINISHED; wait for what is
        queued while the server takes it: until `timeout` seconds pass with no request taken, or
        CLOSE_MOST_SECONDS in all."""
        self._put(("close", status))
        self._queue.put(None)
        start = quiet_since = time.monotonic()
        sent = self.sent
        while self._thread.is_alive():
            self._thread.join(min(1.0, timeout))
            now = time.monotonic()
            if self.sent != sent:
                sent, quiet_since = self.sent, now
            if now - quiet_since >= timeout or now - start >= CLOSE_MOST_SECONDS:
                break
        if self._thread.is_alive() and not self.failed:
            kept = self._keep_journal()
            log.warning(
                "MLflow at %s did not take the run's last records (nothing taken for %.0f s); not waiting%s",
                self.shown,
                timeout,
                f"; {kept}" if kept else "",
            )

    def _put(self, item: tuple[str, Any]) -> None:
        with self._journal_lock:
            self._journal.append(item)
        self._queue.put(item)

    def _done(self, items: int) -> None:
        """The journal's first `items` were sent (or dropped for good)."""
        with self._journal_lock:
            for _ in range(items):
                self._journal.popleft()

    def _keep_journal(self) -> str:
        """What MLflow has not taken, on disk for a later sync (`ps-compose runs sync`); what was
        kept, in words, or "" when there is nowhere to keep it."""
        if self.keep is None:
            return ""
        with self._journal_lock:
            self._kept = True  # the sender sends nothing more: what is kept is sent once, by the sync
            items = [i for i in self._journal if not (self.ended and i[0] == "close")]
        try:
            tracking_pending.save(self.keep, self.experiment, self.run_name, self.shown, items)
        except OSError as error:
            return f"could not keep them for a later sync ({error})"
        return f"kept in {self.keep} for `ps-compose runs sync` once it answers"

    def _send_all(self) -> None:
        client: Any = None
        run_id = ""
        held: tuple[str, Any] | None = None  # an item taken while gathering a batch, sent next
        while (item := held if held is not None else self._queue.get()) is not None:
            held = None
            if self._kept:  # the end kept the rest on disk
                continue
            if self.failed:
                self._done(1)
                continue
            kind, value = item
            items = 1
            if kind in RECORDS:  # every record queued meanwhile, in one request
                value, held = self._gather(kind, value)
                kind, items = ("end" if any(k == "end" for k, _ in value) else "eval"), len(value)
            tries = 0
            while True:  # until it is taken or refused for good (a daemon thread: the PS's exit ends it)
                try:
                    if client is None:
                        client = self._client()
                    if not run_id and kind in ("start", "params"):
                        run_id = self._open(client)
                        log.info("MLflow run %s: %s", self.run_name, self.address)
                    if run_id:  # nothing before `start` is the run's
                        self.ended = self._send(client, run_id, kind, value) or self.ended
                        if kind == "close" and not self.ended:
                            client.set_terminated(run_id, value)
                        self.sent += 1
                    self._done(items)
                    break
                except Exception as error:  # noqa: BLE001 - any failure of the tracker: the run goes on
                    if _final(error):
                        self._done(items)
                        self.failed = True
                        log.warning(
                            "MLflow tracking at %s failed (%s); the run goes on without it", self.shown, _line(error)
                        )
                        break
                    if not self.unanswered:
                        log.warning(
                            "MLflow tracking at %s failed (%s); trying again until the run ends, and the run goes on",
                            self.shown,
                            _line(error),
                        )
                    self.unanswered = True
                    time.sleep(RETRY_SECONDS[min(tries, len(RETRY_SECONDS) - 1)])
                    if self._kept:
                        break
                    tries += 1
            if self.unanswered and not self.failed and not self._kept:
                self.unanswered = False
                log.info("MLflow at %s answers again; the run's records go on to it", self.shown)

    def _gather(self, kind: str, value: Any) -> tuple[list[tuple[str, Any]], tuple[str, Any] | None]:
        """This record and the eval and end records queued behind it (up to an `end`, at most
        BATCH_RECORDS); the first other item taken meanwhile, or None."""
        records = [(kind, value)]
        while kind != "end" and len(records) < BATCH_RECORDS:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return records, None
            if item is None or item[0] not in RECORDS:
                return records, item
            kind, value = item
            records.append(item)
        return records, None

    def _client(self) -> Any:
        for key, value in HTTP_DEFAULTS.items():
            os.environ.setdefault(key, value)
        from mlflow import MlflowClient  # seconds to import: in this thread, never the PS's

        return MlflowClient(self.uri)

    def _open(self, client: Any) -> str:
        """The MLflow run of this run id: the one a PS of the run opened before (it restarted and
        resumed), running again, or a new one."""
        experiment = self._experiment(client)
        earlier = self._runs(client, experiment)
        if earlier:
            client.update_run(earlier[0].info.run_id, status="RUNNING")
            return self._opened(experiment, earlier[0].info.run_id)
        client.create_run(experiment, run_name=self.run_name, tags={MLFLOW_RUN_TAG: self.run_name})
        first, *again = self._runs(client, experiment)  # a retried create made one more: the first is the run
        for extra in again:
            client.delete_run(extra.info.run_id)
        return self._opened(experiment, first.info.run_id)

    def _opened(self, experiment: str, run_id: str) -> str:
        self.address = f"{self.ui}/#/experiments/{experiment}/runs/{run_id}"  # MLflow UI's route
        return run_id

    def _experiment(self, client: Any) -> str:
        """The experiment's id; made if there is none (one a lost answer's retry finds made is the one)."""
        found = client.get_experiment_by_name(self.experiment)
        if found is not None:
            return found.experiment_id
        try:
            return client.create_experiment(self.experiment)
        except Exception as error:
            if getattr(error, "error_code", "") != "RESOURCE_ALREADY_EXISTS":
                raise
            return client.get_experiment_by_name(self.experiment).experiment_id

    def _runs(self, client: Any, experiment: str) -> list[Any]:
        """The runs of this run id in `experiment` (its tag), the first made first."""
        return list(
            client.search_runs(
                [experiment],
                filter_string=f"tags.`{MLFLOW_RUN_TAG}` = '{self.run_name}'",
                order_by=["attributes.start_time ASC"],
            )
        )

    def _send(self, client: Any, run_id: str, kind: str, value: Any) -> bool:
        """Send one item (eval and end: a list of records, in one request); True when it ended the run."""
        if kind == "params":
            from mlflow.entities import Param

            client.log_batch(run_id, params=[Param(k, str(v)) for k, v in sorted(value.items())])
        elif kind in RECORDS:
            from mlflow.entities import Metric

            metrics = [
                Metric(key, number, stamp, step)
                for event, (step, fields) in value
                for key, number, stamp in mlflow_points(event, fields, _now_ms())
            ]
            client.log_batch(run_id, metrics=metrics)
            if kind == "end":
                client.set_terminated(run_id, "FINISHED")
                log.info("MLflow run %s finished: %s", self.run_name, self.address)
                return True
        elif kind == "model":
            path, files = value
            with tempfile.TemporaryDirectory() as directory:
                for name, data in files.items():
                    Path(directory, name).parent.mkdir(parents=True, exist_ok=True)
                    Path(directory, name).write_bytes(data)
                client.log_artifacts(run_id, directory, artifact_path=path)
        return False


def _now_ms() -> int:
    return int(time.time() * 1000)


def _final(error: BaseException) -> bool:
    """Whether trying again cannot help: MLflow's answer says the request is wrong, or the error
    is neither MLflow's (which carries a code: a lost connection's too) nor the network's."""
    code = getattr(error, "error_code", None)
    return code in FINAL_ERRORS if code is not None else not isinstance(error, OSError)


def _line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return shown(f"{type(error).__name__}: {text[0] if text else ''}")[:300]
