"""Exhausting the host from a conversation: processes, memory, /dev/shm, output nobody reads.

The supervisor runs with 128 MiB of memory and 64 processes per
conversation. Each bomb must stay inside its own conversation: the host's
memory and process table are not hurt, the supervisor stays small, and
another conversation keeps answering while the bomb goes off.
"""

import os
import threading
import time

import pytest

from supervisor.client import ConnectionClosed

from tests.security.helpers import (
    bash,
    conversation_cgroups,
    mem_available_kib,
    open_session,
    rss_kib,
    settled_fds,
    unique,
    wait_closed,
)
from tests.support import processes_of_uid, wait_until

pytestmark = [pytest.mark.root, pytest.mark.integration]

MIB = 1024  # in KiB


def answers_quickly(session, seconds: float = 5.0) -> bool:
    """Whether ``session`` runs ``echo`` within ``seconds`` (its latency is what a neighbour feels)."""
    started = time.monotonic()
    output, _ = bash(session, "echo still-here")
    return "still-here" in output and time.monotonic() - started < seconds


def pids_cgroup(supervisor, owner: str) -> str:
    """The pids-controller cgroup directory of ``owner``'s (only) conversation."""
    [path] = [
        p for p in conversation_cgroups(supervisor)
        if f".{owner}." in os.path.basename(p) and os.path.exists(os.path.join(p, "pids.max"))
    ]
    return path


def test_fork_bomb_is_confined_to_its_conversation(limited_supervisor):
    """A fork bomb runs into pids_limit and never holds more; the supervisor and a neighbour carry on."""
    supervisor = limited_supervisor
    owner = unique("mallory")
    with open_session(supervisor, owner) as attacker, open_session(
        supervisor, unique("alice")
    ) as neighbour:
        uid = attacker.reply["uid"]
        cgroup = pids_cgroup(supervisor, owner)
        call = attacker.start_call(
            "bash", {"command": "bomb() { bomb | bomb & }; bomb; sleep 6", "timeout": 6}
        )
        peak_processes = peak_tasks = 0
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline:
            peak_processes = max(peak_processes, len(processes_of_uid(uid)))
            with open(os.path.join(cgroup, "pids.current")) as f:
                peak_tasks = max(peak_tasks, int(f.read()))
            time.sleep(0.05)
        assert answers_quickly(neighbour)
        with open(os.path.join(cgroup, "pids.events")) as f:
            refused_forks = int(f.read().split()[1])
        result = attacker.wait(call, timeout=60)
        assert refused_forks > 0, "the bomb never reached pids_limit"
        assert peak_tasks <= 64 and peak_processes <= 64, (peak_tasks, peak_processes)
        assert result["structuredContent"]["timedOut"] or result["isError"]
        assert answers_quickly(attacker, 10)
    wait_until(lambda: processes_of_uid(uid) == [], timeout=20)
    assert supervisor.process.poll() is None


MEMORY_BOMB = """python3 - <<'PY'
chunks = []
for i in range(1024):
    chunks.append(bytearray(b"x" * (1 << 20)))
    if i % 64 == 0:
        print("allocated", i, "MiB", flush=True)
print("ALLOCATED", "ALL")
PY"""


def test_memory_bomb_is_killed_inside_its_conversation(limited_supervisor):
    """Allocating 1 GiB against a 128 MiB limit is OOM-killed in the conversation, reported and audited.

    The host's available memory hardly moves, the supervisor does not grow,
    and the neighbour answers while the bomb runs.
    """
    supervisor = limited_supervisor
    pid = supervisor.process.pid
    supervisor_before = rss_kib(pid)
    owner = unique("mallory")
    with open_session(supervisor, owner) as attacker, open_session(
        supervisor, unique("alice")
    ) as neighbour:
        host_before = mem_available_kib()
        lowest = [host_before]
        running = threading.Event()
        running.set()

        def watch():
            while running.is_set():
                lowest[0] = min(lowest[0], mem_available_kib())
                time.sleep(0.02)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            output, result = bash(attacker, MEMORY_BOMB, timeout=60)
        finally:
            running.clear()
            watcher.join()
        assert "ALLOCATED ALL" not in output, output
        assert result["exitCode"] != 0 or result.get("signal"), result
        assert result.get("oomKilled") is True, result
        assert answers_quickly(neighbour)
        assert answers_quickly(attacker, 10)
    dip = host_before - lowest[0]
    assert dip < 512 * MIB, f"host MemAvailable dipped {dip // MIB} MiB during a 128 MiB-limited bomb"
    assert rss_kib(pid) - supervisor_before < 16 * MIB
    events = wait_until(
        lambda: [e for e in supervisor.audit_events() if e["event"] == "oom_kill" and e.get("owner") == owner]
    )
    assert events[0]["count"] >= 1


SMALL_PROCESSES = (
    "for i in $(seq 64); do (x=$(head -c 2M /dev/zero | tr '\\0' a); sleep 30; true) & "
    "sleep 0.02; done; wait"
)


def test_memory_spread_over_small_processes_is_reported_as_a_tool_error(start_supervisor, isolation):
    """Memory spread over many processes, each smaller than the runner, is OOM-killed as a tool error.

    The OOM killer picks the largest process of the conversation; when
    every process of the command is smaller than the runner itself, the
    runner must still not be the one to go (the issue: "an OOM kill is
    reported to the client as a clear tool error"). The neighbour answers
    throughout.
    """
    supervisor = start_supervisor(isolation, extra_args=["--memory-limit", "128M"])
    owner = unique("mallory")
    with open_session(supervisor, unique("alice")) as neighbour:
        with open_session(supervisor, owner) as attacker:
            try:
                result = attacker.call_tool("bash", {"command": SMALL_PROCESSES, "timeout": 30})
            except ConnectionClosed:
                result = None
        assert answers_quickly(neighbour)
    events = wait_until(
        lambda: [e for e in supervisor.audit_events() if e["event"] == "oom_kill" and e.get("owner") == owner]
    )
    assert events[0]["count"] >= 1
    runner_exit = [
        e for e in supervisor.audit_events() if e["event"] == "runner_exited" and e.get("owner") == owner
    ]
    assert result is not None, (
        f"the OOM killer killed the runner (runner_exited {runner_exit}): the client saw its "
        "connection closed instead of a tool error"
    )
    assert result["structuredContent"].get("oomKilled") is True, result
    assert result["isError"]


def shmem_kib() -> int:
    """The host's tmpfs and shared memory pages (``Shmem`` in /proc/meminfo), in KiB."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Shmem:"):
                return int(line.split()[1])
    raise AssertionError("no Shmem in /proc/meminfo")


def test_shm_and_tmp_fill_is_bounded_and_released(limited_supervisor):
    """Writing 1 GiB to /dev/shm or /tmp stops within the conversation's memory, as a tool error, and is freed at close.

    tmpfs pages are memory: they stay within memory_limit, never grow the
    host's shared memory beyond it, and vanish with the conversation; the
    neighbour keeps answering. Hitting the limit is reported to the client
    as a tool error (the issue: "an OOM kill is reported to the client as a
    clear tool error"), not as a dropped connection.
    """
    supervisor = limited_supervisor
    owner = unique("mallory")
    host_before = mem_available_kib()
    dropped = []
    with open_session(supervisor, unique("alice")) as neighbour:
        for target in ("/dev/shm/fill", "/tmp/fill"):
            with open_session(supervisor, owner, target.split("/")[-2]) as attacker:
                command = f"head -c 1G /dev/zero > {target}; echo rc=$?; ls -l {target}"
                try:
                    result = attacker.call_tool("bash", {"command": command, "timeout": 60})
                except ConnectionClosed:
                    dropped.append(target)
                else:
                    output = result["content"][0]["text"]
                    assert "rc=0" not in output, output
                    sizes = [int(line.split()[4]) for line in output.splitlines()
                             if line.startswith("-")]
                    assert sizes and sizes[0] <= 128 << 20, output
                    assert result["isError"] or "No space left on device" in output, result
            assert answers_quickly(neighbour)
            assert host_before - mem_available_kib() < 512 * MIB
        # Fill both as far as they go and leave it there: closing must free it.
        for conversation in ("shm", "tmp"):
            wait_closed(supervisor, owner, conversation)
        shmem_before = shmem_kib()
        with open_session(supervisor, owner, "leave") as attacker:
            output, _ = bash(
                attacker, "head -c 1G /dev/zero > /dev/shm/left; head -c 1G /dev/zero > /tmp/left; "
                "du -sk /dev/shm/left /tmp/left", timeout=60)
            left = sum(int(line.split()[0]) for line in output.splitlines() if line[:1].isdigit())
            assert left >= 16 * MIB, output
            assert shmem_kib() - shmem_before >= left // 2  # the pages really are the host's Shmem
        wait_closed(supervisor, owner, "leave")
        assert answers_quickly(neighbour)
    # Other work on the host may move Shmem a little; the conversation's pages must be gone.
    wait_until(lambda: shmem_kib() - shmem_before < left // 4, timeout=20)
    assert dropped == [], (
        f"filling {dropped} got the runner OOM-killed: the client saw its connection "
        "closed instead of a tool error"
    )


def test_unread_huge_output_keeps_the_supervisor_small(limited_supervisor):
    """A command streaming output endlessly to a client that never reads leaves the supervisor's memory flat.

    Backpressure pauses the runner; another client is served meanwhile, and
    closing the stalled client kills the command.
    """
    supervisor = limited_supervisor
    pid = supervisor.process.pid
    before = rss_kib(pid)
    owner = unique("mallory")
    attacker = open_session(supervisor, owner)
    uid = attacker.reply["uid"]
    try:
        attacker.start_call(
            "bash", {"command": "cat /dev/zero | tr '\\0' x", "timeout": 600},
            on_progress=lambda params: None,
        )
        peak = before
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline:
            peak = max(peak, rss_kib(pid))
            time.sleep(0.05)
        with open_session(supervisor, unique("alice")) as neighbour:
            assert answers_quickly(neighbour)
        peak = max(peak, rss_kib(pid))
        assert peak - before < 16 * MIB, f"the supervisor grew {(peak - before) // MIB} MiB"
        assert len(processes_of_uid(uid)) >= 3  # the command is still there, paused
    finally:
        attacker.close()
    wait_until(lambda: processes_of_uid(uid) == [], timeout=20)
    settled_fds(supervisor)
