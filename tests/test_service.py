"""The daemon as an operator sees it: socket permissions, readiness, logs, start-up errors."""

import json
import os
import socket
import stat
import subprocess

import pytest

from supervisor.client import Session
from tests.support import CORRAL, REPO, RunningSupervisor, wait_until

pytestmark = pytest.mark.integration


@pytest.mark.root
def test_socket_and_directory_permissions(start_supervisor):
    """The socket's directory is root:<group> 0750 and the socket root:<group> 0660."""
    supervisor = start_supervisor("none", extra_args=["--socket-group", "12345"])
    directory = os.stat(os.path.dirname(supervisor.socket))
    sock = os.stat(supervisor.socket)
    assert (directory.st_uid, directory.st_gid) == (0, 12345)
    assert stat.S_IMODE(directory.st_mode) == 0o750
    assert (sock.st_uid, sock.st_gid) == (0, 12345)
    assert stat.S_IMODE(sock.st_mode) == 0o660
    assert stat.S_ISSOCK(sock.st_mode)


def test_ready_notification(tmp_path):
    """With NOTIFY_SOCKET set (systemd Type=notify), READY=1 is sent once listening."""
    notify_path = str(tmp_path / "notify")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(notify_path)
    listener.settimeout(20)
    supervisor = RunningSupervisor("none", env={"NOTIFY_SOCKET": notify_path})
    try:
        supervisor.start()
        message = listener.recv(4096).decode()
        assert "READY=1" in message.splitlines()
        assert os.path.exists(supervisor.socket)
        supervisor.stop()
        assert "STOPPING=1" in listener.recv(4096).decode()
    finally:
        supervisor.cleanup()
        listener.close()


def test_logs_are_json_lines_with_fields(start_supervisor):
    """Every log line is a JSON object with time, level, namespace and message; fields are kept."""
    supervisor = start_supervisor("none")
    with Session.connect(supervisor.socket, "alice", "c-1") as session:
        session.initialize()
    wait_until(lambda: "exited" in supervisor.log())
    records = [json.loads(line) for line in supervisor.log().splitlines() if line.strip()]
    for record in records:
        assert {"time", "level", "namespace", "message"} <= set(record)
    started = [r for r in records if r["message"].startswith("runner ") and "started" in r["message"]]
    assert started and started[0]["owner"] == "alice" and started[0]["conversation"] == "c-1"


def test_runner_stderr_is_capped_in_the_log(start_supervisor):
    """A runner flooding stderr gets a burst of lines logged, then warnings, never the flood."""
    supervisor = start_supervisor("shout", extra_args=["--plugins", "tests.relay_plugin"])
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(supervisor.socket)
        sock.sendall(b'{"corral": 1, "owner": "loud", "conversation": "c-1"}\n')
        wait_until(lambda: "the rest is dropped" in supervisor.log(), timeout=20)
    log = supervisor.log()
    shouted = [line for line in log.splitlines() if "stderr: shouting" in line]
    assert 0 < len(shouted) <= 110
    assert "lines are dropped" in log
    assert len(log) < 256 * 1024


@pytest.mark.root
def test_auto_isolation_prefers_bwrap(start_supervisor):
    """'auto' picks bwrap where a sandbox can be built (as on this host), and says so."""
    supervisor = start_supervisor("auto")
    with Session.connect(supervisor.socket, "alice", "c-1") as session:
        assert session.reply["isolation"] == "bwrap"
    assert "isolation auto chose bwrap" in supervisor.log()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--isolation", "docker"], "no isolation strategy named 'docker'"),
        (["--uid-range", "10-20"], "uid_range"),
        (["--audit", "nope"], "no audit sink named 'nope'"),
        (["--isolation", "setpriv", "--state-dir", "/tmp/corral-under-tmp"],
         "gets a private copy of under setpriv"),
    ],
)
def test_bad_configuration_stops_start_up(args, message):
    """A bad value or unknown plugin stops start-up with exit status 2 and a message."""
    base = RunningSupervisor("none")
    try:
        result = subprocess.run(
            [*base.args, *args], cwd=REPO, capture_output=True, text=True, timeout=60,
        )
        assert result.returncode == 2
        assert message in result.stderr
        assert not os.path.exists(base.socket)
    finally:
        base.cleanup()


def test_check_prints_configuration_and_prerequisites():
    """'corral check' lists every key with its source and each prerequisite."""
    result = subprocess.run(
        [*CORRAL, "check", "--isolation", "none", "--socket", "/tmp/corral-check-test/x.sock"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "isolation          none    (flag --isolation)" in result.stdout
    for name in ("root", "setpriv", "bwrap", "cgroups", "socket directory"):
        assert name in result.stdout


def test_existing_socket_directory_is_left_as_it_is(start_supervisor, tmp_path):
    """A socket in a directory corral did not create (such as /run) leaves that directory alone."""
    directory = tmp_path / "shared"
    directory.mkdir()
    os.chmod(directory, 0o755)
    supervisor = start_supervisor("none", extra_args=["--socket", str(directory / "c.sock")])
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o755
    assert stat.S_IMODE(os.stat(directory / "c.sock").st_mode) == 0o660
    assert supervisor.process.poll() is None


@pytest.mark.root
def test_socket_directory_owned_by_someone_else_is_refused(tmp_path):
    """A pre-made socket directory owned by another uid, or a symlink, is refused."""
    from supervisor.errors import ConfigError
    from supervisor.service import check_own_directory

    planted = tmp_path / "planted"
    planted.mkdir()
    os.chown(planted, 12345, 12345)
    with pytest.raises(ConfigError, match="someone else"):
        check_own_directory(str(planted))
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    with pytest.raises(ConfigError, match="not a directory owned"):
        check_own_directory(str(link))
    check_own_directory(str(tmp_path))


def test_per_owner_limits(start_supervisor):
    """Over max_connections_per_owner or max_conversations_per_owner a hello gets 'limit'."""
    from supervisor.client import HelloRefused

    supervisor = start_supervisor(
        "none",
        extra_args=["--max-connections-per-owner", "2", "--max-conversations-per-owner", "3"],
    )
    first = Session.connect(supervisor.socket, "ann", "c-1")
    second = Session.connect(supervisor.socket, "ann", "c-2")
    with pytest.raises(HelloRefused) as caught:
        Session.connect(supervisor.socket, "ann", "c-3")
    assert caught.value.code == "limit" and "max_connections_per_owner" in caught.value.message
    with Session.connect(supervisor.socket, "bob", "c-1") as other:
        assert other.reply["ok"]
    second.close()
    wait_until(lambda: [e for e in supervisor.audit_events()
                        if e["event"] == "connection_closed" and e.get("conversation") == "c-2"])
    with Session.connect(supervisor.socket, "ann", "c-3") as third:
        assert third.reply["ok"]
    # Two closes of c-3: the refused attempt above, then this session.
    wait_until(lambda: len([e for e in supervisor.audit_events()
                            if e["event"] == "connection_closed"
                            and e.get("conversation") == "c-3"]) == 2)
    with pytest.raises(HelloRefused) as caught:
        Session.connect(supervisor.socket, "ann", "c-4")
    assert caught.value.code == "limit" and "max_conversations_per_owner" in caught.value.message
    first.close()
    assert not os.path.exists(os.path.join(supervisor.workspace_root, "ann", "c-4"))


@pytest.mark.root
def test_only_the_socket_group_can_connect(start_supervisor):
    """A process of an unrelated uid is refused by the kernel; a member of the socket group is not."""
    supervisor = start_supervisor("none", extra_args=["--socket-group", "23456"])
    probe = (
        "import socket, sys\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        "try:\n"
        "    s.connect(sys.argv[1])\n"
        "except PermissionError:\n"
        "    print('refused')\n"
        "else:\n"
        "    print('connected')\n"
    )
    outsider = subprocess.run(
        ["setpriv", "--reuid=34567", "--regid=34567", "--clear-groups",
         "/usr/bin/python3", "-I", "-S", "-c", probe, supervisor.socket],
        capture_output=True, text=True, timeout=30,
    )
    member = subprocess.run(
        ["setpriv", "--reuid=34567", "--regid=34567", "--groups=23456",
         "/usr/bin/python3", "-I", "-S", "-c", probe, supervisor.socket],
        capture_output=True, text=True, timeout=30,
    )
    assert outsider.stdout.strip() == "refused", outsider.stderr
    assert member.stdout.strip() == "connected", member.stderr


def test_sighup_stops_cleanly(start_supervisor):
    """SIGHUP (a closed terminal) stops the supervisor like SIGTERM: exit 0, socket removed."""
    import signal as signals

    supervisor = start_supervisor("none")
    with Session.connect(supervisor.socket, "ann", "c-1") as session:
        session.initialize()
        supervisor.process.send_signal(signals.SIGHUP)
        assert supervisor.process.wait(20) == 0
    assert not os.path.exists(supervisor.socket)
    assert [e for e in supervisor.audit_events() if e["event"] == "connection_closed"]
