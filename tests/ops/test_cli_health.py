"""The image's HEALTHCHECK (`memkv health`) against real nodes, plain and TLS (issue 20).

The command is read from deploy/docker/Dockerfile's HEALTHCHECK line and run exactly as Docker
runs it: inside the container's PID namespace, whose PID 1 is `memkv serve`. Here that
namespace is made with `unshare --pid --mount-proc` around a real node, and the check runs in it
through `nsenter` (root needed; skipped otherwise). Claims:

* a plain node: exit 0, over http://127.0.0.1:<port+1>/v1/health;
* a TLS-only node (`--tls-cert/--tls-key`, the admin port speaks HTTPS only): exit 0 over
  https, the certificate verified against the node's own --tls-cert without any setting, and
  against MEMKV_TLS_CA when it is set; a MEMKV_TLS_CA that did not sign the node's certificate
  fails (exit 1) naming the cause;
* a node that does not answer (SIGSTOP) fails by the command's own timeout (2 s, under
  Docker's 3 s), saying so;
* a process that is not `memkv serve` is a usage error (exit 2) that says so.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from memkv.local import LocalNode
from tests.ops.helpers import _free_port_pair, clean_env, poll_until
from tests.ops.test_deploy_manifests import healthcheck_argv
from tests.tlscerts import node_tls_args


def _can_unshare() -> bool:
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("nsenter"):
        return False
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, timeout=10)
    return probe.returncode == 0


pytestmark = pytest.mark.skipif(not _can_unshare(), reason="needs root, unshare and nsenter (a PID namespace)")


class ContainerNode:
    """A real `memkv serve` as PID 1 of its own PID namespace, data port P and admin port P+1
    (the image's layout); `run(argv)` runs a command in that namespace, as Docker runs a check."""

    def __init__(self, tmp_path: Path, key_hex: str, extra_args=()) -> None:
        wrapper = tmp_path / "python-in-pidns"
        wrapper.write_text(
            f'#!/bin/sh\nexec unshare --pid --fork --mount-proc --kill-child=SIGTERM {sys.executable} "$@"\n'
        )
        wrapper.chmod(0o755)
        saved, last = sys.executable, None
        sys.executable = str(wrapper)  # LocalNode runs `sys.executable -m memkv serve ...`
        try:
            for _ in range(5):  # another process may take the port pair first: bounded retries
                try:
                    self.node = LocalNode(
                        key_hex, capacity="64MiB", port=_free_port_pair(), extra_args=list(extra_args)
                    )
                    break
                except RuntimeError as exc:
                    last = exc
            else:
                raise RuntimeError(f"no node in a PID namespace: {last}")
        finally:
            sys.executable = saved
        assert self.node.admin_port == self.node.port + 1, self.node.output
        self.pid = int(poll_until(self._child, 5.0, what="the node under unshare"))  # its pid out here
        self.tmp_path = tmp_path

    def _child(self) -> int | None:
        try:
            children = Path(f"/proc/{self.node.pid}/task/{self.node.pid}/children").read_text().split()
        except OSError:
            return None
        return int(children[0]) if children else None

    def run(self, argv: list[str], **env: str) -> subprocess.CompletedProcess:
        path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"  # `memkv` of this venv
        return subprocess.run(
            ["nsenter", "-t", str(self.pid), "-p", "-m", "--", *argv],
            capture_output=True,
            text=True,
            timeout=30,
            env=clean_env(self.tmp_path, PATH=path, **env),
        )

    def stop(self) -> None:
        """SIGTERM to the node itself (unshare does not pass signals on), then LocalNode.stop."""
        for sig in (signal.SIGCONT, signal.SIGTERM):
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                break
        try:
            self.node.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass  # LocalNode.stop escalates
        self.node.stop()


@pytest.fixture
def container(tmp_path, auth_key_hex):
    started: list[ContainerNode] = []

    def start(extra_args=()) -> ContainerNode:
        node = ContainerNode(tmp_path, auth_key_hex, extra_args)
        started.append(node)
        return node

    try:
        yield start
    finally:
        for node in started:
            node.stop()


def test_dockerfile_healthcheck_passes_on_a_plain_node(container):
    node = container()
    done = node.run(healthcheck_argv())
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"http://127.0.0.1:{node.node.admin_port}/v1/health: ok"


def test_dockerfile_healthcheck_passes_on_a_tls_node_with_and_without_memkv_tls_ca(container, pki):
    node = container(node_tls_args(pki))
    assert node.node.tls_port == node.node.port  # TLS-only: the admin port speaks HTTPS only
    want = f"https://127.0.0.1:{node.node.admin_port}/v1/health: ok"
    for env in ({}, {"MEMKV_TLS_CA": pki.ca}):
        done = node.run(healthcheck_argv(), **env)
        assert done.returncode == 0, (env, done.stderr)
        assert done.stdout.strip() == want
    wrong = node.run(healthcheck_argv(), MEMKV_TLS_CA=pki.other_ca)
    assert wrong.returncode == 1
    assert "https://127.0.0.1" in wrong.stderr and "CA" in wrong.stderr, wrong.stderr


def test_dockerfile_healthcheck_fails_in_time_on_a_node_that_does_not_answer(container, pki):
    node = container(node_tls_args(pki))
    os.kill(node.pid, signal.SIGSTOP)
    done = node.run(healthcheck_argv())
    assert done.returncode == 1, done.stderr
    assert "timed out" in done.stderr, done.stderr  # its own --timeout (2 s) ended the wait


def test_health_of_a_process_that_is_not_a_node_is_a_usage_error(memkv_cli):
    done = memkv_cli("health", "--pid", str(os.getpid()))
    assert done.returncode == 2
    assert b"is not `memkv serve`" in done.stderr, done.stderr
