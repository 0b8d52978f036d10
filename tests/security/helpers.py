"""What the attacks share: sessions, raw hellos, and views of the host from outside the sandbox.

Everything here observes the real supervisor from the host (``/proc``,
the audit file, the workspace root) so a test can check what an attack
left behind, not only what the tenant saw.
"""

import json
import os
import uuid

from supervisor import proctree
from supervisor.cgroups import SUPERVISOR_LEAF
from supervisor.client import Session
from tests.support import raw_exchange, rss_kib  # noqa: F401 (used by the attack tests)
from tests.support import cgroup_directories, wait_until


def unique(prefix: str) -> str:
    """An owner or conversation name no other test (or concurrent test run) uses."""
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def open_session(supervisor, owner: str, conversation: str = "c-1") -> Session:
    """Connect as ``owner``/``conversation`` and complete MCP's handshake."""
    session = Session.connect(supervisor.socket, owner, conversation)
    session.initialize()
    return session


def bash(session: Session, command: str, timeout: float | None = None) -> tuple[str, dict]:
    """Run ``command`` with the bash tool; return (output text, structuredContent)."""
    arguments = {"command": command}
    if timeout is not None:
        arguments["timeout"] = timeout
    result = session.call_tool("bash", arguments)
    return result["content"][0]["text"], result.get("structuredContent", {})


def refusal(answer: bytes) -> dict:
    """The error of a one-line ``{"ok": false}`` reply (the connection closed right after)."""
    line, _, rest = answer.partition(b"\n")
    assert rest == b"", f"more than one line after a refusal: {answer[:300]!r}"
    reply = json.loads(line)
    assert reply["ok"] is False, reply
    return reply["error"]


# -- the supervisor seen from the host ---------------------------------------


def open_fds(pid: int) -> dict[int, str]:
    """The open descriptors of ``pid``: number to ``readlink`` target."""
    table = {}
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            table[int(name)] = os.readlink(f"/proc/{pid}/fd/{name}")
        except FileNotFoundError:
            continue
    return table


def fd_summary(pid: int) -> dict[str, int]:
    """How many descriptors of each kind (socket, pipe, file...) ``pid`` holds."""
    summary: dict[str, int] = {}
    for target in open_fds(pid).values():
        kind = target.split(":", 1)[0] if ":" in target and not target.startswith("/") else "file"
        summary[kind] = summary.get(kind, 0) + 1
    return summary


def connections_settled(supervisor) -> bool:
    """Every connection the supervisor accepted has been recorded as closed."""
    accepted, closed = set(), set()
    for event in supervisor.audit_events():
        if event["event"] == "connection_accepted":
            accepted.add(event["connection"])
        elif event["event"] == "connection_closed":
            closed.add(event["connection"])
    return accepted <= closed


def unclosed_connections(supervisor) -> dict[int, list[str]]:
    """Connections accepted but not recorded as closed, each with the events it has."""
    events: dict[int, list[str]] = {}
    for event in supervisor.audit_events():
        if "connection" in event:
            events.setdefault(event["connection"], []).append(event["event"])
    return {c: kinds for c, kinds in events.items() if "connection_closed" not in kinds}


def settled_fds(supervisor, baseline: dict[str, int] | None = None, timeout: float = 20.0):
    """Wait until every connection is closed (and the fds back at ``baseline``); return the fds.

    Closing is asynchronous (the runner is killed, its cgroup emptied); the
    audit ``connection_closed`` event marks each connection's end.
    """
    try:
        wait_until(lambda: connections_settled(supervisor), timeout=timeout)
    except AssertionError:
        raise AssertionError(
            f"connections still open after {timeout} s: {unclosed_connections(supervisor)}"
        ) from None
    pid = supervisor.process.pid
    if baseline is not None:
        try:
            wait_until(lambda: fd_summary(pid) == baseline, timeout=timeout)
        except AssertionError:
            raise AssertionError(
                f"supervisor fds {fd_summary(pid)} did not return to {baseline}: "
                f"{sorted(open_fds(pid).items())}"
            ) from None
    return fd_summary(pid)


def runner_pid(supervisor, owner: str, conversation: str) -> int:
    """The host pid the supervisor spawned for the (last) runner of owner/conversation."""
    started = wait_until(
        lambda: [
            e for e in supervisor.audit_events()
            if e["event"] == "runner_started"
            and e.get("owner") == owner and e.get("conversation") == conversation
        ]
    )
    return started[-1]["pid"]


def conversation_host_pids(supervisor, owner: str, conversation: str) -> list[int]:
    """Host pids of every process of a conversation: the spawned process and its descendants."""
    top = runner_pid(supervisor, owner, conversation)
    return [top, *proctree.descendants(top)]


def process_uid(pid: int) -> int | None:
    """The real uid of a host process, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Uid:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def mem_available_kib() -> int:
    """The host's MemAvailable, in KiB."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1])
    raise AssertionError("no MemAvailable in /proc/meminfo")


def tree_snapshot(top: str, skip: str | None = None) -> dict[str, tuple]:
    """Every path under ``top`` (not following symlinks, not below ``skip``) with owner, mode, size."""
    snapshot = {}
    for directory, dirs, files in os.walk(top):
        if skip is not None and (directory == skip or directory.startswith(skip + os.sep)):
            dirs[:] = []
            continue
        for name in dirs + files:
            path = os.path.join(directory, name)
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            snapshot[path] = (st.st_uid, st.st_gid, st.st_mode, st.st_size if not os.path.isdir(path) else 0)
    return snapshot


def start_victim(supervisor, session: Session) -> tuple[str, list[int]]:
    """Start a long ``sleep`` with a unique argument in ``session``; return (that argument, host pids).

    The host pids are every process of the session's conversation, the
    victim included: what an attacker in another conversation aims at.
    """
    tag = f"1000.{uuid.uuid4().int % 10**9:09d}"
    output, _ = bash(session, f"setsid sleep {tag} >/dev/null 2>&1 & echo started")
    assert "started" in output, output

    def pids():
        found = conversation_host_pids(supervisor, session.owner, session.conversation)
        return found if any(tag in cmdline(pid) for pid in found) else None

    return tag, wait_until(pids)


def cmdline(pid: int) -> str:
    """A host process's command line, spaces for NULs ('' once it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode("utf-8", "replace")
    except OSError:
        return ""


def wait_closed(supervisor, owner: str, conversation: str, timeout: float = 20.0) -> dict:
    """Wait for the audit ``connection_closed`` of owner/conversation (its runner and cgroup are gone)."""
    return wait_until(
        lambda: [
            e for e in supervisor.audit_events()
            if e["event"] == "connection_closed"
            and e.get("owner") == owner and e.get("conversation") == conversation
        ],
        timeout=timeout,
    )[-1]


def conversation_cgroups(supervisor) -> list[str]:
    """Conversation cgroups (any hierarchy) under a supervisor's cgroup root, as paths."""
    return sorted(
        entry.path
        for directory in cgroup_directories(supervisor.cgroup_root)
        for entry in os.scandir(directory)
        if entry.is_dir() and entry.name != SUPERVISOR_LEAF
    )
