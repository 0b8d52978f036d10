"""Per-conversation cgroups: placement, limits, the kill, no leaks, crash recovery."""

import os
import signal
import subprocess
import time

import pytest

from supervisor import cgroups
from supervisor.client import Session
from tests.support import (
    RunningSupervisor,
    cgroup_directories,
    processes_of_uid,
    remove_cgroup_root,
    wait_until,
)

pytestmark = [pytest.mark.root, pytest.mark.integration]


def bash(session, command, **extra):
    result = session.call_tool("bash", {"command": command, **extra})
    return result["content"][0]["text"], result.get("structuredContent", {})


def conversation_cgroups(supervisor) -> list[str]:
    """Conversation cgroup names under the supervisor's cgroup root, in any hierarchy."""
    names = set()
    for directory in cgroup_directories(supervisor.cgroup_root):
        names.update(
            e.name for e in os.scandir(directory)
            if e.is_dir() and e.name != cgroups.SUPERVISOR_LEAF
        )
    return sorted(names)


FORK_BOMB = """python3 -c '
import os, time
n = 0
try:
    while n < 200:
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
        n += 1
except OSError as e:
    print("fork failed after", n, e)
'"""


def test_this_host_has_a_usable_hierarchy():
    """As root here, auto finds a hierarchy with memory and pids (v1 on this hybrid host)."""
    hierarchy, reasons = cgroups.find_hierarchy("auto", "/corral-probe")
    assert hierarchy is not None, reasons
    assert hierarchy.version in ("v1", "v2")


def test_runner_lives_in_its_own_cgroup(supervisor):
    """The runner and what it starts are in the conversation's cgroup, which goes at close."""
    with Session.connect(supervisor.socket, "alice", "c-1") as session:
        session.initialize()
        output, _ = bash(session, "cat /proc/self/cgroup; sleep 0.1")
        names = conversation_cgroups(supervisor)
        assert len(names) == 1 and names[0].endswith(".alice.c-1")
        assert f"{supervisor.cgroup_root}/{names[0]}" in output
    wait_until(lambda: conversation_cgroups(supervisor) == [])


def test_memory_limit_confines_a_memory_bomb(start_supervisor, isolation):
    """A command over memory_limit is killed; the supervisor and other conversations carry on."""
    supervisor = start_supervisor(isolation, extra_args=["--memory-limit", "96M"])
    with Session.connect(supervisor.socket, "alice", "bomb") as bomb, Session.connect(
        supervisor.socket, "bob", "calm"
    ) as calm:
        bomb.initialize()
        calm.initialize()
        output, result = bash(
            bomb, "python3 -c 'b = bytearray(400 * 1024 * 1024); print(len(b))'"
        )
        assert result["exitCode"] != 0 or result.get("signal"), output
        assert "419430400" not in output
        assert result["oomKilled"] is True
        assert "out-of-memory killer" in output and "96 MiB" in output
        output, result = bash(calm, "echo still-here")
        assert "still-here" in output
    events = wait_until(
        lambda: [e for e in supervisor.audit_events() if e["event"] == "oom_kill"]
    )
    assert events[0]["owner"] == "alice" and events[0]["count"] >= 1


def test_pids_limit_confines_a_fork_bomb(start_supervisor, isolation):
    """Past pids_limit forks fail inside the conversation; another conversation still runs."""
    supervisor = start_supervisor(isolation, extra_args=["--pids-limit", "32"])
    with Session.connect(supervisor.socket, "alice", "forks") as forks, Session.connect(
        supervisor.socket, "bob", "calm"
    ) as calm:
        forks.initialize()
        calm.initialize()
        output, _ = bash(forks, FORK_BOMB)
        assert "fork failed after" in output and "Resource temporarily unavailable" in output
        [name] = [n for n in conversation_cgroups(supervisor) if ".alice.forks" in n]
        counts = [
            int(open(os.path.join(d, name, "pids.current")).read())
            for d in cgroup_directories(supervisor.cgroup_root)
            if os.path.exists(os.path.join(d, name, "pids.current"))
        ]
        assert counts and max(counts) <= 32
        assert "still-here" in bash(calm, "echo still-here")[0]


def test_no_cgroup_leaks_over_many_connections(supervisor):
    """Fifty connect/disconnect cycles leave no conversation cgroup behind."""
    for i in range(50):
        with Session.connect(supervisor.socket, "alice", f"cycle-{i % 5}") as session:
            if i % 10 == 0:
                session.initialize()
                bash(session, "sleep 30 & echo bg")
    wait_until(lambda: conversation_cgroups(supervisor) == [], timeout=20)


def test_sigkilled_supervisor_leaves_nothing_after_restart(start_supervisor, isolation):
    """SIGKILL the supervisor: its runners die, and the next start removes the cgroups left."""
    supervisor = start_supervisor(isolation)
    session = Session.connect(supervisor.socket, "alice", "crash")
    session.initialize()
    uid = session.reply["uid"]
    bash(session, "setsid sleep 1000 & nohup sleep 1001 >/dev/null 2>&1 & echo ok")
    assert conversation_cgroups(supervisor)
    supervisor.process.kill()
    supervisor.process.wait()
    wait_until(lambda: processes_of_uid(uid) == [], timeout=10)
    session.close()
    again = RunningSupervisor(isolation, base=supervisor.base)
    try:
        again.start()
        assert conversation_cgroups(again) == []
        assert "leftover cgroup" in again.log()
        with Session.connect(again.socket, "alice", "crash") as session:
            assert session.reply["ok"]
    finally:
        again.stop()


def test_v2_mechanics_on_a_real_cgroup2_mount():
    """On the cgroup2 mount (even without controllers): join, cgroup.kill, populated, remove."""
    mounts = [m for m, fstype, _ in cgroups._mounts() if fstype == "cgroup2"]
    if not mounts:
        pytest.fail("no cgroup2 mount on this host")
    base = os.path.join(mounts[0], f"corral-test-v2-{os.getpid()}")
    hierarchy = cgroups.CgroupV2(mounts[0], base, move_self=False)
    try:
        hierarchy.prepare()
        cgroup = hierarchy.create("1.alice.c-1", {"memory_limit": None, "pids_limit": None})
        process = subprocess.Popen(["/bin/sh", "-c", "setsid sleep 300 & sleep 300"])
        time.sleep(0.1)
        assert cgroup.adopt(process.pid) >= 2
        assert len(open(cgroup.procs_files[0]).read().split()) >= 2
        assert cgroup.populated()
        assert cgroup.kill() >= 2
        process.wait(10)
        wait_until(lambda: not cgroup.populated())
        cgroup.remove()
        assert not os.path.exists(cgroup.directories[0])
        assert hierarchy.leftovers() == []
    finally:
        remove_cgroup_root("/" + os.path.basename(base))


def test_v1_adopts_and_kills_a_fork_loop():
    """A fork loop adopted while it runs is wholly inside, and freeze-kill-thaw kills it all."""
    hierarchy, _ = cgroups.find_hierarchy("v1", f"/corral-test-v1-{os.getpid()}")
    if hierarchy is None:
        pytest.fail("no cgroup v1 memory/pids/freezer on this host")
    try:
        hierarchy.prepare()
        cgroup = hierarchy.create("1.alice.loop", {"memory_limit": 1 << 30, "pids_limit": 256})
        process = subprocess.Popen(["/bin/sh", "-c", "while :; do sleep 30 & done"])
        cgroup.adopt(process.pid)
        time.sleep(0.3)
        cgroup.kill()
        process.wait(10)
        wait_until(lambda: not cgroup.populated())
        cgroup.remove()
    finally:
        remove_cgroup_root(hierarchy.root)
