"""The daemon as a tree of services: a listener on the Unix socket and the runners.

``CorralService`` is a ``MultiService`` holding a
``StreamServerEndpointService``. Stopping it stops accepting, kills every
runner's process tree and fires only once they are all gone (or
``stop_timeout`` has passed, which is logged).
"""

import errno
import fcntl
import os
import signal
import socket
import stat
import time

from attrs import define, field
from twisted.application.internet import StreamServerEndpointService
from twisted.application.service import MultiService
from twisted.internet import defer
from twisted.internet.defer import DeferredList, succeed
from twisted.internet.endpoints import UNIXServerEndpoint
from twisted.logger import Logger

from supervisor import paths, sdnotify
from supervisor.audit import Auditor
from supervisor.cgroups import CgroupError, find_hierarchy
from supervisor.errors import ConfigError
from supervisor.fsutil import make_directories
from supervisor.identities import IdentityStore
from supervisor.protocol import ConversationFactory
from supervisor.spawn import install_runner_code, unreadable_ancestor
from supervisor.workspaces import WorkspaceManager

log = Logger()


@define
class Supervisor:
    """What every connection shares: configuration, plugins, identities, live connections."""

    reactor: object
    config: object
    identities: IdentityStore
    storage: object
    isolation: object
    auditor: Auditor
    runner_script: str
    privileged: bool
    cgroups: object = None
    connections: set = field(factory=set)
    #: The supervisor.workspaces.WorkspaceManager: the one caller of the storage backend.
    workspaces: object = None

    def close_connections(self, owner: str | None = None, conversation: str | None = None):
        """Abort connections (all; the owner's; or one conversation's); fires once they are closed."""
        matching = [
            c for c in self.connections
            if owner is None or (
                c.hello is not None and c.hello.owner == owner
                and (conversation is None or c.hello.conversation == conversation))
        ]
        for connection in matching:
            connection.transport.abortConnection()
        return DeferredList([c.closed for c in matching], consumeErrors=True)


def build_supervisor(reactor, config, registry) -> Supervisor:
    """Build the plugins the configuration names and the identity store (may raise ConfigError)."""
    privileged = os.geteuid() == 0
    isolation = registry.build("isolation", config.isolation, config)
    storage = registry.build("storage", config.storage, config)
    sinks = [registry.build("audit", spec, config) for spec in config.audit]
    hierarchy, reasons = find_hierarchy(config.cgroups, config.cgroup_root)
    if hierarchy is None and config.cgroups in ("v1", "v2"):
        raise ConfigError(f"cgroups = {config.cgroups!r}: " + "; ".join(reasons))
    for reason in reasons:
        log.warn("cgroups: {reason}", reason=reason)
    if hierarchy is None and config.cgroups == "auto":
        log.warn(
            "no cgroup can be used: conversations have no memory or process limits; "
            "runners are still killed through their pid namespace"
        )
    supervisor = Supervisor(
        reactor=reactor,
        config=config,
        identities=IdentityStore(config.workspace_root, config.uid_range, privileged),
        storage=storage,
        isolation=isolation,
        auditor=Auditor(sinks),
        runner_script="",
        privileged=privileged,
        cgroups=hierarchy,
    )
    supervisor.workspaces = WorkspaceManager(
        reactor, config, storage, supervisor.auditor, supervisor.identities
    )
    supervisor.workspaces.close_connections = supervisor.close_connections
    return supervisor


def prepare_directories(config) -> None:
    """Create the state and workspace directories with modes every owner uid can traverse."""
    for path in (config.state_dir, config.workspace_root):
        make_directories(path, 0o711)
    if os.geteuid() == 0:
        os.chmod(config.workspace_root, 0o711)
        for path in (config.workspace_root, config.state_dir):
            blocked = unreadable_ancestor(os.path.join(path, "x"))
            if blocked:
                raise ConfigError(
                    f"{path} is below {blocked}, which owner uids cannot traverse "
                    "(it lacks the x bit for others); choose a state_dir and "
                    "workspace_root outside it, or chmod o+x it"
                )


def check_own_directory(directory: str) -> None:
    """Refuse a socket directory that is a symlink or belongs to someone else.

    Without root the default is /tmp/corral-<uid>/, which another local user
    could create first to swap the socket under us.
    """
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise ConfigError(
            f"the socket directory {directory} is not a directory owned by uid "
            f"{os.geteuid()} (it is owned by uid {st.st_uid}); someone else may have "
            "created it: remove it, or choose another socket"
        )


def prepare_socket(config) -> None:
    """Make the socket's directory, and remove a stale socket a crashed supervisor left.

    A socket that still answers means another supervisor is running: that
    stops start-up.
    """
    path = config.socket
    directory = os.path.dirname(path)
    created = not os.path.lexists(directory)
    if created:
        make_directories(directory, 0o750)
    if created or directory == paths.runtime_dir():
        # Permissions belong on the socket's directory: only root and the
        # socket group may reach the socket. A directory corral did not make
        # for itself (/run, a home) is left as the operator has it.
        check_own_directory(directory)
        if os.geteuid() == 0:
            os.chown(directory, 0, config.socket_group)
        os.chmod(directory, 0o750)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ConfigError(f"socket = {path!r} exists and is not a socket; remove it or choose another path")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(2)
    try:
        probe.connect(path)
    except OSError as e:
        if e.errno not in (errno.ECONNREFUSED, errno.ENOENT):
            raise ConfigError(f"cannot check the existing socket {path}: {e.strerror}") from None
        os.unlink(path)
    else:
        raise ConfigError(
            f"another supervisor is already listening on {path}; stop it first "
            "or choose another socket"
        )
    finally:
        probe.close()


def recover_leftovers(supervisor: Supervisor, config) -> None:
    """Kill what a crashed supervisor left: runners, and conversations' cgroups.

    Runners die with their supervisor (parent-death signal, pid namespace),
    so there is normally nothing; this is the belt to those braces. Blocking,
    at start-up only.
    """
    runner_dir = os.path.join(config.state_dir, "runner") + os.sep
    killed = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                arguments = f.read().split(b"\0")
        except OSError:
            continue
        if any(a.startswith(runner_dir.encode()) for a in arguments):
            try:
                os.kill(int(entry), signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
    if killed:
        log.warn("killed {count} runners a previous supervisor left behind", count=killed)
    hierarchy = supervisor.cgroups
    if hierarchy is None:
        return
    for cgroup in hierarchy.leftovers():
        deadline = time.monotonic() + config.stop_timeout
        while cgroup.populated() and time.monotonic() < deadline:
            cgroup.kill()
            time.sleep(0.01)
        try:
            cgroup.remove()
        except OSError as e:
            log.error(
                "could not remove the leftover cgroup {name}: {error}",
                name=cgroup.name,
                error=e.strerror,
            )
            continue
        log.warn("removed the leftover cgroup {name} of a previous supervisor", name=cgroup.name)


class CorralService(MultiService):
    """The supervisor daemon: listens, serves conversations, and stops cleanly."""

    log = Logger()

    def __init__(self, reactor, config, registry):
        super().__init__()
        self.reactor = reactor
        self.config = config
        prepare_directories(config)
        self.supervisor = build_supervisor(reactor, config, registry)
        endpoint = UNIXServerEndpoint(reactor, config.socket, mode=0o660, wantPID=False)
        self.listener = StreamServerEndpointService(
            endpoint, ConversationFactory(self.supervisor)
        )
        self.listener._raiseSynchronously = True
        self.listener.setServiceParent(self)

    def prepare(self) -> None:
        """Blocking start-up work done before the reactor runs."""
        prepare_socket(self.config)
        self._lock_state_dir()
        self.supervisor.runner_script = install_runner_code(
            self.config.state_dir, self.config.runner_python
        )
        removed = self.supervisor.identities.remove_leftovers()
        if removed:
            self.log.info("removed {count} half-created owner directories", count=len(removed))
        hierarchy = self.supervisor.cgroups
        if hierarchy is not None:
            try:
                hierarchy.prepare()
            except (OSError, CgroupError) as e:
                raise ConfigError(f"cgroups: cannot prepare {hierarchy.describe()}: {e}") from None
            self.log.info("conversations' cgroups: {where}", where=hierarchy.describe())
        recover_leftovers(self.supervisor, self.config)

    def _lock_state_dir(self) -> None:
        """Hold ``<state_dir>/supervisor.lock`` for as long as this process lives.

        Start-up kills runners and cgroups a crashed supervisor left behind;
        with two supervisors on one state directory it would kill the other's.
        """
        path = os.path.join(self.config.state_dir, "supervisor.lock")
        self._state_lock = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self._state_lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._state_lock)
            raise ConfigError(
                f"another supervisor is already using state_dir {self.config.state_dir}; "
                "stop it, or give this one its own state_dir"
            ) from None

    def startService(self):
        """Listen, set the socket's owner and mode, and tell systemd we are ready."""
        super().startService()
        if os.geteuid() == 0:
            os.chown(self.config.socket, 0, self.config.socket_group)
        os.chmod(self.config.socket, 0o660)
        supervisor = self.supervisor
        if not supervisor.privileged:
            self.log.warn(
                "not running as root: every runner runs as uid {uid}, the supervisor's own",
                uid=os.getuid(),
            )
        self.log.info(
            "corral listening on {socket}: isolation {isolation}, storage {storage}, "
            "workspaces in {root}",
            socket=self.config.socket,
            isolation=supervisor.isolation.name,
            storage=supervisor.storage.name,
            root=self.config.workspace_root,
        )
        supervisor.workspaces.start()
        sdnotify.notify("READY=1\nSTATUS=listening on " + self.config.socket)

    def stopService(self):
        """Stop accepting, kill every runner, wait for them, then close the audit sinks."""
        sdnotify.notify("STOPPING=1")
        self.supervisor.workspaces.stop()
        listening_stopped = super().stopService() or succeed(None)
        return listening_stopped.addCallback(lambda _: self._stop_connections())

    def _stop_connections(self):
        self.log.info("stopping {count} connections", count=len(self.supervisor.connections))
        all_closed = self.supervisor.close_connections()
        finished = defer.Deferred()
        timer = self.reactor.callLater(self.config.stop_timeout, self._stop_timed_out, finished)

        def closed(_):
            if timer.active():
                timer.cancel()
                finished.callback(None)

        all_closed.addCallback(closed)
        return finished.addCallback(self._stopped)

    def _stop_timed_out(self, finished):
        left = sorted(c.connection_id for c in self.supervisor.connections)
        self.log.error(
            "runners of connections {left} did not die within {timeout} s; exiting anyway",
            left=left,
            timeout=self.config.stop_timeout,
        )
        finished.callback(None)

    def _stopped(self, _):
        try:
            os.unlink(self.config.socket)
        except OSError:
            pass
        close_storage = getattr(self.supervisor.storage, "close", None)
        if close_storage is not None:
            close_storage()
        return self.supervisor.auditor.close()
