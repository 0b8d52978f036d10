"""Finding and killing process trees through /proc."""

import os
import subprocess
import time

from supervisor import proctree
from tests.support import wait_until


def spawn_tree() -> subprocess.Popen:
    """A shell with a child, a grandchild, and a setsid'd great-grandchild."""
    process = subprocess.Popen(
        ["sh", "-c", "sh -c 'sleep 300 & setsid sleep 301 & wait' & wait"],
        start_new_session=True,
    )
    wait_until(lambda: len(proctree.descendants(process.pid)) >= 3)
    return process


def test_descendants_are_found_parents_first():
    """Every process below the root is found, each after its parent."""
    process = spawn_tree()
    try:
        found = proctree.descendants(process.pid)
        assert len(found) >= 3
        for pid in found:
            parent = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
            assert parent == process.pid or found.index(parent) < found.index(pid)
    finally:
        proctree.kill_tree(process.pid)
        process.wait()


def test_stat_fallback_finds_the_same_children():
    """Without /proc/PID/task/TID/children, the /proc/*/stat scan gives the same answer."""
    process = spawn_tree()
    try:
        assert sorted(proctree._children_from_stat(process.pid)) == sorted(
            proctree.children(process.pid)
        )
    finally:
        proctree.kill_tree(process.pid)
        process.wait()


def test_kill_tree_kills_everything_including_setsid():
    """kill_tree leaves no process of the tree alive, sessions or not."""
    process = spawn_tree()
    everyone = [process.pid, *proctree.descendants(process.pid)]
    assert proctree.kill_tree(process.pid) == len(everyone)
    process.wait()
    wait_until(lambda: not any(proctree.alive(p) for p in everyone))


def test_kill_tree_outruns_a_fork_loop():
    """A process forking as fast as it can is stopped and killed with all its children."""
    process = subprocess.Popen(
        ["sh", "-c", "while :; do sleep 30 & done"], start_new_session=True
    )
    time.sleep(0.3)
    proctree.kill_tree(process.pid)
    process.wait()
    wait_until(lambda: session_members(process.pid) == [])


def session_members(sid: int) -> list[int]:
    """Live processes whose session id is ``sid``."""
    members = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[3]) == sid:
            members.append(int(entry))
    return members
