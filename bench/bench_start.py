"""Conversation start: connect + hello + reply + initialize answered.

Floor: the same isolation command starting ``python3 -I -S`` on a script
that answers one JSON-RPC ping, spawned directly by this process. The
difference is what corral adds: the socket, the supervisor, identity and
workspace checks, and the runner's own start-up. Target: p50 at most 1.5x
the floor.

    .venv/bin/python -m bench.bench_start [ISOLATION ...] [--count N]
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
import json, sys
request = json.loads(sys.stdin.readline())
sys.stdout.write(json.dumps({"jsonrpc": "2.0", "id": request["id"], "result": {}}) + "\\n")
sys.stdout.flush()
sys.stdin.read()
"""
PING = b'{"jsonrpc": "2.0", "id": 1, "method": "ping"}\n'


def _count() -> int:
    if "--count" in sys.argv:
        return int(sys.argv[sys.argv.index("--count") + 1])
    return 200


def floor_launcher(supervisor, isolation: str, reply: dict):
    """A function that starts the floor program under ``isolation`` and waits for its ping answer."""
    directory = os.path.join(supervisor.state_dir, "bench-floor")
    os.makedirs(directory, exist_ok=True)
    os.chmod(directory, 0o755)
    script = os.path.join(directory, "floor.py")
    with open(script, "w") as f:
        f.write(FLOOR_SCRIPT)
    os.chmod(script, 0o644)
    config = load_config(environ={"CORRAL_STATE_DIR": supervisor.state_dir})
    strategy = PluginRegistry().build("isolation", isolation, config)
    launch = RunnerLaunch(
        owner=reply["owner"], conversation=reply["conversation"], uid=reply["uid"],
        gid=reply["uid"], workspace=reply["workspace"], python=config.runner_python,
        runner_script=script, runner_args=("--workspace", reply["workspace"]),
        env=runner_env(reply["workspace"]),
    )
    spec = strategy.spawn_spec(launch)

    def start():
        process = subprocess.Popen(
            list(spec.args), executable=spec.executable, env=spec.env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )
        process.stdin.write(PING)
        process.stdin.flush()
        answer = json.loads(process.stdout.readline())
        assert answer["id"] == 1, answer
        process.stdin.close()
        process.wait()

    return start


def main() -> None:
    count = _count()
    results = {}
    for isolation in isolations():
        supervisor = RunningSupervisor(isolation).start()
        try:
            def conversation_start():
                with Session.connect(supervisor.socket, "bench", "start") as session:
                    session.initialize()

            with Session.connect(supervisor.socket, "bench", "start") as session:
                reply = session.reply
            floor = floor_launcher(supervisor, isolation, reply)
            timed(conversation_start, 10)
            timed(floor, 10)
            ours, base = [], []
            for _ in range(count // 20):
                ours += timed(conversation_start, 20)
                base += timed(floor, 20)
            ours_summary, floor_summary = summary(ours), summary(base)
            results[isolation] = {
                "corral": ours_summary,
                "floor": floor_summary,
                "ratio_p50": round(ours_summary["p50_ms"] / floor_summary["p50_ms"], 3),
                "ratio_p90": round(ours_summary["p90_ms"] / floor_summary["p90_ms"], 3),
                "target_ratio_p50": 1.5,
            }
        finally:
            supervisor.cleanup()
    record("start", {"results": results})


if __name__ == "__main__":
    main()
