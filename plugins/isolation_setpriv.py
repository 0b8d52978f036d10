"""Isolation ``setpriv``: the owner's uid in new pid, network, mount, IPC and UTS namespaces.

The command line is ``setpriv --pdeathsig=KILL -- unshare ... -- setpriv
... -- python runner``: the first ``setpriv`` ties ``unshare`` to the
supervisor's life; ``unshare`` (still root) creates the namespaces and mounts a ``/proc`` that
shows only the conversation's processes; ``setpriv`` then drops to the
owner's uid and gid with no supplementary groups, an empty capability
bounding set and ``no_new_privs``, and sets the parent-death signal after
the drop (a uid change clears it). The runner is the init of its pid
namespace: when it dies, the kernel kills everything it left behind. It
starts its own session.
"""

import os
import shutil

from zope.interface import implementer

from supervisor.hookspecs import hookimpl
from supervisor.interfaces import IIsolationStrategy
from supervisor.spawn import SpawnSpec


def setpriv_drop(setpriv: str, uid: int, gid: int) -> list[str]:
    """The ``setpriv`` arguments that become ``uid``/``gid`` with nothing left to escalate."""
    return [
        setpriv,
        f"--reuid={uid}",
        f"--regid={gid}",
        "--clear-groups",
        "--inh-caps=-all",
        "--bounding-set=-all",
        "--no-new-privs",
        "--pdeathsig=KILL",
        "--",
    ]


@implementer(IIsolationStrategy)
class SetprivIsolation:
    """Owner uid via setpriv, namespaces via unshare; needs root."""

    name = "setpriv"
    runs_as_owner = True

    def __init__(self):
        self.unshare = shutil.which("unshare", path="/usr/bin:/bin:/usr/sbin:/sbin")
        self.setpriv = shutil.which("setpriv", path="/usr/bin:/bin:/usr/sbin:/sbin")

    def unavailable_reason(self):
        """Why this host cannot use setpriv isolation, or None."""
        if os.geteuid() != 0:
            return "setpriv isolation needs the supervisor to run as root"
        if not self.setpriv or not self.unshare:
            return "setpriv isolation needs setpriv and unshare (util-linux)"
        return None

    def spawn_spec(self, launch):
        """``unshare`` namespaces, ``setpriv`` drop, then the runner."""
        args = [
            # unshare itself (root, the namespaces' parent) must die with the
            # supervisor: --kill-child then takes the namespace's init with it.
            self.setpriv,
            "--pdeathsig=KILL",
            "--",
            self.unshare,
            "--pid",
            "--net",
            "--ipc",
            "--uts",
            "--mount",
            "--mount-proc",
            "--fork",
            "--kill-child=SIGKILL",
            "--",
            *setpriv_drop(self.setpriv, launch.uid, launch.gid),
            *launch.runner_command(),
            "--setsid",
        ]
        return SpawnSpec(self.setpriv, tuple(args), dict(launch.env))


def _build(argument, config):
    if argument:
        raise ValueError("setpriv isolation takes no argument")
    strategy = SetprivIsolation()
    reason = strategy.unavailable_reason()
    if reason:
        raise ValueError(reason)
    return strategy


@hookimpl
def corral_isolation_strategies():
    """Offer ``setpriv``."""
    return {"setpriv": _build}
