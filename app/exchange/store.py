"""The job's key-value store, held by the main PS's transport (app.exchange.node): what a process
says before it is a member (its name's incarnation, a note that it will not join), and where a PS
shard listens. The calls of torch's TCPStore that the job uses, on a dict, over the job's own
authenticated connections (no TCPStore, which anyone who reaches its port may write)."""

from __future__ import annotations

import threading
from typing import Any

CALLS = ("store.add", "store.set", "store.get", "store.check", "store.delete_key")


class Store:
    """Keys to bytes, thread-safe; every method is also a call other processes make."""

    def __init__(self) -> None:
        self._values: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def add(self, key: str, amount: int) -> int:
        """The number under `key` (0 when new) plus `amount`, stored and returned."""
        with self._lock:
            value = int(self._values.get(key, b"0")) + int(amount)
            self._values[key] = str(value).encode()
            return value

    def set(self, key: str, value: str | bytes) -> None:
        with self._lock:
            self._values[key] = value.encode() if isinstance(value, str) else bytes(value)

    def get(self, key: str) -> bytes | None:
        """The value, or None when `key` is not set (never waits for it)."""
        with self._lock:
            return self._values.get(key)

    def check(self, keys: list[str]) -> bool:
        """Whether every key is set."""
        with self._lock:
            return all(k in self._values for k in keys)

    def delete_key(self, key: str) -> bool:
        with self._lock:
            return self._values.pop(key, None) is not None

    def answer(self, call: str, args: tuple[Any, ...]) -> Any:
        """`call` (one of CALLS) with `args`, as a peer asked for it."""
        method = getattr(self, call.removeprefix("store."))
        value = method(*args)
        return value.decode() if isinstance(value, bytes) else value


class RemoteStore:
    """The store as a process other than the main PS sees it: each method a call to it."""

    def __init__(self, call: Any, timeout: float) -> None:
        self._call, self.timeout = call, timeout  # call(function, args, timeout) -> the answer

    def add(self, key: str, amount: int) -> int:
        return int(self._call("store.add", (key, amount), self.timeout))

    def set(self, key: str, value: str | bytes) -> None:
        self._call("store.set", (key, value.decode() if isinstance(value, bytes) else value), self.timeout)

    def get(self, key: str) -> bytes | None:
        value = self._call("store.get", (key,), self.timeout)
        return None if value is None else str(value).encode()

    def check(self, keys: list[str]) -> bool:
        return bool(self._call("store.check", (list(keys),), self.timeout))

    def delete_key(self, key: str) -> bool:
        return bool(self._call("store.delete_key", (key,), self.timeout))
