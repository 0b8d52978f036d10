"""A warm ``bash`` call of ``true`` through the socket.

Floor: ``subprocess.run(["bash", "-c", "true"])`` in this long-lived Python
process, in the environment a runner gives bash (``supervisor.spawn.runner_env``:
a UTF-8 locale makes every bash start load it, about 0.3 ms here, in the
floor and in corral alike). The difference is the relay, JSON-RPC both ways
and the runner's tool. Target: p50 at most 1.3x the floor.

    .venv/bin/python -m bench.bench_bash [ISOLATION ...] [--count N]
"""

import subprocess
import sys

from bench.common import RunningSupervisor, isolations, record, summary, timed
from supervisor.client import Session
from supervisor.spawn import runner_env


def main() -> None:
    count = int(sys.argv[sys.argv.index("--count") + 1]) if "--count" in sys.argv else 1000
    results = {}
    for isolation in isolations():
        supervisor = RunningSupervisor(isolation).start()
        try:
            with Session.connect(supervisor.socket, "bench", "bash") as session:
                session.initialize()

                def call():
                    result = session.call_tool("bash", {"command": "true"})
                    assert not result["isError"], result

                environment = runner_env(session.workspace)

                def floor():
                    subprocess.run(["bash", "-c", "true"], check=True, env=environment)

                timed(call, 20)
                timed(floor, 20)
                ours, base = [], []
                for _ in range(count // 50):
                    ours += timed(call, 50)
                    base += timed(floor, 50)
            ours_summary, floor_summary = summary(ours), summary(base)
            results[isolation] = {
                "corral": ours_summary,
                "floor": floor_summary,
                "ratio_p50": round(ours_summary["p50_ms"] / floor_summary["p50_ms"], 3),
                "ratio_p90": round(ours_summary["p90_ms"] / floor_summary["p90_ms"], 3),
                "target_ratio_p50": 1.3,
            }
        finally:
            supervisor.cleanup()
    record("bash", {"results": results})


if __name__ == "__main__":
    main()
