"""The cost of containment: conversation start and a warm bash call, cgroups on and off.

Both supervisors run in the same process run, alternating in blocks, under
the same isolation; the only difference is ``--cgroups``. Target: cgroup
set-up adds at most 20% to conversation start.

    .venv/bin/python -m bench.bench_cgroups [ISOLATION ...] [--count N]
"""

import sys

from bench.common import RunningSupervisor, isolations, record, summary, timed
from supervisor.client import Session


def main() -> None:
    count = int(sys.argv[sys.argv.index("--count") + 1]) if "--count" in sys.argv else 200
    results = {}
    for isolation in isolations():
        with_cgroups = RunningSupervisor(isolation).start()
        without = RunningSupervisor(isolation, extra_args=["--cgroups", "off"]).start()
        try:
            starts = {"on": [], "off": []}
            calls = {"on": [], "off": []}
            sessions = {}
            for key, supervisor in (("on", with_cgroups), ("off", without)):
                sessions[key] = Session.connect(supervisor.socket, "bench", "warm")
                sessions[key].initialize()

            def starter(supervisor):
                def start():
                    with Session.connect(supervisor.socket, "bench", "start") as session:
                        session.initialize()
                return start

            def caller(session):
                return lambda: session.call_tool("bash", {"command": "true"})

            for key, supervisor in (("on", with_cgroups), ("off", without)):
                timed(starter(supervisor), 10)
                timed(caller(sessions[key]), 20)
            for _ in range(count // 20):
                for key, supervisor in (("on", with_cgroups), ("off", without)):
                    starts[key] += timed(starter(supervisor), 20)
                    calls[key] += timed(caller(sessions[key]), 50)
            for session in sessions.values():
                session.close()
            on_start, off_start = summary(starts["on"]), summary(starts["off"])
            on_call, off_call = summary(calls["on"]), summary(calls["off"])
            results[isolation] = {
                "start_cgroups": on_start,
                "start_no_cgroups": off_start,
                "start_ratio_p50": round(on_start["p50_ms"] / off_start["p50_ms"], 3),
                "bash_cgroups": on_call,
                "bash_no_cgroups": off_call,
                "bash_ratio_p50": round(on_call["p50_ms"] / off_call["p50_ms"], 3),
                "target_start_ratio_p50": 1.2,
            }
        finally:
            with_cgroups.cleanup()
            without.cleanup()
    record("cgroups", {"results": results})


if __name__ == "__main__":
    main()
