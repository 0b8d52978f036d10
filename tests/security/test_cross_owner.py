"""One owner against another (and one conversation against another): files, processes, signals, ptrace, IPC.

Each test opens a victim and an attacker on the same supervisor and has
the attacker try, for real, what the claim says it cannot do; the victim's
state is then checked from the host.
"""

import os
import subprocess

import pytest

from supervisor.client import ConnectionClosed
from tests.security.helpers import (
    bash,
    open_session,
    process_uid,
    start_victim,
    unique,
)

pytestmark = [pytest.mark.root, pytest.mark.integration]


def test_other_owners_files_cannot_be_read_written_or_listed(supervisor):
    """An owner can neither read, write, list, link nor replace another owner's files.

    The attacker tries with bash and with the file tools, by absolute path
    and by ``..``; afterwards the victim's directory is exactly as it was.
    """
    alice, mallory = unique("alice"), unique("mallory")
    with open_session(supervisor, alice) as victim, open_session(supervisor, mallory) as attacker:
        content = unique("SECRET-CONTENT")
        victim.call_tool("write", {"path": "secret.txt", "content": content + "\n"})
        victim.call_tool("write", {"path": "sub/deeper.txt", "content": content + "-deeper\n"})
        workspace = victim.reply["workspace"]
        owner_dir = os.path.dirname(workspace)
        secret = os.path.join(workspace, "secret.txt")
        before = {
            path: (os.lstat(path).st_mtime_ns, open(path).read())
            for path in (secret, os.path.join(workspace, "sub/deeper.txt"))
        }
        listing_before = sorted(os.listdir(workspace))
        relative = os.path.relpath(secret, attacker.reply["workspace"])
        attacks = [
            f"cat {secret}",
            f"cat {relative}",
            f"head -c 100 {workspace}/sub/deeper.txt",
            f"ls -la {owner_dir}",
            f"ls -la {workspace}",
            f"ls {supervisor.workspace_root}",
            f"echo pwned > {secret}",
            f"echo pwned >> {secret}",
            f"echo pwned > {workspace}/planted.txt",
            f"touch {owner_dir}/planted",
            f"mkdir {workspace}/planted-dir",
            f"rm -f {secret}",
            f"mv {secret} {attacker.reply['workspace']}/stolen",
            f"ln {secret} hardlink",
            f"cp -r {owner_dir} copied",
            f"chmod 777 {owner_dir}",
            f"find {owner_dir} -name '*.txt'",
        ]
        # Success is judged by what leaks and by the victim's files seen from
        # the host: under bwrap the victim's paths do not exist, and writes to
        # them land in the attacker's own sandbox.
        leaked = []
        for command in attacks:
            output, result = bash(attacker, command)
            # Listing the workspace root must not even reveal the victim's name.
            names_shown = command.endswith(supervisor.workspace_root) and alice in output
            if content in output or names_shown:
                leaked.append((command, result["exitCode"], output[:200]))
        for tool, arguments in [
            ("read", {"path": secret}),
            ("read", {"path": relative}),
            ("write", {"path": secret, "content": "pwned"}),
            ("write", {"path": f"{workspace}/planted2.txt", "content": "pwned"}),
            ("edit", {"path": secret, "edits": [{"oldText": content, "newText": "pwned"}]}),
        ]:
            result = attacker.call_tool(tool, arguments)
            text = "".join(c.get("text", "") for c in result["content"])
            if content in text:
                leaked.append((tool, arguments, text[:200]))
        assert leaked == [], "\n".join(map(repr, leaked))
        assert sorted(os.listdir(workspace)) == listing_before
        for path, (mtime, text) in before.items():
            assert (os.lstat(path).st_mtime_ns, open(path).read()) == (mtime, text)
        assert sorted(os.listdir(owner_dir)) == ["c-1"]
        assert os.stat(owner_dir).st_mode & 0o777 == 0o700


def test_other_owners_and_conversations_processes_are_invisible(supervisor):
    """``ps`` and ``/proc`` show neither another owner's processes nor another conversation's.

    The onlooker looks for the victims' unique ``sleep`` arguments, for
    processes of any uid but its own, and at the victims' host pids.
    """
    alice, mallory = unique("alice"), unique("mallory")
    with open_session(supervisor, alice) as victim, open_session(
        supervisor, alice, "c-2"
    ) as sibling, open_session(supervisor, mallory) as attacker:
        victims = [start_victim(supervisor, victim), start_victim(supervisor, sibling)]
        # Another owner looks at both; the same owner's first conversation at its sibling.
        for onlooker, targets in ((attacker, victims), (victim, victims[1:])):
            output, result = bash(
                onlooker,
                "ps -eo uid=,pid=,args=; for p in /proc/[0-9]*; do "
                "echo \"$p $(tr '\\0' ' ' < $p/cmdline 2>/dev/null)\"; done; "
                + " ".join(
                    f"cat /proc/{pid}/cmdline /proc/{pid}/status 2>/dev/null;"
                    for _, pids in targets for pid in pids
                ),
            )
            for tag, _ in targets:
                assert tag not in output, output
            uids = {
                line.split()[0] for line in output.splitlines()
                if line.strip() and line.split()[0].isdigit()
            }
            assert uids == {str(onlooker.reply["uid"])}, output


def test_signals_to_other_owners_and_conversations_fail(supervisor):
    """``kill`` of another owner's or conversation's host pids fails, and ``kill -9 -1`` spares them.

    The victims' processes are still alive afterwards and their sessions answer.
    """
    alice, mallory = unique("alice"), unique("mallory")
    with open_session(supervisor, alice) as victim, open_session(
        supervisor, mallory, "c-2"
    ) as sibling_victim, open_session(supervisor, mallory) as attacker:
        targets = []
        for session in (victim, sibling_victim):
            tag, pids = start_victim(supervisor, session)
            targets += pids
        for signal_name in ("0", "TERM", "KILL", "STOP"):
            output, result = bash(
                attacker,
                "ok=0; " + " ".join(
                    f"kill -{signal_name} {pid} 2>/dev/null && ok=$((ok+1));" for pid in targets
                ) + " echo delivered=$ok",
            )
            assert "delivered=0" in output, (signal_name, output)
        try:
            # Kills what the attacker may signal: under bwrap its own runner too.
            bash(attacker, "kill -KILL -1; sleep 1; echo survived", timeout=10)
        except ConnectionClosed:
            pass
        alive = [pid for pid in targets if process_uid(pid) is not None]
        assert alive == targets
        for pid in targets:
            with open(f"/proc/{pid}/stat") as f:
                assert f.read().rsplit(")", 1)[1].split()[0] in "SR", f"pid {pid} stopped"
        assert "alive" in bash(victim, "echo alive")[0]
        assert "alive" in bash(sibling_victim, "echo alive")[0]


PTRACE_ATTACH = """python3 - <<'PY'
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
attached = []
for pid in [{pids}]:
    if libc.ptrace(16, pid, None, None) == 0:  # PTRACE_ATTACH
        attached.append(pid)
    else:
        print(pid, errno.errorcode[ctypes.get_errno()])
    try:
        with open(f"/proc/{{pid}}/environ", "rb") as f:
            print(pid, "ENVIRON", f.read()[:200])
    except OSError as e:
        print(pid, "environ", errno.errorcode[e.errno])
    try:
        with open(f"/proc/{{pid}}/mem", "rb") as f:
            print(pid, "MEM-OPEN")
    except OSError as e:
        print(pid, "mem", errno.errorcode[e.errno])
print("attached", attached)
PY"""


def test_ptrace_and_environ_of_other_owners_are_denied(supervisor):
    """PTRACE_ATTACH on another owner's (or conversation's) host pids fails; their environ and mem are unreadable."""
    alice, mallory = unique("alice"), unique("mallory")
    with open_session(supervisor, alice) as victim, open_session(
        supervisor, mallory, "c-2"
    ) as sibling_victim, open_session(supervisor, mallory) as attacker:
        targets = []
        for session in (victim, sibling_victim):
            targets += start_victim(supervisor, session)[1]
        output, result = bash(attacker, PTRACE_ATTACH.format(pids=", ".join(map(str, targets))))
        assert result["exitCode"] == 0, output
        assert "attached []" in output, output
        assert "ENVIRON" not in output and "MEM-OPEN" not in output, output
        for pid in targets:
            assert process_uid(pid) is not None
            with open(f"/proc/{pid}/status") as f:
                assert "TracerPid:\t0" in f.read()


def test_supervisor_environment_and_command_line_are_invisible(start_supervisor, isolation):
    """A tenant sees neither the supervisor's process nor its environment or command line."""
    marker = unique("SUPERVISOR-ENV")
    supervisor = start_supervisor(
        isolation, extra_args=["--hello-timeout", "9.87654321"], env={"CORRAL_TEST_MARKER": marker}
    )
    pid = supervisor.process.pid
    with open(f"/proc/{pid}/environ", "rb") as f:
        assert marker.encode() in f.read()
    with open_session(supervisor, unique("mallory")) as attacker:
        output, _ = bash(
            attacker,
            f"cat /proc/{pid}/environ /proc/{pid}/cmdline /proc/{pid}/status 2>&1; "
            "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline; echo; "
            "tr '\\0' '\\n' < $p/environ; done 2>&1",
        )
    assert marker not in output
    assert "9.87654321" not in output
    assert "serve" not in output.split()
    assert "No such file or directory" in output


def test_sysv_ipc_shm_and_tmp_are_private_to_a_conversation(supervisor):
    """SysV shared memory, queues and semaphores, /dev/shm and /tmp of one conversation are invisible elsewhere.

    Neither another owner nor the same owner's other conversation sees them,
    and none of them is left on the host after the conversation closes.
    """
    alice, mallory = unique("alice"), unique("mallory")
    tag = unique("ipc")
    victim = open_session(supervisor, alice)
    with victim:
        output, result = bash(
            victim,
            f"ipcmk -M 4096 && ipcmk -Q && ipcmk -S 1 && echo {tag} > /dev/shm/{tag} && "
            f"echo {tag} > /tmp/{tag} && ipcs",
        )
        assert result["exitCode"] == 0, output
        keys = [line.split()[0] for line in output.splitlines() if line.startswith("0x")]
        assert len(keys) == 3, output
        for owner, conversation in ((mallory, "c-1"), (alice, "c-2")):
            with open_session(supervisor, owner, conversation) as other:
                seen, _ = bash(
                    other,
                    f"ipcs; ls -la /dev/shm /tmp; cat /dev/shm/{tag} /tmp/{tag}; "
                    "for k in " + " ".join(keys) + "; do ipcs -m -q -s | grep -c $k; done",
                )
                assert tag not in seen.replace(f"/dev/shm/{tag}", "").replace(f"/tmp/{tag}", ""), seen
                for key in keys:
                    assert key not in seen, seen
    assert not os.path.exists(f"/dev/shm/{tag}") and not os.path.exists(f"/tmp/{tag}")
    host_ipcs = subprocess.run(["ipcs"], capture_output=True, text=True).stdout
    for key in keys:
        assert key not in host_ipcs


def test_no_writable_directory_is_shared_between_owners(supervisor):
    """No directory an owner can write outside its workspace is visible to another owner.

    A world-writable directory both can reach (``/var/tmp``, ``/run/lock``)
    would be a shared ``/tmp``: a channel between tenants and a place for
    files that outlive the conversation. The attacker drops a file in every
    directory it can write; another owner must see none of them.
    """
    alice, mallory = unique("alice"), unique("mallory")
    tag = unique("dropped")
    planted = []
    try:
        with open_session(supervisor, mallory) as attacker, open_session(supervisor, alice) as other:
            output, _ = bash(
                attacker,
                "find / \\( -path /proc -o -path /sys -o -path \"$HOME\" \\) -prune -o "
                "-type d -writable -print 2>/dev/null",
            )
            writable = [
                line for line in output.splitlines()
                if line.startswith("/") and not line.startswith(os.path.dirname(attacker.reply["workspace"]))
            ]
            assert writable, output
            bash(attacker, " ".join(f"echo x > '{d}/{tag}' 2>/dev/null;" for d in writable) + " true")
            planted = [os.path.join(d, tag) for d in writable]
            seen, _ = bash(other, " ".join(f"ls -a '{d}' 2>/dev/null;" for d in writable) + " true")
            shared = [d for d in writable if tag in seen and os.path.exists(os.path.join(d, tag))]
            assert not shared and tag not in seen, f"another owner sees files dropped in {shared}"
    finally:
        for path in planted:
            try:
                os.unlink(path)
            except OSError:
                pass
