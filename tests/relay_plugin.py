"""Test and benchmark isolation strategies that stand in for a runner at the byte level.

Loaded with ``--plugins tests.relay_plugin``. Both run as the supervisor's
own user; never use them outside tests and benchmarks.

* ``flood:BYTES``: ``dd if=/dev/zero bs=64K`` writes BYTES (a multiple of
  64 KiB) and exits. dd reopens /dev/zero as its stdin, so this "runner"
  closes its stdin first, as a real one may.
* ``deaf``: ``sleep`` that never reads its stdin.
* ``shout``: writes 10 MB of lines to stderr, then waits on stdin.
"""

from zope.interface import implementer

from supervisor.hookspecs import hookimpl
from supervisor.interfaces import IIsolationStrategy
from supervisor.spawn import SpawnSpec


@implementer(IIsolationStrategy)
class CommandIsolation:
    """Spawns a fixed command instead of a runner."""

    runs_as_owner = False

    def __init__(self, name: str, args: tuple[str, ...]):
        self.name = name
        self.args = args

    def unavailable_reason(self):
        """Always usable."""
        return None

    def spawn_spec(self, launch):
        """The fixed command, with the runner's environment."""
        return SpawnSpec(self.args[0], self.args, dict(launch.env))


def _flood(argument, config):
    size = int(argument or 1 << 30)
    args = ("/usr/bin/dd", "if=/dev/zero", "bs=64K", f"count={size // 65536}", "status=none")
    return CommandIsolation("flood", args)


@hookimpl
def corral_isolation_strategies():
    """Offer ``flood:BYTES``, ``deaf`` and ``shout``."""
    return {
        "flood": _flood,
        "deaf": lambda argument, config: CommandIsolation("deaf", ("/bin/sleep", "3600")),
        "shout": lambda argument, config: CommandIsolation(
            "shout", ("/bin/sh", "-c", "yes shouting | head -c 10000000 >&2; cat >/dev/null")
        ),
    }
