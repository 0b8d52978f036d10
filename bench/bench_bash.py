"""A warm ``bash`` call of ``true`` through the socket.

Floor: ``subprocess.run(["bash", "-c", "true"])`` in a long-lived Python
process started under the same isolation (same uid, namespaces, environment
and working directory as a runner), which reports each call's duration.
Inside a sandbox bash pays for things corral does not add: a UTF-8 locale to
load, and a uid that is in no passwd file (NSS falls through to systemd's
userdb), together about 0.5 ms here; the floor pays them too, so the ratio
is what corral adds: the relay, JSON-RPC both ways, and the runner's tool.
Target: p50 at most 1.3x the floor.

    .venv/bin/python -m bench.bench_bash [ISOLATION ...] [--count N]
"""

import json
import subprocess
import sys

from bench.common import RunningSupervisor, compare, isolated_floor_spec, isolations, record, timed
from supervisor.client import Session

FLOOR_SCRIPT = """\
import json, subprocess, sys, time
count = int(sys.argv[1])
samples = []
for _ in range(count):
    start = time.perf_counter()
    subprocess.run(["bash", "-c", "true"], check=True)
    samples.append((time.perf_counter() - start) * 1000)
print(json.dumps(samples))
"""


def floor_samples(supervisor, isolation: str, reply: dict, count: int) -> list[float]:
    """Durations (ms) of ``bash -c true`` run by a Python process inside the same isolation."""
    spec = isolated_floor_spec(
        supervisor, isolation, reply, "bash_floor.py", FLOOR_SCRIPT, (str(count),)
    )
    output = subprocess.run(
        list(spec.args), executable=spec.executable, env=spec.env, cwd=reply["workspace"],
        stdout=subprocess.PIPE, check=True,
    ).stdout
    return json.loads(output)


def main() -> None:
    count = int(sys.argv[sys.argv.index("--count") + 1]) if "--count" in sys.argv else 1000
    results = {}
    for isolation in isolations():
        # Cgroups off: their cost (the memory controller's accounting of every
        # fork and exec) is measured on its own by bench_cgroups.
        supervisor = RunningSupervisor(isolation, extra_args=["--cgroups", "off"]).start()
        try:
            with Session.connect(supervisor.socket, "bench", "bash") as session:
                session.initialize()

                def call():
                    result = session.call_tool("bash", {"command": "true"})
                    assert not result["isError"], result

                timed(call, 20)
                ours, base = [], []
                for _ in range(5):
                    ours += timed(call, count // 5)
                    base += floor_samples(supervisor, isolation, session.reply, count // 5)[5:]
            results[isolation] = compare(ours, base, 1.3)
        finally:
            supervisor.cleanup()
    record("bash", {"results": results})


if __name__ == "__main__":
    main()
