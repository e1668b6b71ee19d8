"""Log lines for `Backend.log_iter`: the merged output of command lines (`docker compose logs`,
`docker service logs` per service). They can be closed from another thread: the processes
are ended, and the iteration stops."""

from __future__ import annotations

import os
import queue
import subprocess
import threading
from collections.abc import Iterator, Sequence
from typing import Optional

from orchestrator.errors import EngineError


class ProcessLines:
    """The stdout and stderr lines of `argvs`, each run at once, merged as they come."""

    def __init__(self, argvs: Sequence[Sequence[str]], env: Optional[dict[str, str]] = None) -> None:
        self._lines: queue.Queue[Optional[str]] = queue.Queue()
        self.procs: list[subprocess.Popen[str]] = []
        try:
            for argv in argvs:
                proc = subprocess.Popen(
                    list(argv),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    text=True,
                    errors="replace",
                    env={**os.environ, **env} if env else None,
                )
                self.procs.append(proc)
                threading.Thread(target=self._pump, args=(proc,), daemon=True).start()
        except OSError as e:
            self.close()
            raise EngineError(f"cannot run {argvs[0][0]}: {e.strerror or e}") from None

    def _pump(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def __iter__(self) -> Iterator[str]:
        left = len(self.procs)
        while left:
            line = self._lines.get()
            if line is None:
                left -= 1
            else:
                yield line

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    @property
    def returncode(self) -> int:
        """The worst exit status of the commands (after the iteration ended)."""
        return max((p.wait() for p in self.procs), default=0)
