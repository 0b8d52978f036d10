"""Helpers the integration tests share: a real supervisor process, and a client."""

import json
import socket
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORRAL = [sys.executable, "-m", "supervisor"]
IS_ROOT = os.geteuid() == 0


#: Where test supervisors keep their state: not under /tmp or /var/tmp,
#: which setpriv isolation replaces with a private tmpfs per conversation.
TEST_ROOT = "/var/lib/corral-tests" if IS_ROOT else os.path.join(
    os.path.expanduser("~"), ".cache", "corral-tests")


def traversable_tempdir(prefix: str) -> str:
    """A temporary directory every uid can traverse (pytest's tmp_path is 0700)."""
    os.makedirs(TEST_ROOT, exist_ok=True)
    os.chmod(TEST_ROOT, 0o711)
    path = tempfile.mkdtemp(prefix=prefix, dir=TEST_ROOT)
    os.chmod(path, 0o711)
    return path


class RunningSupervisor:
    """A ``corral serve`` process on a private socket, state and workspace root."""

    def __init__(self, isolation: str = "none", extra_args=(), env=None, base=None):
        self.base = base or traversable_tempdir("corral-test-")
        self.socket = os.path.join(self.base, "run", "corral.sock")
        self.state_dir = os.path.join(self.base, "state")
        self.workspace_root = os.path.join(self.state_dir, "workspaces")
        self.audit_path = os.path.join(self.state_dir, "audit.jsonl")
        self.log_path = os.path.join(self.base, "supervisor.log")
        self.isolation = isolation
        # Each supervisor gets its own cgroup root, so one test's start-up
        # recovery never kills another's conversations.
        self.cgroup_root = "/corral-test-" + os.path.basename(self.base)
        self.args = [
            *CORRAL, "serve",
            "--socket", self.socket,
            "--state-dir", self.state_dir,
            "--isolation", isolation,
            "--log-format", "json",
            "--cgroup-root", self.cgroup_root,
            *extra_args,
        ]
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("CORRAL_")}
        self.env.update(env or {})
        self.process = None

    def start(self, timeout: float = 15.0) -> "RunningSupervisor":
        """Start the process and wait until its socket accepts connections."""
        self._log = open(self.log_path, "ab")
        already_logged = len(self.log())
        self.process = subprocess.Popen(
            self.args, cwd=REPO, env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"corral serve exited {self.process.returncode}:\n{self.log()}")
            if "corral listening on" in self.log()[already_logged:]:
                return self
            time.sleep(0.02)
        raise RuntimeError(f"corral serve did not listen within {timeout} s:\n{self.log()}")

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM the supervisor and wait for it; return its exit status."""
        if self.process is None or self.process.poll() is not None:
            return self.process.returncode if self.process else 0
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise RuntimeError(f"corral serve ignored SIGTERM:\n{self.log()}")

    def log(self) -> str:
        """Everything the supervisor logged so far."""
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def audit_events(self) -> list[dict]:
        """The audit events written so far."""
        try:
            with open(self.audit_path, encoding="utf-8") as f:
                return [json.loads(line) for line in f if line.strip()]
        except FileNotFoundError:
            return []

    def cleanup(self) -> None:
        """Stop and remove every file this supervisor made."""
        try:
            self.stop()
        finally:
            if getattr(self, "_log", None):
                self._log.close()
            remove_cgroup_root(self.cgroup_root)
            shutil.rmtree(self.base, ignore_errors=True)


def cgroup_mounts() -> list[str]:
    """Mount points of every cgroup hierarchy."""
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            before, _, after = line.partition(" - ")
            if after.split()[0] in ("cgroup", "cgroup2"):
                points.append(before.split()[4])
    return points


def cgroup_directories(root: str) -> list[str]:
    """The directories a cgroup root has in every hierarchy (what a supervisor made there)."""
    return [
        os.path.join(point, root.lstrip("/"))
        for point in cgroup_mounts()
        if os.path.isdir(os.path.join(point, root.lstrip("/")))
    ]


def remove_cgroup_root(root: str) -> None:
    """Remove a test supervisor's cgroup root in every hierarchy (children first)."""
    for directory in cgroup_directories(root):
        for child in sorted(os.scandir(directory), key=lambda e: e.name):
            if child.is_dir(follow_symlinks=False):
                try:
                    os.rmdir(child.path)
                except OSError:
                    pass
        try:
            os.rmdir(directory)
        except OSError:
            pass


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.02):
    """Poll ``predicate`` until it returns a true value; return it, or fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s: {predicate}")
        time.sleep(interval)


def processes_of_uid(uid: int) -> list[int]:
    """Pids of live (non-zombie) processes whose real uid is ``uid``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                status = f.read()
        except OSError:
            continue
        fields = dict(
            line.split(":", 1) for line in status.splitlines() if ":" in line
        )
        if fields.get("State", "").strip().startswith("Z"):
            continue
        if int(fields.get("Uid", "-1").split()[0]) == uid:
            found.append(int(entry))
    return found


def rss_kib(pid: int) -> int:
    """Resident memory of a host process, in KiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")


def raw_exchange(path: str, payload: bytes, timeout: float = 15.0) -> bytes:
    """Send raw bytes on a fresh connection and read until the supervisor closes it."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(timeout)
        sock.connect(path)
        try:
            if payload:
                sock.sendall(payload)
        except (BrokenPipeError, ConnectionResetError):
            pass
        chunks = []
        while True:
            try:
                data = sock.recv(65536)
            except ConnectionResetError:
                data = b""
            if not data:
                return b"".join(chunks)
            chunks.append(data)


def connect_raw(path: str, owner: str, conversation: str, timeout: float = 60.0) -> socket.socket:
    """Connect, send the hello, read the ok reply; return the socket at the runner's first byte."""
    sock = socket.socket(socket.AF_UNIX)
    sock.settimeout(timeout)
    sock.connect(path)
    hello = {"corral": 1, "owner": owner, "conversation": conversation}
    sock.sendall(json.dumps(hello).encode() + b"\n")
    reply = b""
    while not reply.endswith(b"\n"):
        reply += sock.recv(1)
    assert json.loads(reply)["ok"], reply
    return sock


def read_all(sock: socket.socket) -> int:
    """Read until the peer closes; return how many bytes came."""
    buffer = bytearray(1 << 20)
    view = memoryview(buffer)
    total = 0
    while True:
        count = sock.recv_into(view)
        if not count:
            return total
        total += count
