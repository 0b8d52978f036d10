"""Isolation ``setpriv``: the owner's uid in new pid, network, mount, IPC and UTS namespaces.

The command line is ``setpriv --pdeathsig=KILL -- unshare ... -- setpriv
... -- python runner``: the first ``setpriv`` ties ``unshare`` to the
supervisor's life; ``unshare`` (still root) creates the namespaces and mounts a ``/proc`` that
shows only the conversation's processes; ``setpriv`` then drops to the
owner's uid and gid with no supplementary groups, an empty capability
bounding set and ``no_new_privs``, and sets the parent-death signal after
the drop (a uid change clears it). Between the two, a shell mounts a
private, size-capped tmpfs on ``/tmp``, ``/var/tmp``, ``/dev/shm`` and
``/run/lock`` (the host's world-writable directories) in the new mount
namespace. The runner is the init of its pid namespace: when it dies, the
kernel kills everything it left behind. It starts its own session.
"""

import os
import shutil

from zope.interface import implementer

from supervisor.hookspecs import hookimpl
from supervisor.interfaces import IIsolationStrategy
from supervisor.spawn import SpawnSpec


#: The host's world-writable directories: each conversation gets a private
#: tmpfs on every one that exists, so none is a channel between tenants.
#: /tmp and /dev/shm get the conversation's tmp size; the others a little.
PRIVATE_DIRS = ("/tmp", "/dev/shm", "/var/tmp", "/run/lock")
SMALL_TMPFS = 16 << 20

_PRIVATE_TMP = (
    'size="$1"; small="$2"; shift 2; '
    "for dir in " + " ".join(PRIVATE_DIRS) + "; do "
    '[ -d "$dir" ] || continue; '
    'case "$dir" in /tmp|/dev/shm) s="$size";; *) s="$small";; esac; '
    'mount -t tmpfs -o "size=$s,mode=1777,nosuid,nodev" corral-tmp "$dir" || exit 125; '
    "done; "
    # The shell exports a PWD of its own; the runner's environment is ours alone.
    'unset PWD OLDPWD; exec "$@"'
)


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
            # Still root, in the new mount namespace: a private, size-capped
            # /tmp and /dev/shm that vanish with the namespace.
            "/bin/sh",
            "-c",
            _PRIVATE_TMP,
            "corral-tmp",
            str(launch.tmp_size),
            str(SMALL_TMPFS),
            *setpriv_drop(self.setpriv, launch.uid, launch.gid),
            *launch.runner_command(),
            "--setsid",
        ]
        return SpawnSpec(self.setpriv, tuple(args), dict(launch.env))


def _build(argument, config):
    if argument:
        raise ValueError("setpriv isolation takes no argument")
    if config.conversation_sharing != "owner":
        raise ValueError(
            "conversation_sharing = 'private' needs bwrap isolation: under setpriv an "
            "owner's conversations share one uid and one view of the file system"
        )
    for key in ("state_dir", "workspace_root"):
        path = getattr(config, key)
        if any(path == d or path.startswith(d + "/") for d in PRIVATE_DIRS):
            raise ValueError(
                f"{key} {path} is under {' or '.join(PRIVATE_DIRS)}, which each "
                "conversation gets a private copy of under setpriv, hiding it; "
                "choose a directory elsewhere (such as /var/lib/corral)"
            )
    strategy = SetprivIsolation()
    reason = strategy.unavailable_reason()
    if reason:
        raise ValueError(reason)
    return strategy


@hookimpl
def corral_isolation_strategies():
    """Offer ``setpriv``."""
    return {"setpriv": _build}
