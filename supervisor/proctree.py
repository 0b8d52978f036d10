"""Find and kill a process and everything below it, using /proc.

The supervisor spawns the isolation command; the runner and whatever it
started are its descendants. A runner is a child subreaper and, under
``setpriv`` and ``bwrap``, the init of its own pid namespace, so processes
that ``setsid`` or double-fork stay in the tree. Killing stops the whole
tree first (``SIGSTOP``, repeated until no new process appears, so a fork
loop cannot outrun it), then sends ``SIGKILL`` to every process in it.
"""

import os
import signal
import time


def children(pid: int) -> list[int]:
    """The direct children of ``pid`` (every thread's), or [] once it is gone.

    Reads ``/proc/PID/task/TID/children``; on kernels built without
    CONFIG_PROC_CHILDREN, falls back to finding the processes whose parent
    is ``pid`` in ``/proc/*/stat``.
    """
    result = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return result
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                result.extend(int(p) for p in f.read().split())
        except FileNotFoundError:
            if not os.path.exists(f"/proc/{pid}/task/{tid}"):
                continue
            return _children_from_stat(pid)
        except OSError:
            continue
    return result


def _children_from_stat(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue
        fields = data[data.rfind(b")") + 2 :].split()
        if len(fields) > 1 and int(fields[1]) == pid:
            found.append(int(entry))
    return found


def descendants(pid: int) -> list[int]:
    """``pid``'s descendants, parents before their children."""
    found = []
    frontier = [pid]
    while frontier:
        current = frontier.pop()
        for child in children(current):
            found.append(child)
            frontier.append(child)
    return found


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill_tree(pid: int, max_rounds: int = 50) -> int:
    """Stop, then SIGKILL ``pid`` and all its descendants; return how many were signalled.

    A process is only known to have stopped forking once the kernel shows
    it stopped: a fork in flight when SIGSTOP arrives still completes. So
    each round waits (briefly) until every signalled process is stopped or
    gone before looking for new children.
    """
    stopped: set[int] = set()
    for _ in range(max_rounds):
        tree = [pid, *descendants(pid)]
        fresh = [p for p in tree if p not in stopped]
        if not fresh:
            break
        for p in fresh:
            _signal(p, signal.SIGSTOP)
            stopped.add(p)
        _wait_stopped(fresh)
    for p in stopped:
        _signal(p, signal.SIGKILL)
    return len(stopped)


def _state(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return b""
    return data[data.rfind(b")") + 2 : data.rfind(b")") + 3]


def _wait_stopped(pids: list[int], timeout: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    waiting = list(pids)
    while waiting and time.monotonic() < deadline:
        waiting = [p for p in waiting if _state(p) not in (b"", b"T", b"t", b"Z", b"X")]
        if waiting:
            time.sleep(0.0005)


def alive(pid: int) -> bool:
    """Whether ``pid`` still exists as something other than a zombie."""
    return _state(pid) not in (b"", b"Z", b"X")
