"""What a test needs from its host: under CI=true (`.ci/run`) a missing Docker
engine, compose binary or torchrun fails the test; elsewhere it skips with the
same line. Importable from every test directory (`pythonpath = ["tests"]`)."""

import os

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def unavailable(what: str) -> None:
    """Stop the test: `what` (e.g. "no Docker engine answers: ...") fails it in CI
    and skips it elsewhere."""
    if in_ci():
        pytest.fail(f"CI=true and {what}", pytrace=False)
    pytest.skip(what)


def host_has(present: bool, what: str) -> pytest.MarkDecorator:
    """The mark of a test that needs something of its host (`what`): without it the test skips,
    and under CI=true it runs and fails (CI's hosts have it; a skip there would hide the test)."""
    return pytest.mark.skipif(not present and not in_ci(), reason=f"needs {what}")


def cuda_gpu() -> pytest.MarkDecorator:
    """The mark of a test that needs a CUDA GPU: without one it skips, under CI=true too (CI
    runs on CPU machines; this is the one kind of test that may skip there), with the reason
    "needs a CUDA GPU"."""
    import torch

    return pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
