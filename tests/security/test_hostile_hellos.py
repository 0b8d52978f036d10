"""Hostile clients before the hello is accepted: slow, malformed, oversized, badly named, flooding.

A refused hello creates nothing (no directory, uid, process or cgroup),
and the supervisor's descriptors and connections return to where they were.
"""

import json
import os
import socket
import threading
import time

import pytest

from supervisor.client import Session
from tests.security.helpers import (
    bash,
    connections_settled,
    conversation_cgroups,
    fd_summary,
    open_session,
    raw_exchange,
    refusal,
    rss_kib,
    settled_fds,
    unique,
)
from tests.support import cgroup_directories, processes_of_uid, wait_until

pytestmark = [pytest.mark.root, pytest.mark.integration]


def hello(owner, conversation="c-1") -> bytes:
    return json.dumps({"corral": 1, "owner": owner, "conversation": conversation}).encode() + b"\n"


def started_runners(supervisor) -> list[dict]:
    return [e for e in supervisor.audit_events() if e["event"] == "runner_started"]


def test_slow_hello_is_refused_at_the_timeout(start_supervisor, isolation):
    """A hello trickled one byte every 0.5 s is refused once hello_timeout has passed.

    Each byte arriving does not restart the clock, and nothing is created.
    """
    supervisor = start_supervisor(isolation, extra_args=["--hello-timeout", "1.5"])
    baseline = fd_summary(supervisor.process.pid)
    owner = unique("slow")
    payload = hello(owner)
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(supervisor.socket)
        sock.settimeout(0.5)
        started = time.monotonic()
        answer = b""
        for byte in payload[:-1]:
            try:
                sock.send(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                break
            try:
                data = sock.recv(4096)
            except socket.timeout:
                continue
            answer += data
            if not data or answer.endswith(b"\n"):
                break
        refused_after = time.monotonic() - started
        sock.settimeout(5)
        while True:
            try:
                data = sock.recv(4096)
            except ConnectionResetError:
                data = b""
            if not data:
                break
            answer += data
    error = refusal(answer)
    assert error["code"] == "bad_hello" and "1.5" in error["message"], error
    # Refused at the timeout (1.5 s), far before the trickled hello could have been complete.
    assert refused_after < 4.0, f"refused only after {refused_after:.1f} s"
    assert not os.path.lexists(os.path.join(supervisor.workspace_root, owner))
    assert os.listdir(supervisor.workspace_root) == []
    assert started_runners(supervisor) == []
    settled_fds(supervisor, baseline)


#: Names the hello must refuse before any file system call: (hello line, acceptable codes).
HOSTILE_HELLOS = [
    (hello("../../etc"), {"bad_name"}),
    (hello("alice", "../bob"), {"bad_name"}),
    (hello("alice", "a/../../x"), {"bad_name"}),
    (hello(".."), {"bad_name"}),
    (hello("."), {"bad_name"}),
    (hello("/etc"), {"bad_name"}),
    (hello("alice", "/tmp/x"), {"bad_name"}),
    (hello("ali\x00ce"), {"bad_name"}),
    (hello("alice", "c\x00"), {"bad_name"}),
    (hello("alice\n"), {"bad_name"}),
    (hello("alice", "c\r\nx"), {"bad_name"}),
    (hello("alicé"), {"bad_name"}),
    (hello("аlice"), {"bad_name"}),  # Cyrillic a
    (hello("ａｌｉｃｅ"), {"bad_name"}),  # full-width
    (hello("alice", "c\u2028x"), {"bad_name"}),
    (hello("a" * 65), {"bad_name"}),
    (hello("alice", "c" * 65), {"bad_name"}),
    (hello(""), {"bad_name"}),
    (hello("alice", ""), {"bad_name"}),
    (hello("-rf"), {"bad_name"}),
    (hello(" alice"), {"bad_name"}),
    (hello(".corral-identities.lock"), {"bad_name"}),
    (hello(".new-alice-deadbeef"), {"bad_name"}),
    (hello("alice", ".corral-identities.lock"), {"bad_name"}),
    (hello("~root"), {"bad_name"}),
    (hello('x"}\n{"time": 0, "event": "forged"}'), {"bad_name"}),
    (hello("alice", "\x1b[2J\x1b[31mforged"), {"bad_name"}),
    (hello("$(id)"), {"bad_name"}),
    (hello("*"), {"bad_name"}),
    (hello(123), {"bad_name", "bad_hello"}),
    (hello(None), {"bad_name", "bad_hello"}),
    (hello(["alice"]), {"bad_name", "bad_hello"}),
    (hello({"alice": 1}), {"bad_name", "bad_hello"}),
    (b'{"corral": 1, "owner": "alice", "conversation": "c-1", "uid": 0}\n', {"bad_hello"}),
    (b'{"corral": 1, "owner": "alice", "owner": "../x", "conversation": "c"}\n', {"bad_name"}),
    (b'{"corral": 1, "owner": "al\\ud800ice", "conversation": "c"}\n', {"bad_name", "bad_hello"}),
    (b'{"corral": 1, "owner": "ali\xffce", "conversation": "c"}\n', {"bad_hello"}),
    (b'{"corral": true, "owner": "alice", "conversation": "c"}\n', {"bad_hello"}),
    (b'["alice", "c"]\n', {"bad_hello"}),
    (b"\n", {"bad_hello"}),
    (b"\x00" * 100 + b"\n", {"bad_hello"}),
    (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", {"bad_hello"}),
]


def test_hostile_names_are_refused_and_create_nothing(start_supervisor, isolation):
    """Traversal, NUL, control and non-ASCII characters, 65 characters, dot-names, non-strings: refused.

    Each gets its stable code, no file appears under the workspace root (not
    even the identities lock: no file system call happened), no runner or
    cgroup starts, the supervisor's descriptors return to their baseline,
    and no hostile value forges an audit or log record.
    """
    supervisor = start_supervisor(isolation)
    baseline = fd_summary(supervisor.process.pid)
    wrong = []
    for payload, codes in HOSTILE_HELLOS:
        error = refusal(raw_exchange(supervisor.socket, payload))
        if error["code"] not in codes or not error["message"]:
            wrong.append((payload, error))
    assert wrong == []
    assert os.listdir(supervisor.workspace_root) == []
    assert started_runners(supervisor) == []
    assert conversation_cgroups(supervisor) == []
    settled_fds(supervisor, baseline)
    # No hostile value forged a record: every audit and log line is one JSON object.
    assert "forged" not in {e["event"] for e in supervisor.audit_events()}
    for line in supervisor.log().splitlines():
        assert json.loads(line).get("event") != "forged"
    assert "\x1b" not in supervisor.log()
    with open_session(supervisor, unique("after")) as session:
        assert "alive" in bash(session, "echo alive")[0]


#: Valid names that look like files the supervisor or the kernel care about.
LOOKALIKE_NAMES = [
    ("cgroup.procs", "cgroup.kill"),
    ("tasks", "memory.limit_in_bytes"),
    ("supervisor", "supervisor"),
    ("supervisor.lock", "audit.jsonl"),
    ("runner", "notify_on_release"),
    ("workspaces", "pids.max"),
    ("a" * 64, "b" * 64),
]


def test_lookalike_names_stay_inside_their_own_directory(start_supervisor, isolation):
    """Valid names shaped like cgroup files or corral's own files get a workspace and nothing else.

    Each lands at ``<root>/<owner>/<conversation>`` owned by its own uid;
    the supervisor's state directory and cgroup files are left as they were.
    """
    supervisor = start_supervisor(isolation)
    state_before = sorted(os.listdir(supervisor.state_dir))
    cgroup_files_before = {
        d: sorted(os.listdir(d)) for d in cgroup_directories(supervisor.cgroup_root)
    }
    for owner, conversation in LOOKALIKE_NAMES:
        with open_session(supervisor, owner, conversation) as session:
            expected = os.path.join(supervisor.workspace_root, owner, conversation)
            assert session.reply["workspace"] == expected
            assert os.lstat(expected).st_uid == session.reply["uid"]
            output, result = bash(session, "pwd; id -u")
            assert output.split()[:2] == [expected, str(session.reply["uid"])], output
    wait_until(lambda: connections_settled(supervisor))
    owners = {owner for owner, _ in LOOKALIKE_NAMES}
    assert set(os.listdir(supervisor.workspace_root)) == owners | {".corral-identities.lock"}
    # The only new state is the lifecycle records (supervisor.workspaces), one per
    # conversation, at <state_dir>/lifecycle/<owner>/<conversation>.
    assert sorted(set(os.listdir(supervisor.state_dir)) - {"lifecycle"}) == sorted(
        set(state_before) - {"lifecycle"})
    lifecycle = os.path.join(supervisor.state_dir, "lifecycle")
    assert {(o, c) for o in os.listdir(lifecycle) for c in os.listdir(os.path.join(lifecycle, o))
            } == set(LOOKALIKE_NAMES)
    wait_until(lambda: conversation_cgroups(supervisor) == [])
    for directory, files in cgroup_files_before.items():
        assert sorted(os.listdir(directory)) == files


def test_oversized_hellos_are_refused_with_bounded_memory(start_supervisor, isolation):
    """A hello over 4096 bytes, with or without its newline, or a 32 MiB blast, is refused.

    The supervisor does not buffer the blast (its memory stays within a few
    MiB) and creates nothing; a hello of exactly 4096 bytes is still served.
    """
    supervisor = start_supervisor(isolation)
    pid = supervisor.process.pid
    baseline = fd_summary(pid)
    rss_before = rss_kib(pid)
    owner = unique("big")
    line = hello(owner)
    padded = line[:-2] + b" " * (4096 - len(line)) + b"}\n"
    assert len(padded) == 4096
    over = line[:-2] + b" " * (4097 - len(line)) + b"}\n"
    for payload in (over, b"{" + b" " * 5000, b'{"owner": "' + b"a" * (1 << 16) + b'"}\n',
                    b"x" * (32 << 20)):
        error = refusal(raw_exchange(supervisor.socket, payload))
        assert error["code"] == "bad_hello", error
        assert "4096" in error["message"]
    grown = rss_kib(pid) - rss_before
    assert grown < 8 * 1024, f"the supervisor grew {grown} KiB refusing oversized hellos"
    assert os.listdir(supervisor.workspace_root) == []
    settled_fds(supervisor, baseline)
    session = Session.connect_with_hello(supervisor.socket, padded)
    with session:
        session.initialize()
        assert session.reply["owner"] == owner


def test_connection_flood_leaves_nothing_behind(start_supervisor, isolation):
    """200 connections opened and dropped at once (silent, partial, oversized and full hellos) leave nothing.

    Afterwards every connection is closed, the supervisor's descriptors are
    back at their baseline, no process of the flooding owner or cgroup is left,
    and the supervisor still serves.
    """
    supervisor = start_supervisor(isolation)
    owner = unique("flood")
    with open_session(supervisor, owner, "warm-up") as session:
        uid = session.reply["uid"]
        bash(session, "true")
    baseline = settled_fds(supervisor)
    partial = hello(owner, "c-1")
    connected = []

    def flood(offset):
        for i in range(offset, 200, 4):
            sock = socket.socket(socket.AF_UNIX)
            try:
                sock.connect(supervisor.socket)
                connected.append(i)
                kind = i % 4
                if kind == 1:
                    sock.send(partial[: 5 + i % 30])
                elif kind == 2:
                    sock.send(hello(owner, f"c-{i % 7}"))
                    if i % 8 == 2:
                        # Drop only once the runner has started.
                        sock.settimeout(30)
                        sock.recv(1)
                elif kind == 3:
                    sock.send(b"{" + b"x" * 3000)
            except OSError:
                pass
            finally:
                sock.close()

    threads = [threading.Thread(target=flood, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(connected) == 200
    wait_until(
        lambda: sum(e["event"] == "connection_accepted" for e in supervisor.audit_events()) >= 201,
        timeout=30,
    )
    assert len(started_runners(supervisor)) >= 20
    settled_fds(supervisor, baseline, timeout=60)
    wait_until(lambda: processes_of_uid(uid) == [], timeout=20)
    wait_until(lambda: conversation_cgroups(supervisor) == [], timeout=20)
    assert supervisor.process.poll() is None
    with open_session(supervisor, owner, "after") as session:
        assert "still-serving" in bash(session, "echo still-serving")[0]
