"""The real supervisor end to end: reply, identities, isolation, cleanup, audit.

Each test starts ``corral serve`` and talks to it over its socket; as root
every test runs under both ``setpriv`` and ``bwrap``.
"""

import json
import os
import signal
import socket
import stat
import subprocess
import threading
import uuid

import pytest

from supervisor.client import HelloRefused, Session
from supervisor.identities import hashed_uid
from tests.support import IS_ROOT, RunningSupervisor, processes_of_uid, raw_exchange, wait_until

pytestmark = pytest.mark.integration


def bash(session, command, **extra):
    """Run ``command`` and return (output text, structuredContent)."""
    result = session.call_tool("bash", {"command": command, **extra})
    return result["content"][0]["text"], result.get("structuredContent", {})


def open_session(supervisor, owner="alice", conversation="c-1"):
    session = Session.connect(supervisor.socket, owner, conversation)
    session.initialize()
    return session


def test_reply_and_directories(supervisor):
    """The reply names owner, conversation, uid, workspace, isolation; dirs have owner and mode."""
    with open_session(supervisor) as session:
        reply = session.reply
        assert reply["ok"] is True
        assert (reply["owner"], reply["conversation"]) == ("alice", "c-1")
        assert reply["isolation"] == supervisor.isolation
        assert reply["workspace"] == os.path.join(supervisor.workspace_root, "alice", "c-1")
        owner_dir = os.path.dirname(reply["workspace"])
        for path in (owner_dir, reply["workspace"]):
            st = os.lstat(path)
            assert stat.S_ISDIR(st.st_mode)
            assert st.st_uid == reply["uid"]
        assert stat.S_IMODE(os.lstat(owner_dir).st_mode) == 0o700
        output, result = bash(session, "id -u; id -g; id -G; pwd")
        assert result["exitCode"] == 0
        uid, gid, groups, cwd = output.split()[:4]
        assert int(uid) == reply["uid"]
        if IS_ROOT:
            assert reply["uid"] == hashed_uid("alice", (20000, 59999))
            assert int(gid) == reply["uid"] and groups == gid
        assert cwd == reply["workspace"]


@pytest.mark.root
def test_owners_are_isolated_conversations_are_not(supervisor):
    """Two owners cannot read each other's files; two conversations of one owner can."""
    with open_session(supervisor, "alice", "c-1") as alice, open_session(
        supervisor, "bob", "c-1"
    ) as bob, open_session(supervisor, "alice", "c-2") as alice2:
        assert alice.reply["uid"] != bob.reply["uid"]
        alice.call_tool("write", {"path": "secret.txt", "content": "alice's secret\n"})
        secret = os.path.join(alice.reply["workspace"], "secret.txt")
        output, result = bash(bob, f"cat {secret}")
        assert result["exitCode"] != 0 and "alice's secret" not in output
        output, result = bash(bob, f"ls {os.path.dirname(alice.reply['workspace'])}")
        assert result["exitCode"] != 0
        output, result = bash(alice2, f"cat {secret}")
        assert result["exitCode"] == 0 and "alice's secret" in output


@pytest.mark.root
def test_colliding_owner_gets_another_uid(start_supervisor, isolation):
    """A second owner whose hashed uid collides gets a different uid."""
    uid_range = (30000, 30009)
    seen = {}
    for i in range(1000):
        name = f"owner{i}"
        if hashed_uid(name, uid_range) in seen:
            first, second = seen[hashed_uid(name, uid_range)], name
            break
        seen[hashed_uid(name, uid_range)] = name
    supervisor = start_supervisor(isolation, extra_args=["--uid-range", "30000-30009"])
    with open_session(supervisor, first) as a, open_session(supervisor, second) as b:
        assert a.reply["uid"] == hashed_uid(first, uid_range)
        assert b.reply["uid"] != a.reply["uid"]
        assert int(bash(b, "id -u")[0].split()[0]) == b.reply["uid"]


@pytest.mark.root
def test_shared_uid_directory_is_uid_conflict(supervisor):
    """Owner directories sharing a uid give uid_conflict and start nothing."""
    for name in ("carol", "dave"):
        path = os.path.join(supervisor.workspace_root, name)
        os.mkdir(path, 0o700)
        os.chown(path, 31000, 31000)
    with pytest.raises(HelloRefused) as caught:
        Session.connect(supervisor.socket, "carol", "c-1")
    assert caught.value.code == "uid_conflict"
    assert os.listdir(os.path.join(supervisor.workspace_root, "carol")) == []
    assert processes_of_uid(31000) == []


@pytest.mark.parametrize(
    "payload, code",
    [
        (b"GET / HTTP/1.1\r\n\r\n", "bad_hello"),
        (b'{"corral": 1, "owner": "../../etc", "conversation": "x"}\n', "bad_name"),
        (b'{"corral": 1, "owner": "a", "conversation": "x", "extra": 1}\n', "bad_hello"),
        (b"{" + b" " * 5000 + b"}\n", "bad_hello"),
        (b'{"corral": 1, "owner": "eve", "conversation": "c\\u0000"}\n', "bad_name"),
    ],
)
def test_bad_hellos_create_nothing(start_supervisor, payload, code):
    """Malformed, hostile and oversized hellos get their code and create nothing."""
    supervisor = start_supervisor("none")
    answer = raw_exchange(supervisor.socket, payload)
    lines = answer.split(b"\n")
    assert lines[1:] == [b""]
    reply = json.loads(lines[0])
    assert reply["ok"] is False and reply["error"]["code"] == code
    assert reply["error"]["message"]
    assert [n for n in os.listdir(supervisor.workspace_root) if not n.startswith(".")] == []
    assert [e for e in supervisor.audit_events() if e["event"] == "runner_started"] == []


def test_missing_hello_times_out(start_supervisor):
    """A client that sends nothing is refused after hello_timeout."""
    supervisor = start_supervisor("none", extra_args=["--hello-timeout", "0.3"])
    reply = json.loads(raw_exchange(supervisor.socket, b""))
    assert reply["error"]["code"] == "bad_hello"
    assert "0.3" in reply["error"]["message"]


@pytest.mark.root
def test_disconnect_kills_every_process(supervisor):
    """After the client disconnects, nothing of the conversation survives: setsid, nohup, double fork."""
    session = open_session(supervisor, "frank", "c-1")
    uid = session.reply["uid"]
    command = (
        "setsid sh -c 'sleep 1000 &'; nohup sleep 1001 >/dev/null 2>&1 & "
        "(sleep 1002 &) & disown; (trap '' TERM; exec sleep 1003) & echo started"
    )
    output, result = bash(session, command)
    assert "started" in output
    wait_until(lambda: len(processes_of_uid(uid)) >= 5)
    session.close()
    wait_until(lambda: processes_of_uid(uid) == [], timeout=10)


@pytest.mark.root
def test_no_network(supervisor):
    """The runner cannot reach a service listening on the host's loopback."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(5)
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    try:
        with open_session(supervisor) as session:
            output, _ = bash(
                session,
                f"(exec 3<>/dev/tcp/127.0.0.1/{port} && echo CONNECTED) 2>&1; "
                "cat /proc/net/dev | tail -n +3 | cut -d: -f1",
            )
        assert "CONNECTED" not in output
        interfaces = [line.strip() for line in output.splitlines()[-3:] if line.strip()]
        assert interfaces[-1] == "lo" and "eth0" not in output
        with pytest.raises(socket.timeout):
            listener.accept()
    finally:
        listener.close()


def test_environment_and_descriptors(start_supervisor, isolation):
    """The runner holds only PATH, HOME, TMPDIR, locale and Python variables, and fds 0-2 as pipes."""
    marker = f"SECRET_{uuid.uuid4().hex}"
    supervisor = start_supervisor(isolation, env={marker: "1", "AWS_SECRET_ACCESS_KEY": marker})
    assert supervisor.process.poll() is None
    with open(f"/proc/{supervisor.process.pid}/environ", "rb") as f:
        assert marker.encode() in f.read()
    with open_session(supervisor) as session:
        output, _ = bash(
            session,
            "tr '\\0' '\\n' < /proc/$PPID/environ; echo ---; "
            "for fd in /proc/$PPID/fd/*; do echo \"$(basename $fd) $(readlink $fd)\"; done",
        )
    environ, _, fds = output.partition("---")
    names = {line.split("=", 1)[0] for line in environ.split() if "=" in line}
    allowed = {"PATH", "HOME", "TMPDIR", "LANG", "LANGUAGE"}
    assert names, output
    assert all(n in allowed or n.startswith(("LC_", "PYTHON")) for n in names), names
    assert marker not in output
    table = dict(line.split(" ", 1) for line in fds.strip().splitlines())
    for fd in ("0", "1", "2"):
        assert table[fd].startswith("pipe:"), table
    for fd, target in table.items():
        assert not target.startswith(("socket:", "anon_inode:[eventpoll]")), table
        assert supervisor.base not in target or target.startswith(
            os.path.join(supervisor.workspace_root, "alice")), table


def test_audit_has_metadata_only(supervisor):
    """Audit events carry ids and counts, never a command, its output or file content."""
    marker = f"MARKER{uuid.uuid4().hex}"
    with open_session(supervisor, "alice", "audit-1") as session:
        bash(session, f"echo {marker}")
        session.call_tool("write", {"path": "m.txt", "content": marker})
        session.call_tool("read", {"path": "m.txt"})
    events = wait_until(
        lambda: [e for e in supervisor.audit_events() if e.get("conversation") == "audit-1"
                 and e["event"] == "connection_closed"] and supervisor.audit_events()
    )
    with open(supervisor.audit_path) as f:
        assert marker not in f.read()
    kinds = [e["event"] for e in events if e.get("conversation") == "audit-1"]
    for kind in ("workspace_created", "runner_started", "runner_exited", "connection_closed"):
        assert kind in kinds
    accepted = [e for e in events if e["event"] == "connection_accepted"]
    assert accepted and accepted[-1]["peer_uid"] == os.getuid()
    assert accepted[-1]["peer_pid"] == os.getpid()
    closed = [e for e in events if e["event"] == "connection_closed" and e.get("conversation") == "audit-1"]
    assert closed[0]["bytes_in"] > 0 and closed[0]["bytes_out"] > 0


def test_runner_death_closes_the_client(supervisor):
    """When the runner dies, the client's connection is closed."""
    session = open_session(supervisor, "alice", "die-1")
    started = wait_until(lambda: [e for e in supervisor.audit_events()
                                  if e["event"] == "runner_started" and e.get("conversation") == "die-1"])
    os.kill(started[0]["pid"], signal.SIGKILL)
    session.sock.settimeout(10)
    assert session.sock.recv(1) == b""
    session.close()


def test_stale_socket_is_replaced(start_supervisor):
    """A socket file left by a crashed supervisor does not stop the next start."""
    first = start_supervisor("none")
    first.process.kill()
    first.process.wait()
    assert os.path.exists(first.socket)
    again = RunningSupervisor("none", base=first.base)
    try:
        again.start()
        with open_session(again) as session:
            assert session.reply["ok"]
    finally:
        again.stop()


def test_live_socket_stops_a_second_supervisor(start_supervisor):
    """A second supervisor on a socket that answers refuses to start, saying why."""
    first = start_supervisor("none")
    second = subprocess.run(
        [*RunningSupervisor("none", base=first.base).args], capture_output=True, text=True,
        timeout=30, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert second.returncode != 0
    assert "already listening" in second.stderr + second.stdout
    with open_session(first) as session:
        assert session.reply["ok"]


@pytest.mark.root
def test_sigterm_kills_runners_and_exits_zero(start_supervisor, isolation):
    """SIGTERM kills every runner's tree and waits for it before exiting 0."""
    supervisor = start_supervisor(isolation)
    session = open_session(supervisor, "gina", "c-1")
    uid = session.reply["uid"]
    session.start_call("bash", {"command": "setsid sleep 1000 & sleep 999"})
    wait_until(lambda: len(processes_of_uid(uid)) >= 3)
    assert supervisor.stop() == 0
    # The close is audited only once the runner and its cgroup are gone:
    # finding it proves the supervisor waited for them before it exited.
    closed = [e for e in supervisor.audit_events()
              if e["event"] == "connection_closed" and e.get("owner") == "gina"]
    assert closed
    assert processes_of_uid(uid) == []
    assert not os.path.exists(supervisor.socket)
    session.close()


@pytest.mark.root
def test_sigkilled_supervisor_takes_its_runners_along(start_supervisor, isolation):
    """If the supervisor is SIGKILLed mid-call, its runners and their commands die with it."""
    supervisor = start_supervisor(isolation, extra_args=["--cgroups", "off"])
    session = open_session(supervisor, "hank", "c-1")
    uid = session.reply["uid"]
    session.start_call("bash", {"command": "setsid sleep 1000 & sleep 999"})
    wait_until(lambda: len(processes_of_uid(uid)) >= 3)
    supervisor.process.kill()
    supervisor.process.wait()
    wait_until(lambda: processes_of_uid(uid) == [], timeout=5)
    session.close()


def test_concurrent_clients(supervisor):
    """Several clients at once each get their own runner and answers."""
    errors = []

    def client(i):
        try:
            with open_session(supervisor, "alice", f"par-{i}") as session:
                output, _ = bash(session, f"echo client-{i}")
                assert f"client-{i}" in output
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []


@pytest.mark.root
def test_no_privileges_left(supervisor):
    """The runner has no capabilities in any set, no_new_privs, and no supplementary groups."""
    with open_session(supervisor) as session:
        output, _ = bash(session, "grep -E '^(Cap|NoNewPrivs|Groups)' /proc/$PPID/status")
    fields = dict(line.split(":", 1) for line in output.strip().splitlines())
    for name in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(fields[name].strip(), 16) == 0, output
    assert fields["NoNewPrivs"].strip() == "1"
    assert fields["Groups"].split() in ([], [str(session.reply["uid"])])


@pytest.mark.root
def test_nested_user_namespaces_are_denied(supervisor):
    """A tenant cannot create a user namespace (a way back to capabilities), nor via clone3."""
    with open_session(supervisor) as session:
        output, result = bash(session, "unshare --user --map-root-user id -u")
        assert result["exitCode"] != 0 and "not permitted" in output, output
        output, _ = bash(session, "grep -E '^Seccomp:' /proc/self/status")
        assert output.split()[-1] == "2", output


@pytest.mark.root
def test_symlinked_conversation_is_refused_not_followed(supervisor):
    """A tenant's symlink in place of a conversation directory is refused; root never chowns its target."""
    with open_session(supervisor, "mallory", "c-1") as session:
        owner_dir = os.path.dirname(session.reply["workspace"])
        target = os.path.join(supervisor.base, "root-only")
        os.mkdir(target, 0o700)
        bash(session, f"ln -s {target} {owner_dir}/c-evil")
    with pytest.raises(HelloRefused) as caught:
        Session.connect(supervisor.socket, "mallory", "c-evil")
    assert caught.value.code == "unavailable"
    assert os.lstat(target).st_uid == 0
    assert stat.S_IMODE(os.lstat(target).st_mode) == 0o700


def test_isolation_none_reports_the_uid_it_really_uses(start_supervisor):
    """Under 'none' the reply names the supervisor's own uid, the one tools really run as."""
    supervisor = start_supervisor("none")
    with open_session(supervisor) as session:
        assert session.reply["uid"] == os.geteuid()
        assert int(bash(session, "id -u")[0].split()[0]) == os.geteuid()


def test_file_size_caps_reach_the_runner(start_supervisor):
    """max_read_bytes and max_edit_bytes from the configuration bound the runner's file tools."""
    supervisor = start_supervisor(
        "none", extra_args=["--max-read-bytes", "1M", "--max-edit-bytes", "1M"]
    )
    with open_session(supervisor) as session:
        session.call_tool("write", {"path": "big.txt", "content": "x\n" * (600 * 1024)})
        read = session.call_tool("read", {"path": "big.txt"})
        edit = session.call_tool(
            "edit", {"path": "big.txt", "edits": [{"oldText": "x\nx\nx", "newText": "y"}]}
        )
    assert read["isError"] and "larger than the 1 MiB read opens" in read["content"][0]["text"]
    assert edit["isError"]


@pytest.mark.root
def test_private_bounded_tmp_and_shm(start_supervisor, isolation):
    """Each conversation has its own size-capped /tmp and /dev/shm; another sees none of it."""
    supervisor = start_supervisor(isolation, extra_args=["--tmp-size", "8M"])
    with open_session(supervisor, "ivy", "c-1") as ivy, open_session(supervisor, "jon", "c-1") as jon:
        output, _ = bash(ivy, "echo ivy > /tmp/mine && echo ivy > /dev/shm/mine && "
                              "head -c 20M /dev/zero > /tmp/fill; echo rc=$?; df -k /tmp /dev/shm")
        assert "rc=0" not in output and "8192" in output
        output, _ = bash(jon, "ls -a /tmp /dev/shm")
        assert "mine" not in output and "fill" not in output
    assert not os.path.exists("/tmp/mine") and not os.path.exists("/dev/shm/mine")


@pytest.mark.root
def test_private_conversation_sharing(start_supervisor):
    """With conversation_sharing = private (bwrap), one conversation cannot see its sibling's files."""
    supervisor = start_supervisor("bwrap", extra_args=["--conversation-sharing", "private"])
    with open_session(supervisor, "kim", "c-1") as first, open_session(supervisor, "kim", "c-2") as second:
        first.call_tool("write", {"path": "note.txt", "content": "first's\n"})
        output, result = bash(second, f"cat {first.reply['workspace']}/note.txt; echo ---; ls ..")
        assert "first's" not in output
        assert output.split("---", 1)[1].split() == ["c-2"]


def test_private_sharing_needs_bwrap(start_supervisor):
    """Asking for private conversations with an isolation that cannot give them stops start-up."""
    base = RunningSupervisor("none", extra_args=["--conversation-sharing", "private"])
    try:
        result = subprocess.run(base.args, capture_output=True, text=True, timeout=60)
        assert result.returncode == 2 and "needs bwrap" in result.stderr
    finally:
        base.cleanup()
