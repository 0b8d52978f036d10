"""What must not reach a tenant, or the audit trail: descriptors, secrets, payloads."""

import json
import os
import socket
import stat

import pytest

from supervisor.client import RpcError
from tests.security.helpers import (
    bash,
    conversation_host_pids,
    open_fds,
    open_session,
    process_uid,
    unique,
    wait_closed,
)

pytestmark = [pytest.mark.root, pytest.mark.integration]

LIST_DESCRIPTORS = (
    "sleep 30 & for p in /proc/[0-9]*; do for fd in $p/fd/*; do "
    "echo \"$(basename $p) $(basename $fd) $(readlink $fd)\"; done; done 2>/dev/null; kill %1"
)


def _is_runner(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"runner/__main__.py" in f.read()
    except OSError:
        return False


def test_no_supervisor_descriptor_reaches_the_tenant(supervisor):
    """Tenant processes hold only their pipes, /dev/null, pidfds and their own files: no supervisor socket, epoll or file.

    Seen from inside (every process in the sandbox) and from the host: the
    only open files a tenant process shares with the supervisor are the
    runner's stdin, stdout and stderr, and the runner's own side channel.
    """
    owner = unique("mallory")
    with open_session(supervisor, owner) as attacker:
        uid = attacker.reply["uid"]
        output, _ = bash(attacker, LIST_DESCRIPTORS)
        inside = [line.split(" ", 2) for line in output.splitlines() if line.count(" ") >= 2]
        assert inside, output
        for pid, fd, target in inside:
            allowed = (
                target.startswith(("pipe:", "/proc/", attacker.reply["workspace"]))
                # bwrap (pid 1 of its sandbox) keeps an eventfd and a signalfd of its own.
                or target in ("anon_inode:[pidfd]", "anon_inode:[eventfd]", "anon_inode:[signalfd]")
                or target == "/dev/null"
            )
            assert allowed, (pid, fd, target, output)
        supervisor_pid = supervisor.process.pid
        shared_files = {}
        for fd in open_fds(supervisor_pid):
            try:
                st = os.stat(f"/proc/{supervisor_pid}/fd/{fd}")
            except FileNotFoundError:
                continue
            if not stat.S_ISCHR(st.st_mode):  # /dev/null is everyone's
                shared_files[(st.st_dev, st.st_ino)] = os.readlink(f"/proc/{supervisor_pid}/fd/{fd}")
        leaks = []
        for pid in conversation_host_pids(supervisor, owner, "c-1"):
            if process_uid(pid) != uid:
                continue  # the root-owned launcher (setpriv's unshare) is not the tenant's
            for fd, target in open_fds(pid).items():
                try:
                    st = os.stat(f"/proc/{pid}/fd/{fd}")
                except FileNotFoundError:
                    continue
                if target.startswith("anon_inode:"):
                    continue  # every anonymous inode is the same inode; checked by kind inside
                # The runner's stdin, stdout and stderr, and its side channel to the
                # supervisor (descriptors 3 and 4, made for it alone, close-on-exec).
                own_pipe = target.startswith("pipe:") and (
                    fd <= 2 or (fd in (3, 4) and _is_runner(pid)))
                if (st.st_dev, st.st_ino) in shared_files and not own_pipe:
                    leaks.append((pid, fd, target))
                if target.startswith("socket:"):
                    leaks.append((pid, fd, target))
        assert leaks == [], leaks


def test_supervisor_secrets_do_not_reach_the_tenant(start_supervisor, isolation):
    """Secrets in the supervisor's environment appear nowhere a tenant can look.

    ``env``, ``/proc/self/environ``, ``/proc/1/environ``, ``/proc/$PPID/environ``
    and every process in the sandbox; and, from the host, the environment
    of every process of the conversation.
    """
    secret, marker = unique("AKIASECRETVALUE"), unique("CORRALMARKER")
    supervisor = start_supervisor(
        isolation,
        env={"AWS_SECRET_ACCESS_KEY": secret, "AWS_ACCESS_KEY_ID": marker,
             "CORRAL_TEST_MARKER": marker, "GITHUB_TOKEN": secret},
    )
    with open(f"/proc/{supervisor.process.pid}/environ", "rb") as f:
        assert secret.encode() in f.read()
    owner = unique("mallory")
    with open_session(supervisor, owner) as attacker:
        output, _ = bash(
            attacker,
            "env; echo ---; tr '\\0' '\\n' < /proc/self/environ; tr '\\0' '\\n' < /proc/1/environ; "
            "tr '\\0' '\\n' < /proc/$PPID/environ; for p in /proc/[0-9]*; do tr '\\0' '\\n' < $p/environ; done; "
            "sleep 30 & sleep 0.1",
        )
        assert secret not in output and marker not in output, output
        names = {line.split("=", 1)[0] for line in output.splitlines() if "=" in line}
        assert not names & {"AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID", "CORRAL_TEST_MARKER", "GITHUB_TOKEN"}
        for pid in conversation_host_pids(supervisor, owner, "c-1"):
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    environ = f.read()
            except OSError:
                continue
            assert secret.encode() not in environ and marker.encode() not in environ, pid


def test_audit_events_carry_no_payload(supervisor):
    """Commands, output, file names and contents, bad JSON-RPC lines: none of it reaches the audit file.

    A unique marker goes into everything a tenant or client sends or
    produces; the audit file holds it nowhere, though it records the
    session. The supervisor's log, which must not hold payloads either, is
    checked too.
    """
    marker = unique("PAYLOADMARKER")
    owner = unique("mallory")
    with open_session(supervisor, owner) as session:
        bash(session, f"echo {marker}; echo {marker} >&2; ls /{marker}; exit 3")
        bash(session, f"sleep 5 # {marker}", timeout=1)
        session.call_tool("write", {"path": f"{marker}.txt", "content": f"{marker}\n"})
        session.call_tool("read", {"path": f"{marker}.txt"})
        session.call_tool("edit", {"path": f"{marker}.txt",
                                   "edits": [{"oldText": marker, "newText": marker + "2"}]})
        session.call_tool("read", {"path": f"missing-{marker}"})
        for method, params in ((f"tools/{marker}", {}), ("tools/call", {"name": marker})):
            with pytest.raises(RpcError):
                session.request(method, params, timeout=10)
        session.sock.sendall(f"{{not json {marker}\n".encode())
        session.sock.sendall(json.dumps({"jsonrpc": "2.0", "id": marker, "method": marker}).encode() + b"\n")
        with pytest.raises(RpcError):  # the parse error, which has no id
            session.ping(timeout=10)
        session.ping(timeout=10)
    with socket.socket(socket.AF_UNIX) as raw:
        raw.connect(supervisor.socket)
        raw.sendall(f'{{"corral": 1, "owner": "{marker}/x", "conversation": "{marker}"}}\n'.encode())
        raw.recv(4096)
    wait_closed(supervisor, owner, "c-1")
    with open(supervisor.audit_path) as f:
        audit = f.read()
    assert marker not in audit
    assert marker not in supervisor.log()
    assert f'"owner": "{owner}"' in audit
