"""Memory: a runner's USS per idle conversation, and the supervisor's RSS per 100 idle ones.

USS (private pages) of every process in one idle conversation's tree (the
isolation command and the runner), averaged over 20 conversations; floor:
the USS of an idle ``python3 -I -S`` blocked on stdin (the least any
Python daemon costs), measured in the same run. Supervisor: RSS before and
after 100 conversations are open and initialised.

    .venv/bin/python -m bench.bench_memory [ISOLATION ...]
"""

import subprocess
import time

from bench.common import RunningSupervisor, isolations, record, rss_kib, tree_uss_kib, uss_kib
from supervisor import proctree
from supervisor.client import Session


def idle_python_uss() -> int:
    """USS of a bare interpreter waiting on stdin, in KiB."""
    process = subprocess.Popen(
        ["/usr/bin/python3", "-I", "-S", "-c", "import sys; sys.stdin.read()"],
        stdin=subprocess.PIPE,
    )
    time.sleep(0.3)
    try:
        return uss_kib(process.pid)
    finally:
        process.stdin.close()
        process.wait()


def main() -> None:
    results = {}
    floor = idle_python_uss()
    for isolation in isolations():
        supervisor = RunningSupervisor(
            isolation, extra_args=["--max-connections-per-owner", "200"]
        ).start()
        sessions = []
        try:
            pid = supervisor.process.pid
            with Session.connect(supervisor.socket, "bench", "warm") as session:
                session.initialize()
            time.sleep(0.2)
            before = rss_kib(pid)
            for i in range(100):
                session = Session.connect(supervisor.socket, "bench", f"idle-{i}")
                session.initialize()
                sessions.append(session)
            time.sleep(0.5)
            after = rss_kib(pid)
            trees = proctree.children(pid)[:20]
            per_tree = [tree_uss_kib(child) for child in trees]
            runner_only = []
            for child in trees:
                leaves = [p for p in [child, *proctree.descendants(child)] if not proctree.children(p)]
                runner_only.append(sum(uss_kib(p) for p in leaves))
            results[isolation] = {
                "conversation_uss_mib": round(sum(per_tree) / len(per_tree) / 1024, 2),
                "runner_uss_mib": round(sum(runner_only) / len(runner_only) / 1024, 2),
                "idle_python_floor_uss_mib": round(floor / 1024, 2),
                "supervisor_rss_growth_per_100_mib": round((after - before) / 1024, 2),
                "supervisor_rss_mib": round(after / 1024, 2),
            }
        finally:
            for session in sessions:
                session.close()
            supervisor.cleanup()
    record("memory", {"results": results})


if __name__ == "__main__":
    main()
