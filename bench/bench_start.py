"""Conversation start: connect + hello + reply + initialize answered.

Floor: the same isolation command starting ``python3 -I -S`` on a script
that answers one JSON-RPC ping, spawned directly by this process. The
difference is what corral adds: the socket, the supervisor, identity and
workspace checks, and the runner's own start-up. Target: p50 at most 1.5x
the floor.

    .venv/bin/python -m bench.bench_start [ISOLATION ...] [--count N]
"""

import json
import subprocess
import sys

from bench.common import RunningSupervisor, compare, isolated_floor_spec, isolations, record, timed
from supervisor.client import Session

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
    spec = isolated_floor_spec(
        supervisor, isolation, reply, "floor.py", FLOOR_SCRIPT, ("--workspace", reply["workspace"])
    )

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
            results[isolation] = compare(ours, base, 1.5)
        finally:
            supervisor.cleanup()
    record("start", {"results": results})


if __name__ == "__main__":
    main()
