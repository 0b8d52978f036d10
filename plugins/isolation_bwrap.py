"""Isolation ``bwrap``: bubblewrap sandbox running with the owner's real uid.

As root, ``setpriv`` first drops to the owner's uid (no groups, no
capabilities, ``no_new_privs``); bubblewrap then runs unprivileged and builds
the sandbox in a user namespace that maps the owner's uid to itself, so the
host sees the tenant's uid, never root (``bwrap --unshare-user`` started as
root would leave host uid 0). Inside: a read-only system, the workspace
bound read-write at its own path, a private, size-capped ``/tmp`` and
``/dev/shm``, new pid, network, IPC
and UTS namespaces, ``--disable-userns`` against nested user namespaces,
``--die-with-parent`` and ``--new-session``. Without root, the same sandbox
runs as the supervisor's user.
"""

import os
import shutil
import subprocess

from zope.interface import implementer

from plugins.isolation_setpriv import setpriv_drop
from supervisor.hookspecs import hookimpl
from supervisor.interfaces import IIsolationStrategy
from supervisor.spawn import SpawnSpec

_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
#: The uid the usability probe runs as when the supervisor is root.
PROBE_UID = 65534


def _system_binds() -> list[str]:
    args = []
    for path in _SYSTEM_DIRS:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    return args


@implementer(IIsolationStrategy)
class BwrapIsolation:
    """Bubblewrap with the owner's uid; usable when unprivileged user namespaces are."""

    name = "bwrap"
    runs_as_owner = True

    def __init__(self):
        search = "/usr/bin:/bin:/usr/sbin:/sbin"
        self.bwrap = shutil.which("bwrap", path=search)
        self.setpriv = shutil.which("setpriv", path=search)
        self.env = shutil.which("env", path=search) or "/usr/bin/env"
        self.privileged = os.geteuid() == 0
        self._binds = _system_binds()
        self._reason = self._probe()

    def _sandbox(
        self,
        uid: int,
        gid: int,
        workspace: str,
        extra_ro: list[str],
        bind: str | None = None,
        tmp_size: int = 1 << 30,
    ) -> list[str]:
        args = [
            self.bwrap,
            "--unshare-user",
            "--uid",
            str(uid),
            "--gid",
            str(gid),
            "--disable-userns",
            "--unshare-pid",
            "--unshare-net",
            "--unshare-ipc",
            "--unshare-uts",
            "--hostname",
            "corral",
            "--die-with-parent",
            "--new-session",
            *self._binds,
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--size",
            str(tmp_size),
            "--tmpfs",
            "/tmp",
            "--size",
            str(tmp_size),
            "--tmpfs",
            "/dev/shm",
        ]
        for path in extra_ro:
            args += ["--ro-bind", path, path]
        bind = bind or workspace
        # bwrap always exports PWD, after every option is applied; ``env -u``
        # keeps the runner's environment exactly what the supervisor gave.
        args += ["--bind", bind, bind, "--chdir", workspace, "--", self.env, "-u", "PWD"]
        if self.privileged:
            args = setpriv_drop(self.setpriv, uid, gid) + args
        return args

    def _probe(self):
        if not self.bwrap:
            return "bubblewrap (bwrap) is not installed; apt-get install bubblewrap"
        if self.privileged and not self.setpriv:
            return "bwrap isolation as root needs setpriv (util-linux)"
        uid = PROBE_UID if self.privileged else os.getuid()
        gid = PROBE_UID if self.privileged else os.getgid()
        command = self._sandbox(uid, gid, "/tmp", []) + ["/bin/true"]
        try:
            result = subprocess.run(
                command, capture_output=True, timeout=10, env={}, cwd="/"
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"bwrap could not run: {e}"
        if result.returncode != 0:
            message = result.stderr.decode("utf-8", "replace").strip()
            return (
                f"bwrap cannot build a sandbox here ({message}); unprivileged "
                "user namespaces may be disabled (sysctl kernel.unprivileged_userns_clone, "
                "user.max_user_namespaces, or an AppArmor restriction)"
            )
        return None

    def unavailable_reason(self):
        """Why bubblewrap cannot sandbox runners on this host, or None."""
        return self._reason

    def spawn_spec(self, launch):
        """``[setpriv drop --] bwrap SANDBOX -- runner``."""
        # By default the owner's whole directory is bound, so conversations of
        # one owner see each other as they would under setpriv (DESIGN.md: they
        # share a uid); conversation_sharing = "private" binds only this one.
        # bwrap resolves the bind as the owner's uid, never as root.
        shared = launch.sharing == "owner"
        args = self._sandbox(
            launch.uid,
            launch.gid,
            launch.workspace,
            [launch.runner_dir, *launch.readable_files],
            bind=os.path.dirname(launch.workspace) if shared else launch.workspace,
            tmp_size=launch.tmp_size,
        )
        args += launch.runner_command()
        return SpawnSpec(args[0], tuple(args), dict(launch.env))


def _build(argument, config):
    if argument:
        raise ValueError("bwrap isolation takes no argument")
    strategy = BwrapIsolation()
    reason = strategy.unavailable_reason()
    if reason:
        raise ValueError(reason)
    return strategy


@hookimpl
def corral_isolation_strategies():
    """Offer ``bwrap``."""
    return {"bwrap": _build}
