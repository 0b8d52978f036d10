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
import os
import subprocess
import sys

from bench.common import RunningSupervisor, isolations, record, summary, timed
from supervisor.client import Session
from supervisor.config import load_config
from supervisor.plugins import PluginRegistry
from supervisor.spawn import RunnerLaunch, runner_env

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
    directory = os.path.join(supervisor.state_dir, "bench-floor")
    os.makedirs(directory, exist_ok=True)
    os.chmod(directory, 0o755)
    script = os.path.join(directory, "bash_floor.py")
    with open(script, "w") as f:
        f.write(FLOOR_SCRIPT)
    os.chmod(script, 0o644)
    config = load_config(environ={"CORRAL_STATE_DIR": supervisor.state_dir})
    strategy = PluginRegistry().build("isolation", isolation, config)
    launch = RunnerLaunch(
        owner=reply["owner"], conversation=reply["conversation"], uid=reply["uid"],
        gid=reply["uid"], workspace=reply["workspace"], python=config.runner_python,
        runner_script=script, runner_args=(str(count),), env=runner_env(reply["workspace"]),
    )
    spec = strategy.spawn_spec(launch)
    output = subprocess.run(
        list(spec.args), executable=spec.executable, env=spec.env, cwd=reply["workspace"],
        stdout=subprocess.PIPE, check=True,
    ).stdout
    return json.loads(output)


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

                timed(call, 20)
                ours, base = [], []
                for _ in range(5):
                    ours += timed(call, count // 5)
                    base += floor_samples(supervisor, isolation, session.reply, count // 5)[5:]
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
