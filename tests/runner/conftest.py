"""Fixtures for the runner tests (helpers live in runner_harness.py)."""

import os
import sys

import pytest

from runner_harness import REPO_ROOT, RunnerProcess

if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


@pytest.fixture
def start_runner(tmp_path):
    """A factory: start_runner(*options) starts a runner on tmp_path/workspace."""
    runners = []
    workspace = tmp_path / "workspace"
    workspace.mkdir()

    def start(*options):
        runner = RunnerProcess(workspace, *options)
        runners.append(runner)
        return runner

    yield start
    for runner in runners:
        runner.stop()


@pytest.fixture
def runner(start_runner):
    """A runner with default options, already initialized."""
    process = start_runner()
    answer = process.call("initialize", {"protocolVersion": "2025-11-25", "capabilities": {},
                                         "clientInfo": {"name": "tests", "version": "0"}})
    assert "result" in answer, answer
    process.notify("notifications/initialized")
    return process


@pytest.fixture
def kill_leftovers():
    """Collect pids a test started; SIGKILL any still alive at the end."""
    pids = []
    yield pids
    for pid in pids:
        try:
            os.kill(pid, 9)
        except OSError:
            pass
