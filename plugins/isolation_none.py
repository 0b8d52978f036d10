"""Isolation ``none``: the runner runs as the supervisor's own user. For development."""

from twisted.logger import Logger
from zope.interface import implementer

from supervisor.hookspecs import hookimpl
from supervisor.interfaces import IIsolationStrategy
from supervisor.spawn import SpawnSpec

log = Logger()


@implementer(IIsolationStrategy)
class NoIsolation:
    """No namespaces and no uid drop: the runner is the supervisor's user, network included."""

    name = "none"
    runs_as_owner = False

    def unavailable_reason(self):
        """Always usable."""
        return None

    def spawn_spec(self, launch):
        """Run the runner directly; it chdirs to the workspace and starts its own session."""
        command = [*launch.runner_command(), "--setsid"]
        return SpawnSpec(command[0], tuple(command), dict(launch.env))


def _build(argument, config):
    import os

    if config.conversation_sharing != "owner":
        raise ValueError("conversation_sharing = 'private' needs bwrap isolation")

    if os.geteuid() == 0:
        log.warn(
            "isolation 'none' as root: tenants' commands run as root with the "
            "network; use it only for development"
        )
    else:
        log.warn(
            "isolation 'none': runners run as uid {uid} with the network and "
            "without namespaces",
            uid=os.geteuid(),
        )
    return NoIsolation()


@hookimpl
def corral_isolation_strategies():
    """Offer ``none``."""
    return {"none": _build}
