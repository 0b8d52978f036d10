"""Outliving the conversation: tricks to survive a disconnect, and a supervisor that is SIGKILLed."""

import os
import signal

import pytest

from tests.security.helpers import bash, conversation_cgroups, open_session, unique
from tests.support import RunningSupervisor, processes_of_uid, wait_until

pytestmark = [pytest.mark.root, pytest.mark.integration]

#: Ways a process tries to survive its session, each leaving a ``sleep`` behind.
ESCAPES = {
    "setsid": "setsid sleep 1001 >/dev/null 2>&1 < /dev/null &",
    "setsid -f": "setsid -f sleep 1002 >/dev/null 2>&1 < /dev/null",
    "double fork": "(sleep 1003 >/dev/null 2>&1 &) &",
    "nohup": "nohup sleep 1004 >/dev/null 2>&1 &",
    "disown": "sleep 1005 >/dev/null 2>&1 & disown",
    "SIGTERM and SIGHUP ignored": "(trap '' TERM HUP INT; exec sleep 1006) >/dev/null 2>&1 &",
    "daemon closing every fd": (
        "python3 -c 'import os\n"
        "if os.fork(): os._exit(0)\n"
        "os.setsid()\n"
        "if os.fork(): os._exit(0)\n"
        "os.closerange(0, 1024)\n"
        "os.execvp(\"sleep\", [\"sleep\", \"1007\"])' &"
    ),
    "renamed": "(exec -a '[kworker/0:1]' sleep 1008) >/dev/null 2>&1 &",
    "fork loop": "(while :; do (sleep 1009 &) ; done) >/dev/null 2>&1 &",
}


def escape_everything(session) -> None:
    """Start every escape in ``session`` and check they are running."""
    output, result = bash(session, "\n".join(ESCAPES.values()) + "\nsleep 1; echo started")
    assert "started" in output, output
    ps, _ = bash(session, "ps -eo args")
    for n in range(1001, 1010):
        if n != 1008:
            assert f"sleep {n}" in ps, (n, ps)
    assert "[kworker/0:1]" in ps


def test_every_process_dies_with_the_connection(supervisor):
    """setsid, double fork, nohup, disown, ignored SIGTERM, a daemon and a fork loop all die at disconnect."""
    session = open_session(supervisor, unique("mallory"))
    uid = session.reply["uid"]
    escape_everything(session)
    assert len(processes_of_uid(uid)) > 10
    session.close()
    wait_until(lambda: processes_of_uid(uid) == [], timeout=15)


def test_sigkilled_supervisor_leaves_no_tenant_behind_and_restarts(start_supervisor, isolation):
    """After SIGKILL of the supervisor nothing of any tenant survives; the next start cleans up and serves.

    Two owners run every escape trick when the supervisor is killed. Their
    processes die within seconds; the restarted supervisor removes the
    cgroups left behind, gives each owner the same uid and workspace back,
    and answers.
    """
    supervisor = start_supervisor(isolation)
    owners = [unique("mallory"), unique("trudy")]
    sessions = [open_session(supervisor, owner) for owner in owners]
    uids = [session.reply["uid"] for session in sessions]
    for session in sessions:
        session.call_tool("write", {"path": "kept.txt", "content": "kept\n"})
        escape_everything(session)
    assert conversation_cgroups(supervisor)
    os.kill(supervisor.process.pid, signal.SIGKILL)
    supervisor.process.wait()
    try:
        wait_until(lambda: all(processes_of_uid(uid) == [] for uid in uids), timeout=15)
    finally:
        for session in sessions:
            session.close()
    again = RunningSupervisor(isolation, base=supervisor.base)
    try:
        again.start()
        assert conversation_cgroups(again) == []
        for owner, uid in zip(owners, uids):
            with open_session(again, owner) as session:
                assert session.reply["uid"] == uid
                output, _ = bash(session, "cat kept.txt; pgrep -fc '^sleep 10'; true")
                assert output.split()[:2] == ["kept", "0"], output
    finally:
        again.stop()
