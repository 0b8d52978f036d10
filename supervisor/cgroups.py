"""Per-conversation cgroups: limits, a kill nothing escapes, and an emptiness check.

Every runner runs inside a cgroup of its own, created before the runner is
spawned. Moving a process into a cgroup waits for an RCU grace period
(~10 ms here), so it is not done on the way to the runner's first answer:
the supervisor spawns the runner, then moves the whole spawned tree (the
isolation's helpers and the runner) into the cgroup from a thread while the
runner's interpreter starts, and holds the client's bytes back until that
is done. The runner starts no process before it reads a request, so no
tenant code ever runs outside the cgroup; everything started later is born
inside.

Two hierarchies are supported:

* **cgroup v2**: under systemd with ``Delegate=yes`` the supervisor's own
  cgroup is the delegated subtree: the supervisor moves itself into a
  ``supervisor`` leaf (v2 allows no processes in a cgroup that hands out
  controllers) and creates conversations beside it. On a plain v2 mount it
  uses ``<mount>/corral``. Limits: ``memory.max`` with ``memory.swap.max``
  0 (so the limit covers swap too), ``pids.max``, ``cpu.weight``,
  ``cpu.max``. Kill: ``cgroup.kill``, else freeze, SIGKILL, thaw.
* **cgroup v1** (hybrid hosts whose v2 mount has no controllers): one
  directory per controller, ``memory`` (``memory.limit_in_bytes`` and,
  where swap accounting is on, ``memory.memsw.limit_in_bytes``), ``pids``,
  ``freezer`` (and ``cpu`` when a CPU setting is given). Kill: freeze,
  SIGKILL, thaw.

The file writes are a few small writes to a kernel file system; they run on
the reactor thread. Waiting for a cgroup to become empty is asynchronous.
"""

import os
import signal

from twisted.internet.defer import Deferred
from twisted.internet.task import LoopingCall

from supervisor import proctree

#: The leaf the supervisor moves itself into inside a delegated v2 subtree.
SUPERVISOR_LEAF = "supervisor"
#: While waiting for a killed cgroup to empty, how often to kill again
#: (a process that was mid-fork when the freezer was set may appear late).
REKILL_SECONDS = 0.1


class CgroupError(Exception):
    """A cgroup could not be set up; the message says what to do."""


def _write(path: str, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode("ascii"))
    finally:
        os.close(fd)


def _read(path: str) -> str:
    with open(path, encoding="ascii") as f:
        return f.read()


def _pids(procs_file: str) -> list[int]:
    try:
        return [int(line) for line in _read(procs_file).split()]
    except FileNotFoundError:
        return []


def _kill_all(procs_file: str) -> int:
    killed = 0
    for pid in _pids(procs_file):
        try:
            os.kill(pid, signal.SIGKILL)
            killed += 1
        except ProcessLookupError:
            pass
    return killed


def _freeze_kill_thaw(freezer: str, frozen: str, thawed: str, procs_file: str) -> int:
    """Freeze a cgroup, SIGKILL everything in it, thaw it: a frozen process cannot fork away.

    Killed processes die once thawed. One that was mid-fork when the
    freezer was set may appear after the kill: callers kill again until the
    cgroup is empty (``ConversationCgroup.wait_empty``).
    """
    try:
        _write(freezer, frozen)
        return _kill_all(procs_file)
    finally:
        try:
            _write(freezer, thawed)
        except FileNotFoundError:
            pass


def _mounts() -> list[tuple[str, str, set[str]]]:
    """(mount point, file system type, super options) of every cgroup mount."""
    found = []
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        for line in f:
            before, _, after = line.partition(" - ")
            fields = before.split()
            fstype, _, super_options = after.split()[:3]
            if fstype in ("cgroup", "cgroup2"):
                point = fields[4].replace("\\040", " ")
                found.append((point, fstype, set(super_options.split(","))))
    return found


def _own_cgroups() -> dict[str, str]:
    """This process's cgroup path per hierarchy: '' for v2, else the controller list."""
    paths = {}
    with open("/proc/self/cgroup", encoding="utf-8") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            paths[controllers] = path
    return paths


class ConversationCgroup:
    """One conversation's cgroup, in one directory per hierarchy (v2: one; v1: several)."""

    def __init__(self, hierarchy, name: str, directories: list[str]):
        self.hierarchy = hierarchy
        self.name = name
        self.directories = directories

    @property
    def procs_files(self) -> list[str]:
        """The ``cgroup.procs`` files a process writes itself into to join."""
        return [os.path.join(d, "cgroup.procs") for d in self.directories]

    def adopt(self, pid: int, max_rounds: int = 20) -> int:
        """Move ``pid`` and every descendant into this cgroup; return how many moved.

        Blocking (each first move waits for an RCU grace period, ~10 ms), so
        it runs in a thread while the runner starts. A process forked by a
        process already moved is born inside; one forked just before its
        parent moved shows up in the next round, so the rounds go on until
        a round finds nobody new.
        """
        moved: set[int] = set()
        for _ in range(max_rounds):
            fresh = [p for p in [pid, *proctree.descendants(pid)] if p not in moved]
            if not fresh:
                return len(moved)
            for process in fresh:
                for procs in self.procs_files:
                    try:
                        _write(procs, str(process))
                    except ProcessLookupError:
                        break
                    except FileNotFoundError:
                        if not os.path.isdir(os.path.dirname(procs)):
                            return len(moved)  # the conversation closed and removed it
                        raise
                moved.add(process)
        raise CgroupError(f"processes under {pid} kept appearing; cannot place them all")

    def kill(self) -> int:
        """SIGKILL every process in the cgroup, so that none can fork away; return the count."""
        return self.hierarchy.kill(self)

    def populated(self) -> bool:
        """Whether any process is still in the cgroup."""
        return self.hierarchy.populated(self)

    def oom_kills(self) -> int:
        """How many processes the kernel's OOM killer killed in this cgroup."""
        return self.hierarchy.oom_kills(self)

    def oom_events_file(self) -> str | None:
        """The file with this cgroup's ``oom_kill`` count, for the runner to watch."""
        return self.hierarchy.oom_events_file(self)

    def remove(self) -> None:
        """Remove the cgroup's directories (they must be empty of processes)."""
        for directory in self.directories:
            try:
                os.rmdir(directory)
            except FileNotFoundError:
                pass

    def wait_empty(self, reactor, timeout: float, interval: float = 0.01) -> Deferred:
        """A Deferred firing True once the cgroup is empty, False after ``timeout`` seconds.

        Killed processes take a moment to exit; one that was mid-fork when
        the cgroup was frozen may appear after the kill, so every
        REKILL_SECONDS whatever is left is killed again.
        """
        done = Deferred()
        started = reactor.seconds()
        last_kill = [started]

        def check():
            now = reactor.seconds()
            if not self.populated():
                loop.stop()
                done.callback(True)
            elif now - started >= timeout:
                loop.stop()
                done.callback(False)
            elif now - last_kill[0] >= REKILL_SECONDS:
                last_kill[0] = now
                self.kill()

        loop = LoopingCall(check)
        loop.clock = reactor
        loop.start(interval, now=True)
        return done


class CgroupV2:
    """Conversations' cgroups under one directory of a cgroup2 mount."""

    version = "v2"

    def __init__(self, mount: str, base: str, move_self: bool):
        self.mount = mount
        self.base = base
        self.move_self = move_self
        self.controllers: set[str] = set()

    def describe(self) -> str:
        """One line for logs and ``corral check``."""
        return f"cgroup v2 at {self.base} (controllers: {' '.join(sorted(self.controllers))})"

    def prepare(self) -> None:
        """Create the base, move the supervisor into its leaf if needed, enable controllers."""
        if not self.move_self:
            # The parent must hand the controllers down to our base (the
            # root cgroup may hold processes and still do so).
            parent = os.path.dirname(self.base)
            available = set(_read(os.path.join(parent, "cgroup.controllers")).split())
            wanted = {"memory", "pids", "cpu"} & available
            try:
                if wanted:
                    _write(
                        os.path.join(parent, "cgroup.subtree_control"),
                        " ".join(f"+{c}" for c in sorted(wanted)),
                    )
            except OSError as e:
                raise CgroupError(
                    f"cannot enable the controllers {' '.join(sorted(wanted))} in {parent}: "
                    f"{e.strerror}; set cgroup_root to a delegated subtree"
                ) from None
        os.makedirs(self.base, exist_ok=True)
        if self.move_self:
            leaf = os.path.join(self.base, SUPERVISOR_LEAF)
            os.makedirs(leaf, exist_ok=True)
            # Every process of the supervisor's cgroup goes (a launcher, a
            # shell): v2 hands controllers only to cgroups without processes.
            for pid in _pids(os.path.join(self.base, "cgroup.procs")):
                try:
                    _write(os.path.join(leaf, "cgroup.procs"), str(pid))
                except ProcessLookupError:
                    pass
        available = set(_read(os.path.join(self.base, "cgroup.controllers")).split())
        wanted = {"memory", "pids", "cpu"} & available
        if wanted:
            _write(
                os.path.join(self.base, "cgroup.subtree_control"),
                " ".join(f"+{c}" for c in sorted(wanted)),
            )
        self.controllers = set(_read(os.path.join(self.base, "cgroup.subtree_control")).split())

    def create(self, name: str, limits: dict) -> ConversationCgroup:
        """Make the conversation's cgroup and set its limits."""
        directory = os.path.join(self.base, name)
        os.mkdir(directory)
        cgroup = ConversationCgroup(self, name, [directory])
        try:
            settings = []
            if limits.get("memory_limit") is not None and "memory" in self.controllers:
                settings += [("memory.max", str(limits["memory_limit"])), ("memory.swap.max", "0")]
            if limits.get("pids_limit") is not None and "pids" in self.controllers:
                settings.append(("pids.max", str(limits["pids_limit"])))
            if "cpu" in self.controllers:
                if limits.get("cpu_weight") is not None:
                    settings.append(("cpu.weight", str(limits["cpu_weight"])))
                if limits.get("cpu_limit") is not None:
                    settings.append(("cpu.max", f"{round(limits['cpu_limit'] * 100000)} 100000"))
            for filename, value in settings:
                path = os.path.join(directory, filename)
                if filename == "memory.swap.max" and not os.path.exists(path):
                    continue  # no swap accounting: memory.max is the whole limit
                _write(path, value)
        except BaseException:
            cgroup.remove()
            raise
        return cgroup

    def kill(self, cgroup: ConversationCgroup) -> int:
        """``cgroup.kill`` where the kernel has it (5.14+), else freeze, SIGKILL, thaw."""
        directory = cgroup.directories[0]
        procs = os.path.join(directory, "cgroup.procs")
        count = len(_pids(procs))
        kill_file = os.path.join(directory, "cgroup.kill")
        try:
            _write(kill_file, "1")
            return count
        except FileNotFoundError:
            if not os.path.isdir(directory):
                return 0
        return _freeze_kill_thaw(os.path.join(directory, "cgroup.freeze"), "1", "0", procs)

    def populated(self, cgroup: ConversationCgroup) -> bool:
        """``populated 1`` in ``cgroup.events``."""
        try:
            events = _read(os.path.join(cgroup.directories[0], "cgroup.events"))
        except FileNotFoundError:
            return False
        return "populated 1" in events.splitlines()

    def oom_kills(self, cgroup: ConversationCgroup) -> int:
        """``oom_kill`` in ``memory.events``."""
        return _event_count(os.path.join(cgroup.directories[0], "memory.events"), "oom_kill")

    def leftovers(self) -> list[ConversationCgroup]:
        """Conversation cgroups a previous supervisor left under the base."""
        return [
            ConversationCgroup(self, name, [os.path.join(self.base, name)])
            for name in _subdirectories(self.base)
            if name != SUPERVISOR_LEAF
        ]

    def oom_events_file(self, cgroup: ConversationCgroup) -> str | None:
        """The file whose ``oom_kill`` count the runner watches."""
        path = os.path.join(cgroup.directories[0], "memory.events")
        return path if "memory" in self.controllers else None


class CgroupV1:
    """Conversations' cgroups under ``<root>`` of each v1 controller's mount."""

    version = "v1"

    def __init__(self, mounts: dict[str, str], root: str):
        self.mounts = mounts
        self.root = root

    def describe(self) -> str:
        """One line for logs and ``corral check``."""
        return "cgroup v1 (" + ", ".join(
            f"{c} at {os.path.join(m, self.root.lstrip('/'))}" for c, m in sorted(self.mounts.items())
        ) + ")"

    def _base(self, controller: str) -> str:
        return os.path.join(self.mounts[controller], self.root.lstrip("/"))

    def prepare(self) -> None:
        """Create the corral directory under every controller."""
        for controller in self.mounts:
            os.makedirs(self._base(controller), exist_ok=True)

    def create(self, name: str, limits: dict) -> ConversationCgroup:
        """Make the conversation's directory under each controller and set its limits."""
        controllers = ["memory", "pids", "freezer"]
        if "cpu" in self.mounts and (
            limits.get("cpu_weight") is not None or limits.get("cpu_limit") is not None
        ):
            controllers.append("cpu")
        directories = []
        cgroup = ConversationCgroup(self, name, directories)
        try:
            for controller in controllers:
                directory = os.path.join(self._base(controller), name)
                os.mkdir(directory)
                directories.append(directory)
            memory = os.path.join(self._base("memory"), name)
            if limits.get("memory_limit") is not None:
                _write(os.path.join(memory, "memory.limit_in_bytes"), str(limits["memory_limit"]))
                memsw = os.path.join(memory, "memory.memsw.limit_in_bytes")
                if os.path.exists(memsw):
                    _write(memsw, str(limits["memory_limit"]))
            if limits.get("pids_limit") is not None:
                _write(os.path.join(self._base("pids"), name, "pids.max"), str(limits["pids_limit"]))
            if "cpu" in controllers:
                cpu = os.path.join(self._base("cpu"), name)
                if limits.get("cpu_weight") is not None:
                    shares = max(2, round(limits["cpu_weight"] * 1024 / 100))
                    _write(os.path.join(cpu, "cpu.shares"), str(shares))
                if limits.get("cpu_limit") is not None:
                    _write(os.path.join(cpu, "cpu.cfs_period_us"), "100000")
                    _write(os.path.join(cpu, "cpu.cfs_quota_us"), str(round(limits["cpu_limit"] * 100000)))
        except BaseException:
            cgroup.remove()
            raise
        return cgroup

    def _directory(self, cgroup: ConversationCgroup, controller: str) -> str:
        return os.path.join(self._base(controller), cgroup.name)

    def kill(self, cgroup: ConversationCgroup) -> int:
        """Freeze, SIGKILL every process, thaw: a frozen process cannot fork away."""
        freezer = os.path.join(self._directory(cgroup, "freezer"), "freezer.state")
        procs = os.path.join(self._directory(cgroup, "freezer"), "cgroup.procs")
        if not os.path.exists(freezer):
            return 0
        return _freeze_kill_thaw(freezer, "FROZEN", "THAWED", procs)

    def populated(self, cgroup: ConversationCgroup) -> bool:
        """Any process left in any of the conversation's directories."""
        return any(_pids(f) for f in cgroup.procs_files)

    def oom_kills(self, cgroup: ConversationCgroup) -> int:
        """``oom_kill`` in ``memory.oom_control`` (kernels since 4.13)."""
        return _event_count(
            os.path.join(self._directory(cgroup, "memory"), "memory.oom_control"), "oom_kill"
        )

    def leftovers(self) -> list[ConversationCgroup]:
        """Conversation cgroups a previous supervisor left, under any controller."""
        names = set()
        for controller in self.mounts:
            names.update(_subdirectories(self._base(controller)))
        return [
            ConversationCgroup(
                self,
                name,
                [
                    os.path.join(self._base(c), name)
                    for c in self.mounts
                    if os.path.isdir(os.path.join(self._base(c), name))
                ],
            )
            for name in sorted(names)
        ]

    def oom_events_file(self, cgroup: ConversationCgroup) -> str | None:
        """The file whose ``oom_kill`` count the runner watches."""
        return os.path.join(self._directory(cgroup, "memory"), "memory.oom_control")


def _event_count(path: str, key: str) -> int:
    try:
        for line in _read(path).splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (FileNotFoundError, ValueError):
        pass
    return 0


def _subdirectories(path: str) -> list[str]:
    try:
        return [e.name for e in os.scandir(path) if e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return []


def _writable(path: str) -> bool:
    return os.access(path, os.W_OK)


def find_hierarchy(mode: str = "auto", root: str | None = None):
    """The cgroup hierarchy to use, and a sentence on why others were passed over.

    ``mode`` is the ``cgroups`` setting: auto, v2, v1 or off. Returns
    ``(hierarchy or None, reasons)``; None means no cgroup can be used here.
    """
    reasons: list[str] = []
    if mode == "off":
        return None, ["cgroups = off"]
    if os.geteuid() != 0:
        return None, ["cgroups need the supervisor to run as root"]
    try:
        mounts = _mounts()
        own = _own_cgroups()
    except OSError as e:
        return None, [f"cannot read the cgroup mounts: {e.strerror}"]
    if mode in ("auto", "v2"):
        hierarchy, reason = _find_v2(mounts, own, root)
        if hierarchy is not None:
            return hierarchy, reasons
        reasons.append(reason)
    if mode in ("auto", "v1"):
        hierarchy, reason = _find_v1(mounts, root)
        if hierarchy is not None:
            return hierarchy, reasons
        reasons.append(reason)
    return None, reasons


def _find_v2(mounts, own, root):
    points = [point for point, fstype, _ in mounts if fstype == "cgroup2"]
    if not points:
        return None, "cgroup v2: no cgroup2 file system is mounted"
    mount = points[0]
    own_path = own.get("", "/")
    if root is not None:
        base, move_self = mount + root, False
    elif own_path not in ("/", "") and _writable(mount + own_path):
        # systemd's Delegate=yes: our own cgroup is ours to divide.
        base, move_self = mount + own_path, True
    else:
        base, move_self = os.path.join(mount, "corral"), False
    parent = base if os.path.isdir(base) else os.path.dirname(base)
    try:
        available = set(_read(os.path.join(parent, "cgroup.controllers")).split())
    except OSError:
        available = set()
    missing = {"memory", "pids"} - available
    if missing:
        return None, (
            f"cgroup v2 at {mount}: the controllers {' '.join(sorted(missing))} are not "
            f"available in {parent} (a hybrid host has them on v1; under systemd set "
            "Delegate=yes)"
        )
    return CgroupV2(mount, base, move_self), None


def _find_v1(mounts, root):
    found = {}
    for point, fstype, options in mounts:
        if fstype != "cgroup":
            continue
        for controller in ("memory", "pids", "freezer", "cpu"):
            if controller in options and controller not in found:
                found[controller] = point
    missing = {"memory", "pids", "freezer"} - set(found)
    if missing:
        return None, f"cgroup v1: the controllers {' '.join(sorted(missing))} are not mounted"
    return CgroupV1(found, root or "/corral"), None
