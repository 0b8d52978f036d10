"""Suite-wide rules: root tests run as root; under CI nothing may skip."""

import os

import pytest
from hypothesis import settings

from tests.support import IS_ROOT, RunningSupervisor

IN_CI = bool(os.environ.get("CI"))

# Time limits per example make property tests fail on a loaded 2-core host,
# not on wrong behaviour; the tests bound their inputs instead.
settings.register_profile("corral", deadline=None)
settings.load_profile("corral")


def pytest_collection_modifyitems(config, items):
    """Skip tests marked ``root`` when not root (an error instead when CI is set)."""
    if IS_ROOT:
        return
    for item in items:
        if item.get_closest_marker("root"):
            item.add_marker(pytest.mark.skip(reason="needs root"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under CI (``CI`` set) a skipped test is a failure: CI runs as root and must run everything."""
    outcome = yield
    report = outcome.get_result()
    if IN_CI and report.skipped and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        report.longrepr = f"skipped under CI, which must run every test: {report.longrepr}"


def isolations() -> list[str]:
    """The isolation strategies integration tests run under: both real ones as root."""
    return ["setpriv", "bwrap"] if IS_ROOT or IN_CI else ["none"]


@pytest.fixture
def start_supervisor():
    """Start real ``corral serve`` processes; every one is stopped and removed afterwards."""
    started = []

    def start(isolation="none", extra_args=(), env=None):
        supervisor = RunningSupervisor(isolation, extra_args, env)
        started.append(supervisor)
        return supervisor.start()

    yield start
    for supervisor in started:
        supervisor.cleanup()


@pytest.fixture(params=isolations())
def isolation(request):
    """Each isolation strategy the host supports (setpriv and bwrap as root)."""
    return request.param


@pytest.fixture
def supervisor(start_supervisor, isolation):
    """One running supervisor under the parametrised isolation strategy."""
    return start_supervisor(isolation)
