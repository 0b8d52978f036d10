"""Fixtures of the attack suite: supervisors set up the way an attack needs them.

The suite-wide fixtures (``start_supervisor``, ``isolation``, ``supervisor``)
come from ``tests/conftest.py``; every test here runs under both ``setpriv``
and ``bwrap`` as root.
"""

import pytest

from tests.support import RunningSupervisor

#: Limits the resource attacks run against: small enough to hit in a second.
LIMIT_ARGS = ["--memory-limit", "128M", "--pids-limit", "64"]


@pytest.fixture
def limited_supervisor(start_supervisor, isolation):
    """A supervisor whose conversations have 128 MiB of memory and 64 processes."""
    return start_supervisor(isolation, extra_args=LIMIT_ARGS)


@pytest.fixture
def make_supervisor():
    """Build ``corral serve`` processes a test starts itself (after changing their command).

    Every one is stopped and its files removed afterwards.
    """
    made = []

    def make(isolation, extra_args=(), env=None, base=None):
        supervisor = RunningSupervisor(isolation, extra_args, env, base=base)
        made.append(supervisor)
        return supervisor

    yield make
    for supervisor in made:
        supervisor.cleanup()
