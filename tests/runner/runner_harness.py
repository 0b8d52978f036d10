"""Helpers for the runner tests: a real runner subprocess spoken to over JSON-RPC."""

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
#: The key under which a runner output line that is not JSON is kept in ``messages``.
UNPARSABLE = "unparsable line"
RUNNER_MAIN = REPO_ROOT / "runner" / "__main__.py"


class RunnerProcess:
    """A runner started as ``python -I -S runner/__main__.py``, with a reader thread.

    Every message the runner writes is parsed and kept in ``messages``, in order;
    a line that is not JSON is kept as ``{UNPARSABLE: line}`` so tests can see it.
    """

    def __init__(self, workspace, *options, pass_fds=()):
        self.workspace = Path(workspace)
        self.process = subprocess.Popen(
            [sys.executable, "-I", "-S", str(RUNNER_MAIN), "--workspace", str(workspace), *options],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            pass_fds=pass_fds,
        )
        self.messages = []
        self.stderr = b""
        self.closed = False
        self._next_id = 0
        self._condition = threading.Condition()
        threading.Thread(target=self._read_stdout, daemon=True).start()
        threading.Thread(target=self._read_stderr, daemon=True).start()

    def _read_stdout(self):
        for line in self.process.stdout:
            try:
                message = json.loads(line)
            except ValueError:
                message = {UNPARSABLE: line}
            with self._condition:
                self.messages.append(message)
                self._condition.notify_all()
        with self._condition:
            self.closed = True
            self._condition.notify_all()

    def _read_stderr(self):
        self.stderr = self.process.stderr.read()

    def send_raw(self, data):
        """Write raw bytes to the runner's stdin."""
        self.process.stdin.write(data)
        self.process.stdin.flush()

    def send(self, message):
        """Write one message as a JSON line."""
        self.send_raw(json.dumps(message).encode() + b"\n")

    def new_id(self):
        """A request id not used before by this client."""
        self._next_id += 1
        return self._next_id

    def request(self, method, params=None, request_id=None):
        """Send a request without waiting; return its id."""
        request_id = self.new_id() if request_id is None else request_id
        message = {"jsonrpc": "2.0", "id": request_id, "method": method}
        if params is not None:
            message["params"] = params
        self.send(message)
        return request_id

    def notify(self, method, params=None):
        """Send a notification."""
        message = {"jsonrpc": "2.0", "method": method}
        if params is not None:
            message["params"] = params
        self.send(message)

    def wait_for(self, predicate, timeout=10, start=0):
        """The first message from index start (received so far or later) that predicate accepts."""
        deadline = time.monotonic() + timeout
        with self._condition:
            while True:
                for message in self.messages[start:]:
                    if predicate(message):
                        return message
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self.closed:
                    raise AssertionError(f"no matching message; got {self.messages!r}, "
                                         f"stderr {self.stderr!r}")
                self._condition.wait(remaining)

    def response(self, request_id, timeout=10):
        """The answer to request_id."""
        return self.wait_for(lambda m: m.get("id") == request_id and "method" not in m, timeout)

    def call(self, method, params=None, timeout=10):
        """Send a request and return its answer."""
        return self.response(self.request(method, params), timeout)

    def start_tool(self, name, arguments, meta=None):
        """Send a tools/call without waiting; return its id."""
        params = {"name": name, "arguments": arguments}
        if meta is not None:
            params["_meta"] = meta
        return self.request("tools/call", params)

    def call_tool(self, name, arguments, timeout=20, meta=None):
        """Run a tool and return its CallToolResult (failing on a JSON-RPC error)."""
        answer = self.response(self.start_tool(name, arguments, meta), timeout)
        assert "result" in answer, answer
        return answer["result"]

    def peak_memory_kib(self):
        """The runner's peak resident memory so far (VmHWM), in KiB."""
        with open(f"/proc/{self.process.pid}/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
        raise AssertionError("no VmHWM in /proc/PID/status")

    def close(self, timeout=10):
        """Close stdin and wait for the runner to exit; return its exit status."""
        if not self.process.stdin.closed:
            self.process.stdin.close()
        return self.process.wait(timeout)

    def stop(self):
        """Make sure the runner is gone."""
        try:
            self.close(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        except BrokenPipeError:
            self.process.wait(10)


def process_gone(pid):
    """True when pid no longer runs (it does not exist or is a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            data = file.read()
    except FileNotFoundError:
        return True
    return data[data.rfind(b")") + 2:][:1] in (b"Z", b"X")


def wait_until(condition, timeout=10, interval=0.02):
    """Poll condition() until it is true; return whether it became true in time."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return condition()


def read_pid(path, timeout=10):
    """Wait for path to hold a pid (written by a test command) and return it."""
    assert wait_until(lambda: path.exists() and path.read_text().strip(), timeout), path
    return int(path.read_text().strip())
