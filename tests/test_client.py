"""The client: ``supervisor.client.Session`` and the ``corral relay``, ``exec``, ``call`` commands.

Integration tests start a real ``corral serve`` (as root, under both
``setpriv`` and ``bwrap``) and drive it with the real client, in this
process or as ``corral`` subprocesses.  A few tests need no supervisor: a
missing socket, and one fake server that stands in for the supervisor where
a real one cannot be made to send a particular byte sequence.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from supervisor.client import (
    BAD_HELLO,
    BAD_NAME,
    ConnectionClosed,
    HelloRefused,
    RpcError,
    Session,
    SocketNotFound,
    SocketPermissionDenied,
)
from tests.support import CORRAL, IS_ROOT, REPO, traversable_tempdir, wait_until

OWNER, CONVERSATION = "alice", "c-42"


def corral(supervisor_socket, command, *args, owner=OWNER, conversation=CONVERSATION,
           input=None, timeout=60, env=None):
    """Run ``corral COMMAND --socket S --owner O --conversation C ARGS...``; return the result."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("CORRAL_")}
    environment.update(env or {})
    socket_args = ["--socket", supervisor_socket] if supervisor_socket else []
    return subprocess.run(
        [*CORRAL, command, *socket_args, "--owner", owner, "--conversation", conversation, *args],
        cwd=REPO, env=environment, input=input, capture_output=True, timeout=timeout,
    )


def open_session(supervisor, owner=OWNER, conversation=CONVERSATION) -> Session:
    """A connected, initialized session."""
    session = Session.connect(supervisor.socket, owner, conversation, timeout=30)
    session.initialize()
    return session


def text_of(result: dict) -> str:
    """The text content of a CallToolResult."""
    return "".join(item["text"] for item in result["content"] if item["type"] == "text")


def stop(process: subprocess.Popen) -> None:
    """Kill ``process`` if it still runs, reap it and close its pipes."""
    if process.poll() is None:
        process.kill()
    process.wait()
    for stream in (process.stdin, process.stdout, process.stderr):
        if stream is not None:
            stream.close()


def read_message(stream) -> dict:
    """Read one JSON-RPC line from a relay's stdout."""
    line = stream.readline()
    assert line, "the relay closed its stdout"
    return json.loads(line)


# -- without a supervisor ---------------------------------------------------


def test_client_imports_only_the_standard_library():
    """Importing the client pulls in no Twisted, attrs or zope (agent runtimes lack them)."""
    code = (
        "import sys, supervisor.client\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('twisted', 'attr', 'attrs', 'zope', 'pluggy'))\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_missing_socket_says_which_path_and_what_to_do(tmp_path):
    """Connecting to a socket that does not exist names the path and suggests corral serve."""
    path = str(tmp_path / "nothing.sock")
    with pytest.raises(SocketNotFound) as caught:
        Session.connect(path, OWNER, CONVERSATION)
    assert isinstance(caught.value, ConnectionError)
    assert caught.value.path == path
    assert path in str(caught.value) and "corral serve" in str(caught.value)


def test_stale_socket_is_reported_as_not_running(tmp_path):
    """A socket file nobody listens on (a crashed supervisor's) reads as 'not running'."""
    path = str(tmp_path / "stale.sock")
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(path)
    stale.close()
    with pytest.raises(SocketNotFound) as caught:
        Session.connect(path, OWNER, CONVERSATION)
    assert "is `corral serve` running" in str(caught.value)


def test_permission_denied_is_explained():
    """A socket the user may not reach gives SocketPermissionDenied naming the path."""
    base = traversable_tempdir("corral-client-")
    directory = os.path.join(base, "run")
    os.mkdir(directory, 0o700)
    path = os.path.join(directory, "corral.sock")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen()
    try:
        code = (
            "import sys\n"
            "from supervisor.client import Session, SocketPermissionDenied\n"
            "try:\n"
            f"    Session.connect({path!r}, 'alice', 'c-42', timeout=5)\n"
            "except SocketPermissionDenied as e:\n"
            "    print('denied', e)\n"
        )
        command = [sys.executable, "-c", code]
        if IS_ROOT:  # root passes every permission check: ask as nobody
            command = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *command]
        else:
            os.chmod(directory, 0)
        out = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=30)
        assert out.stdout.startswith("denied"), out.stdout + out.stderr
        assert path in out.stdout and "permission denied" in out.stdout
        assert issubclass(SocketPermissionDenied, ConnectionError)
    finally:
        os.chmod(directory, 0o700)
        listener.close()
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("command", [["relay"], ["exec", "--", "true"], ["call", "bash", "{}"]])
def test_commands_without_supervisor_exit_2(tmp_path, command):
    """Every client command explains a missing supervisor on stderr and exits 2."""
    path = str(tmp_path / "nothing.sock")
    out = corral(path, command[0], *command[1:], input=b"")
    assert out.returncode == 2
    assert out.stdout == b""
    assert path in out.stderr.decode() and "corral serve" in out.stderr.decode()


def test_relay_forwards_bytes_that_came_with_the_reply(tmp_path):
    """Bytes the server sent in the same read as the reply line reach the relay's stdout."""
    path = str(tmp_path / "fake.sock")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen()
    reply = {"ok": True, "owner": OWNER, "conversation": CONVERSATION, "uid": 1,
             "workspace": "/w", "isolation": "none"}
    early = b'{"jsonrpc":"2.0","method":"notifications/message","params":{}}\n'
    received = []

    def serve():
        """Accept one relay, read its hello, answer with the reply plus an early line."""
        # A stand-in for the supervisor: a real one cannot be made to speak first.
        connection, _ = listener.accept()
        with connection:
            received.append(connection.makefile("rb").readline())
            connection.sendall(json.dumps(reply).encode() + b"\n" + early)
            connection.shutdown(socket.SHUT_WR)
            while connection.recv(65536):
                pass

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        out = corral(path, "relay", input=b"")
    finally:
        server.join(10)
        listener.close()
    assert out.returncode == 0, out.stderr
    assert out.stdout == early
    assert json.loads(received[0]) == {"corral": 1, "owner": OWNER, "conversation": CONVERSATION}


def test_call_with_bad_json_exits_2(tmp_path):
    """corral call with arguments that are not JSON (or not an object) exits 2 before connecting."""
    path = str(tmp_path / "nothing.sock")
    for arguments in ('{"command":', "[1, 2]"):
        out = corral(path, "call", "bash", arguments)
        assert out.returncode == 2
        assert out.stdout == b""
        assert b"JSON" in out.stderr and b"nothing.sock" not in out.stderr


# -- the session --------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize(
    "hello, code",
    [
        ({"corral": 1, "owner": "../x", "conversation": "c"}, BAD_NAME),
        ({"corral": 1, "owner": "alice", "conversation": "a/b"}, BAD_NAME),
        ({"corral": 1, "owner": "alice", "conversation": "c", "extra": 1}, BAD_HELLO),
        ({"corral": 2, "owner": "alice", "conversation": "c"}, BAD_HELLO),
        (b"this is not json", BAD_HELLO),
    ],
)
def test_refused_hellos_raise_hello_refused(supervisor, hello, code):
    """Each refused hello surfaces as HelloRefused carrying the stable code and a sentence."""
    with pytest.raises(HelloRefused) as caught:
        Session.connect_with_hello(supervisor.socket, hello, timeout=15)
    assert caught.value.code == code
    assert caught.value.message
    assert not caught.value.retryable


@pytest.mark.integration
def test_connect_refuses_bad_owner(supervisor):
    """Session.connect with owner '../x' raises HelloRefused('bad_name')."""
    with pytest.raises(HelloRefused) as caught:
        Session.connect(supervisor.socket, "../x", CONVERSATION)
    assert caught.value.code == BAD_NAME
    assert "../x" in caught.value.message


@pytest.mark.integration
def test_session_calls_every_tool(supervisor):
    """A session initializes, lists the four tools and calls bash, write, read and edit."""
    with open_session(supervisor) as session:
        assert session.server["serverInfo"]["name"] == "corral"
        assert session.server["protocolVersion"]
        assert (session.owner, session.conversation) == (OWNER, CONVERSATION)
        assert session.workspace == os.path.join(supervisor.workspace_root, OWNER, CONVERSATION)
        assert isinstance(session.uid, int) and session.isolation == supervisor.isolation
        session.ping()
        assert sorted(t["name"] for t in session.list_tools()) == ["bash", "edit", "read", "write"]

        chunks = []
        result = session.call_tool("bash", {"command": "echo hi; pwd"}, on_progress=chunks.append)
        assert result["isError"] is False
        assert text_of(result) == f"hi\n{session.workspace}\n"
        assert result["structuredContent"]["exitCode"] == 0
        assert "".join(c["message"] for c in chunks) == text_of(result)

        result = session.call_tool("write", {"path": "notes/a.txt", "content": "one\ntwo\n"})
        assert result["isError"] is False
        with open(os.path.join(session.workspace, "notes", "a.txt")) as f:
            assert f.read() == "one\ntwo\n"

        result = session.call_tool("read", {"path": "notes/a.txt"})
        assert result["isError"] is False and text_of(result) == "one\ntwo\n"

        result = session.call_tool(
            "edit", {"path": "notes/a.txt", "edits": [{"oldText": "two", "newText": "three"}]}
        )
        assert result["isError"] is False and "+three" in text_of(result)
        assert text_of(session.call_tool("read", {"path": "notes/a.txt"})) == "one\nthree\n"

        result = session.call_tool("read", {"path": "missing.txt"})
        assert result["isError"] is True and "missing.txt" in text_of(result)


@pytest.mark.integration
def test_tool_failures_are_results_and_bad_calls_are_rpc_errors(supervisor):
    """A failing command is an isError result; an unknown tool or method is an RpcError."""
    with open_session(supervisor) as session:
        result = session.call_tool("bash", {"command": "echo out; exit 3"})
        assert result["isError"] is True
        assert result["structuredContent"]["exitCode"] == 3
        assert text_of(result).startswith("out\n")
        with pytest.raises(RpcError) as caught:
            session.call_tool("nope", {})
        assert caught.value.code == -32602 and "nope" in caught.value.message
        with pytest.raises(RpcError) as caught:
            session.call_tool("bash", {"command": "true", "extra": 1})
        assert caught.value.code == -32602
        with pytest.raises(RpcError) as caught:
            session.request("no/such/method")
        assert caught.value.code == -32601
        session.ping()  # still usable


@pytest.mark.integration
def test_notifications_and_other_answers_interleave(supervisor):
    """Progress and answers to other requests arriving while waiting are all delivered."""
    with open_session(supervisor) as session:
        slow_chunks, fast_chunks = [], []
        slow = session.start_call(
            "bash", {"command": "for i in 1 2 3; do echo slow$i; sleep 0.2; done"},
            on_progress=slow_chunks.append,
        )
        fast = session.start_call("bash", {"command": "echo fast"}, on_progress=fast_chunks.append)
        ping = session.send_request("ping")
        assert session.wait(ping, timeout=10) == {}
        # Wait for the slow call first: the fast call's answer arrives meanwhile and is kept.
        slow_result = session.wait(slow, timeout=20)
        assert text_of(slow_result) == "slow1\nslow2\nslow3\n"
        assert "".join(c["message"] for c in slow_chunks) == "slow1\nslow2\nslow3\n"
        assert len(slow_chunks) >= 2  # streamed, not all at the end
        fast_result = session.wait(fast, timeout=10)
        assert text_of(fast_result) == "fast\n"
        assert [c["message"] for c in fast_chunks] == ["fast\n"]


@pytest.mark.integration
def test_cancel_stops_a_call(supervisor):
    """cancel() kills the command; the runner answers with a cancelled, isError result."""
    with open_session(supervisor) as session:
        request_id = session.start_call("bash", {"command": "echo started; sleep 30"},
                                        on_progress=lambda p: None)
        time.sleep(0.3)
        started = time.monotonic()
        session.cancel(request_id, "test")
        result = session.wait(request_id, timeout=10)
        assert time.monotonic() - started < 5
        assert result["isError"] is True
        assert result["structuredContent"]["cancelled"] is True
        assert text_of(result).startswith("started\n")


@pytest.mark.integration
def test_client_timeout_cancels_and_session_stays_usable(supervisor):
    """call_tool's timeout raises TimeoutError, cancels the call, and the session works on."""
    with open_session(supervisor) as session:
        with pytest.raises(TimeoutError):
            session.call_tool("bash", {"command": "sleep 30"}, timeout=0.3)
        # The cancelled call's late answer is dropped, not mistaken for another.
        result = session.call_tool("bash", {"command": "echo after"}, timeout=10)
        assert text_of(result) == "after\n"
        session.ping()


@pytest.mark.integration
def test_bash_timeout_is_reported(supervisor):
    """The bash tool's own timeout argument ends the command with timedOut in the result."""
    with open_session(supervisor) as session:
        result = session.call_tool("bash", {"command": "sleep 30", "timeout": 0.5})
        assert result["isError"] is True
        assert result["structuredContent"]["timedOut"] is True


@pytest.mark.integration
def test_large_request_while_answers_pile_up(supervisor):
    """Sending a large request while unread answers fill the connection does not deadlock."""
    with open_session(supervisor) as session:
        session.call_tool("write", {"path": "big.txt", "content": ("x" * 99 + "\n") * 500})
        reads = [session.start_call("read", {"path": "big.txt"}) for _ in range(40)]
        time.sleep(0.5)  # let the answers fill the socket, the supervisor and the pipe
        ping = session.send_request("ping")  # the runner blocks answering this ...
        write = session.start_call("write", {"path": "huge.txt", "content": "y" * (8 << 20)})
        assert session.wait(write, timeout=60)["isError"] is False  # ... while we send this
        assert session.wait(ping, timeout=10) == {}
        for request_id in reads:
            assert session.wait(request_id, timeout=10)["isError"] is False
        assert os.path.getsize(os.path.join(session.workspace, "huge.txt")) == 8 << 20


@pytest.mark.integration
def test_runner_exit_raises_connection_closed(supervisor):
    """When the runner dies mid-call, waiting raises ConnectionClosed instead of hanging."""
    with open_session(supervisor, conversation="dies") as session:
        request_id = session.start_call("bash", {"command": "sleep 30"})
        started = wait_until(lambda: [
            event for event in supervisor.audit_events()
            if event["event"] == "runner_started" and event.get("conversation") == "dies"
        ])
        os.kill(started[0]["pid"], signal.SIGKILL)
        with pytest.raises(ConnectionClosed):
            session.wait(request_id, timeout=20)


# -- corral relay -----------------------------------------------------------------


@pytest.mark.integration
def test_relay_passes_messages_and_exits_when_stdin_closes(supervisor):
    """corral relay carries initialize and ping both ways and exits 0 once stdin closes."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("CORRAL_")}
    environment["CORRAL_SOCKET"] = supervisor.socket  # the default when --socket is absent
    relay = subprocess.Popen(
        [*CORRAL, "relay", "--owner", OWNER, "--conversation", CONVERSATION],
        cwd=REPO, env=environment, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        relay.stdin.write(json.dumps({
            "jsonrpc": "2.0", "id": 1, "method": "initialize",
            "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                       "clientInfo": {"name": "test", "version": "1"}},
        }).encode() + b"\n")
        relay.stdin.flush()
        answer = read_message(relay.stdout)
        assert answer["id"] == 1
        assert answer["result"]["serverInfo"]["name"] == "corral"
        assert answer["result"]["protocolVersion"] == "2025-06-18"
        relay.stdin.write(b'{"jsonrpc":"2.0","method":"notifications/initialized"}\n'
                          b'{"jsonrpc":"2.0","id":"p","method":"ping"}\n')
        relay.stdin.flush()
        assert read_message(relay.stdout) == {"jsonrpc": "2.0", "id": "p", "result": {}}
        relay.stdin.write(b"not json\n")
        relay.stdin.flush()
        assert read_message(relay.stdout)["error"]["code"] == -32700
        relay.stdin.close()
        assert relay.wait(15) == 0
        assert relay.stdout.read() == b""
    finally:
        stop(relay)


@pytest.mark.integration
def test_relay_streams_large_output(supervisor):
    """Large answers pass through the relay whole (64 KiB reads, no line buffering)."""
    content = "".join(f"line {i:06d}\n" for i in range(4000))  # 48,000 bytes, one answer
    relay = subprocess.Popen(
        [*CORRAL, "relay", "--socket", supervisor.socket, "--owner", OWNER,
         "--conversation", CONVERSATION],
        cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        for request_id, (name, arguments) in enumerate(
            [("write", {"path": "f.txt", "content": content}), ("read", {"path": "f.txt"})], 1
        ):
            relay.stdin.write(json.dumps({
                "jsonrpc": "2.0", "id": request_id, "method": "tools/call",
                "params": {"name": name, "arguments": arguments},
            }).encode() + b"\n")
            relay.stdin.flush()
            answer = read_message(relay.stdout)
            assert answer["id"] == request_id and answer["result"]["isError"] is False
        assert answer["result"]["content"][0]["text"].startswith(content[:2000])
        relay.stdin.close()
        assert relay.wait(15) == 0
    finally:
        stop(relay)


@pytest.mark.integration
def test_relay_answers_requests_piped_before_eof(supervisor):
    """Requests piped into corral relay get their answers although stdin ends right after."""
    requests = (
        b'{"jsonrpc":"2.0","id":1,"method":"ping"}\n'
        b'{"jsonrpc":"2.0","id":2,"method":"tools/call",'
        b'"params":{"name":"bash","arguments":{"command":"sleep 0.5; echo piped"}}}\n'
    )
    out = corral(supervisor.socket, "relay", input=requests)
    assert out.returncode == 0, out.stderr
    answers = {m["id"]: m for m in map(json.loads, out.stdout.splitlines())}
    assert answers[1]["result"] == {}
    assert answers[2]["result"]["content"][0]["text"] == "piped\n"


@pytest.mark.integration
def test_refused_relay_exits_2_with_the_reason(supervisor):
    """A relay whose hello is refused prints 'corral relay: <code>: <message>' and exits 2."""
    out = corral(supervisor.socket, "relay", owner="../x", input=b"")
    assert out.returncode == 2
    assert out.stdout == b""
    assert out.stderr.decode().startswith('corral relay: bad_name: owner "../x"')


# -- corral exec ------------------------------------------------------------------


@pytest.mark.integration
def test_exec_prints_output_and_exits_with_the_code(supervisor):
    """corral exec -- sh -c 'echo hi; exit 3' prints hi and exits 3."""
    out = corral(supervisor.socket, "exec", "--", "sh", "-c", "echo hi; exit 3")
    assert (out.returncode, out.stdout, out.stderr) == (3, b"hi\n", b"")


@pytest.mark.integration
def test_exec_quotes_arguments_and_streams_in_order(supervisor):
    """Arguments reach the command unsplit; stdout and stderr come out once, in order."""
    out = corral(supervisor.socket, "exec", "--", "sh", "-c",
                 'printf "%s|" "$@"; echo; echo err >&2; sleep 0.3; echo late', "sh",
                 "a b", "$HOME", "it's")
    assert out.returncode == 0
    assert out.stdout == b"a b|$HOME|it's|\nerr\nlate\n"


@pytest.mark.integration
def test_exec_exit_statuses(supervisor):
    """exec exits 124 on timeout, 128+N when killed by signal N, 0 with no output."""
    out = corral(supervisor.socket, "exec", "--timeout", "0.5", "--", "sleep", "30")
    assert out.returncode == 124
    out = corral(supervisor.socket, "exec", "--", "sh", "-c", "kill -TERM $$")
    assert out.returncode == 128 + signal.SIGTERM
    out = corral(supervisor.socket, "exec", "--", "true")
    assert (out.returncode, out.stdout) == (0, b"")


@pytest.mark.integration
def test_exec_output_burst_is_complete(supervisor):
    """A fast burst of output, more than one progress notification carries, is printed whole."""
    expected = b"".join(b"%099d\n" % i for i in range(1, 401))  # 40,000 bytes at once
    out = corral(supervisor.socket, "exec", "--", "sh", "-c",
                 'i=1; while [ $i -le 400 ]; do printf "%099d\\n" $i; i=$((i+1)); done')
    assert out.returncode == 0, out.stderr
    assert out.stdout == expected
    assert out.stderr == b""


@pytest.mark.integration
def test_exec_output_burst_with_exit_code_and_no_final_newline(supervisor):
    """A burst ending without a newline, then a failure, is printed exactly, with the exit code."""
    expected = b"".join(b"%099d\n" % i for i in range(1, 301)) + b"end\n\n\nno newline"
    out = corral(supervisor.socket, "exec", "--", "sh", "-c",
                 'i=1; while [ $i -le 300 ]; do printf "%099d\\n" $i; i=$((i+1)); done; '
                 'printf "end\\n\\n\\nno newline"; exit 5')
    assert out.returncode == 5, out.stderr
    assert out.stdout == expected
    assert out.stderr == b""


@pytest.mark.integration
def test_exec_huge_fast_output_arrives_whole(supervisor):
    """Output far beyond the result's 50 KiB tail, written as fast as it comes, arrives complete."""
    out = corral(supervisor.socket, "exec", "--", "seq", "1", "200000")
    assert out.returncode == 0
    assert out.stdout == b"".join(b"%d\n" % i for i in range(1, 200001))
    assert out.stderr == b""


@pytest.mark.integration
def test_exec_ctrl_c_cancels_the_command(supervisor):
    """SIGINT to corral exec cancels the remote command (it never finishes) and exits 130."""
    marker = "finished-marker"
    exec_process = subprocess.Popen(
        [*CORRAL, "exec", "--socket", supervisor.socket, "--owner", OWNER,
         "--conversation", CONVERSATION, "--",
         "sh", "-c", f"echo started; sleep 2; touch {marker}"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        assert exec_process.stdout.readline() == b"started\n"
        exec_process.send_signal(signal.SIGINT)
        assert exec_process.wait(10) == 130
    finally:
        stop(exec_process)
    workspace = os.path.join(supervisor.workspace_root, OWNER, CONVERSATION)
    time.sleep(2.5)
    assert not os.path.exists(os.path.join(workspace, marker))


@pytest.mark.integration
def test_refused_exec_exits_2(supervisor):
    """corral exec with a refused hello prints the code and message on stderr and exits 2."""
    out = corral(supervisor.socket, "exec", "--", "true", conversation="a/b")
    assert out.returncode == 2
    assert out.stderr.decode().startswith("corral exec: bad_name: ")


# -- corral call ------------------------------------------------------------------


@pytest.mark.integration
def test_call_prints_the_result_as_json(supervisor):
    """corral call bash '{"command":"echo x"}' prints the CallToolResult as JSON and exits 0."""
    out = corral(supervisor.socket, "call", "bash", '{"command":"echo x"}')
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["content"] == [{"type": "text", "text": "x\n"}]
    assert result["isError"] is False
    assert result["structuredContent"]["exitCode"] == 0
    assert out.stdout.startswith(b"{\n  ")  # indented


@pytest.mark.integration
def test_call_error_results_and_bad_calls(supervisor):
    """corral call exits 1 for an isError result and 2 for an unknown tool or bad JSON."""
    out = corral(supervisor.socket, "call", "read", '{"path": "missing"}')
    assert out.returncode == 1
    assert json.loads(out.stdout)["isError"] is True
    out = corral(supervisor.socket, "call", "nope", "{}")
    assert out.returncode == 2 and b"nope" in out.stderr and out.stdout == b""
    out = corral(supervisor.socket, "call", "bash", '{"command":')
    assert out.returncode == 2 and b"not valid JSON" in out.stderr


@pytest.mark.integration
def test_commands_share_the_workspace(supervisor):
    """Files written through corral call are seen by corral exec in the same conversation."""
    out = corral(supervisor.socket, "call", "write", '{"path": "shared.txt", "content": "hello"}')
    assert out.returncode == 0
    out = corral(supervisor.socket, "exec", "--", "cat", "shared.txt")
    assert (out.returncode, out.stdout) == (0, b"hello")
