"""Compose's own override files (`up -f FILE`): merged over the rendered file in order, checked
by compose before anything starts, recorded with the run so every later verb of it merges them
too; a missing file, a merge compose refuses, or a target that merges none is one line, exit 2.
On a made-up target (the blocks only), the real CLI parser and compose's own `config` check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_backends import FakeBackend

from orchestrator import paths
from orchestrator.backends import registry
from orchestrator.backends.base import Cluster
from orchestrator.backends.compose.backend import ComposeBackend
from orchestrator.errors import UsageError
from orchestrator.verbs import cluster as verbs

from orch_helpers import REPO, cli  # noqa: F401 - cli is a fixture

SMOKE = REPO / "configs/cpu-smoke.yaml"


class MergingFake(FakeBackend):
    """A fleet whose target merges override files: each block notes the files it was given."""

    merges_files = True

    def check_files(self, c) -> None:
        self.calls.append(("check", c.files))

    def deploy(self, c, env, out) -> list[str]:
        self.calls.append(("files", c.files))
        return super().deploy(c, env, out)

    def remove(self, c, volumes: bool) -> None:
        self.calls.append(("files", c.files))
        super().remove(c, volumes)


@pytest.fixture
def fleet(monkeypatch, tmp_path: Path) -> MergingFake:
    fake = MergingFake()
    monkeypatch.setitem(registry.BACKENDS, "fake", fake)
    monkeypatch.setattr(paths, "RUNS", tmp_path / "runs")
    return fake


def test_up_merges_the_files_and_every_later_verb_of_the_run_merges_them_too(
    cli,  # noqa: F811
    fleet: MergingFake,
    tmp_path: Path,
) -> None:
    (tmp_path / "extra.yaml").write_text("services: {}\n")
    (tmp_path / "more.yaml").write_text("services: {}\n")
    status, out, err = cli("fake-up", "-c", str(SMOKE), "-f", "extra.yaml", "--file", "more.yaml")
    assert status == 0, err
    files = (tmp_path / "extra.yaml", tmp_path / "more.yaml")  # absolute, in the order given
    assert ("check", files) in fleet.calls and ("files", files) in fleet.calls
    assert f"compose merges -f {files[0]} -f {files[1]} over it" in out
    recorded = json.loads((tmp_path / "runs" / "fleet-cpu-smoke" / "fake-up.json").read_text())
    assert recorded["files"] == [str(f) for f in files]

    fleet.calls.clear()
    assert cli("fake-down")[0] == 0  # the last up's, from its record
    assert cli("fake-down", "-c", str(SMOKE))[0] == 0  # the topology named: its record's files still
    assert cli("fake-down", "-f", "more.yaml")[0] == 0  # given: those, checked again
    assert [c for c in fleet.calls if c[0] in ("files", "check")] == [
        ("files", files),
        ("files", files),
        ("check", files[1:]),
        ("files", files[1:]),
    ]


def test_a_missing_file_is_one_line_and_nothing_starts(cli, fleet: MergingFake, tmp_path: Path) -> None:  # noqa: F811
    status, out, err = cli("fake-up", "-c", str(SMOKE), "-f", "nope.yaml")
    assert status == 2 and out == ""
    assert err.strip().splitlines() == [
        "error: -f: nope.yaml: no such file (a compose file to merge over the rendered one)"
    ]
    assert fleet.calls == [] and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("verb", [["stack-up", "-c", str(SMOKE)], ["stack-status"]])
def test_a_target_that_merges_no_file_refuses_f_in_one_line(cli, tmp_path: Path, monkeypatch, verb) -> None:  # noqa: F811
    monkeypatch.setattr(paths, "RUNS", tmp_path / "runs")
    (tmp_path / "extra.yaml").write_text("services: {}\n")
    (tmp_path / "runs" / "cpu-smoke").mkdir(parents=True)
    (tmp_path / "runs" / "cpu-smoke" / "stack.yaml").write_text("services: {}\n")
    status, out, err = cli(*verb, "--name", "cpu-smoke", "-f", "extra.yaml")
    assert status == 2, (out, err)
    assert len(err.strip().splitlines()) == 1 and "-f: target swarm takes no override file" in err


def test_a_recorded_file_gone_since_is_named_once_and_down_still_acts(
    cli,  # noqa: F811
    fleet: MergingFake,
    tmp_path: Path,
) -> None:
    extra = tmp_path / "extra.yaml"
    extra.write_text("services: {}\n")
    assert cli("fake-up", "-c", str(SMOKE), "-f", str(extra))[0] == 0
    extra.unlink()
    fleet.calls.clear()
    status, out, err = cli("fake-down")
    assert status == 0, err
    assert err.strip() == f"warning: {extra}: gone since fleet-cpu-smoke's up merged it; acting without it"
    assert ("files", ()) in fleet.calls


def test_compose_itself_checks_the_merge_and_its_words_name_the_file(tmp_path: Path) -> None:
    rendered = tmp_path / "compose.yaml"
    rendered.write_text(ComposeBackend().document(verbs.load_with(str(SMOKE))))
    good = tmp_path / "volume.yaml"
    good.write_text("services:\n  ps:\n    volumes:\n      - /srv/extra:/extra:ro\n")
    ComposeBackend().check_files(Cluster("cpu-smoke", rendered, files=(good,)))  # compose merges it: no error
    bad = tmp_path / "bad.yaml"
    bad.write_text("services:\n  ps:\n    cpus: lots\n")
    with pytest.raises(UsageError) as refused:
        ComposeBackend().check_files(Cluster("cpu-smoke", rendered, files=(good, bad)))
    line = str(refused.value)
    assert "\n" not in line and line.startswith(f"-f: compose cannot merge {good}, {bad} over compose.yaml: ")
    assert "services.ps.cpus" in line, line


def test_the_command_line_names_each_file_after_the_rendered_one() -> None:
    from orchestrator.backends.compose import adapter

    c = adapter.Compose(("docker", "compose"), 2)
    p = adapter.Project("run", "runs/run/compose.yaml", "/repo", ("/home/u/a.yaml", "/home/u/b.yaml"))
    assert adapter.up_argv(c, p)[:10] == [
        "docker",
        "compose",
        "-p",
        "run",
        "-f",
        "runs/run/compose.yaml",
        "-f",
        "/home/u/a.yaml",
        "-f",
        "/home/u/b.yaml",
    ]
    assert adapter.config_argv(c, p)[-2:] == ["config", "-q"]
