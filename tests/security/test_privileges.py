"""Ways back to privilege: setuid and file-capability binaries, user namespaces, terminal injection."""

import os
import shutil
import subprocess
import sys
import tty

import pytest

from tests.security.helpers import bash, open_session, unique

pytestmark = [pytest.mark.root, pytest.mark.integration]


def plant_root_binary(directory: str, source: str, name: str, mode: int) -> str:
    """Copy ``source`` into ``directory`` as a root-owned file with ``mode`` (setuid bits included)."""
    path = os.path.join(directory, name)
    shutil.copyfile(source, path)
    os.chown(path, 0, 0)
    os.chmod(path, mode)
    return path


def test_setuid_and_file_capability_binaries_gain_nothing(supervisor):
    """Setuid-root, setgid-root and file-capability binaries run with the owner's uid, gid and no capability.

    The binaries are root's, planted where the tenant can run them (its
    conversation directory); ``no_new_privs`` (and, under bwrap, a nosuid
    mount) must make the bits inert. The system's own setuid binaries fail too.
    """
    with open_session(supervisor, unique("mallory")) as attacker:
        uid = attacker.reply["uid"]
        workspace = attacker.reply["workspace"]
        canary = os.path.join(workspace, "root-only")
        with open(canary, "w") as f:
            f.write("ROOT-ONLY-CONTENT\n")
        os.chown(canary, 0, 0)
        os.chmod(canary, 0o600)
        plant_root_binary(workspace, "/usr/bin/id", "suid-id", 0o6755)
        plant_root_binary(workspace, "/usr/bin/cat", "suid-cat", 0o4755)
        plant_root_binary(workspace, "/usr/bin/cat", "caps-cat", 0o755)
        subprocess.run(
            ["setcap", "cap_dac_read_search,cap_setuid,cap_sys_admin+ep",
             os.path.join(workspace, "caps-cat")],
            check=True,
        )
        output, _ = bash(
            attacker,
            "ls -l suid-id suid-cat; ./suid-id; ./suid-cat /proc/self/status | grep -E '^(Uid|Gid|Cap)'; "
            "./suid-cat root-only; ./caps-cat /proc/self/status | grep -E '^(Uid|Cap)'; "
            "./caps-cat root-only; echo ---; "
            "/usr/bin/su -c id root </dev/null; /usr/bin/mount -t tmpfs none /mnt; "
            "/usr/bin/newgrp root </dev/null; echo done",
        )
    assert "-rwsr-sr-x" in output, output  # the bits really are there
    assert "ROOT-ONLY-CONTENT" not in output, output
    assert "euid" not in output and "egid" not in output, output
    for line in output.splitlines():
        if line.startswith(("Uid:", "Gid:")):
            assert line.split()[1:] == [str(uid)] * 4, line
        if line.startswith(("CapPrm:", "CapEff:")):
            assert int(line.split()[1], 16) == 0, line
    assert f"uid={uid}" in output
    assert "uid=0" not in output, output


USERNS_SYSCALLS = """python3 - <<'PY'
import ctypes, errno, mmap, os, platform
libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWUSER, SIGCHLD = 0x10000000, 17

def raw_clone():
    pid = libc.syscall(56, CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0)
    if pid == 0:
        os._exit(0)
    return pid if pid < 0 else os.waitpid(pid, 0) and 0

def clone3():
    args = (ctypes.c_uint64 * 11)(CLONE_NEWUSER, 0, 0, 0, SIGCHLD, 0, 0, 0, 0, 0, 0)
    pid = libc.syscall(435, ctypes.byref(args), 88)
    if pid == 0:
        os._exit(0)
    return pid if pid < 0 else os.waitpid(pid, 0) and 0

def int80():
    # The i386 ABI through int 0x80 from a 64-bit process: unshare is 310 there.
    code = bytes([0x53, 0xB8, 0x36, 0x01, 0, 0, 0xBB, 0, 0, 0, 0x10, 0xCD, 0x80, 0x5B, 0xC3])
    page = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    page.write(code)
    address = ctypes.addressof(ctypes.c_char.from_buffer(page))
    return ctypes.CFUNCTYPE(ctypes.c_int)(address)()

attempts = {
    "unshare": lambda: libc.unshare(CLONE_NEWUSER),
    "clone": raw_clone,
    "clone3": clone3,
}
if platform.machine() == "x86_64":
    # x32 ABI: the same arch in seccomp_data, the syscall number | 0x40000000.
    attempts["x32-unshare"] = lambda: libc.syscall(0x40000000 | 272, CLONE_NEWUSER)
    attempts["int80-unshare"] = int80
for name, attempt in attempts.items():
    pid = os.fork()  # each from a fresh process: one success must not hide the next
    if pid == 0:
        os._exit(0 if attempt() == 0 else 1)
    _, status = os.waitpid(pid, 0)
    print(name, "CREATED" if os.waitstatus_to_exitcode(status) == 0 else "denied")
PY"""


def test_nested_user_namespaces_are_denied(supervisor):
    """A tenant cannot create a user namespace (where it would hold every capability over new namespaces).

    Tried with unshare(1), and with unshare, clone and clone3 called
    directly, through the x32 syscall numbers and through the i386 ABI
    (``int 0x80``), which a seccomp filter that checks only native numbers
    would let through.
    """
    with open_session(supervisor, unique("mallory")) as attacker:
        output, _ = bash(
            attacker,
            "unshare --user --map-root-user id -u; echo rc=$?; "
            "unshare --user --map-root-user --mount --net true; echo rc=$?; " + USERNS_SYSCALLS,
        )
    assert "rc=0" not in output, output
    assert "CREATED" not in output, output
    for attempt in ("unshare", "clone", "clone3"):
        assert f"{attempt} denied" in output, output


TIOCSTI = """python3 - <<'PY'
import fcntl, glob, os, termios
targets = ["/dev/tty", "/dev/console", *sorted(glob.glob("/dev/pts/*")),
           *sorted(glob.glob("/dev/tty[0-9S]*"))[:8]]
for fd in (0, 1, 2):
    try:
        fcntl.ioctl(fd, termios.TIOCSTI, b"x")
        print("INJECTED", fd)
    except OSError as e:
        print("denied", fd, e.strerror)
for path in targets:
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOCTTY)
    except OSError as e:
        print("denied", path, e.strerror)
        continue
    try:
        for byte in b"echo pwned\\n":
            fcntl.ioctl(fd, termios.TIOCSTI, bytes([byte]))
        print("INJECTED", path)
    except OSError as e:
        print("denied", path, e.strerror)
PY"""


def test_tiocsti_cannot_inject_into_the_supervisors_terminal(make_supervisor, isolation):
    """A tenant cannot push input into the terminal the supervisor was started from.

    The supervisor runs with a pseudo-terminal as its controlling terminal
    (an operator's shell); the tenant tries TIOCSTI on /dev/tty, its own
    descriptors and every terminal device it can see. Nothing arrives.
    """
    master, slave = os.openpty()
    supervisor = make_supervisor(isolation)
    try:
        tty.setraw(slave)
        os.set_blocking(slave, False)
        take_terminal = (
            "import fcntl, os, sys, termios; os.setsid(); "
            "fd = os.open(sys.argv[1], os.O_RDWR); fcntl.ioctl(fd, termios.TIOCSCTTY, 0); "
            "os.close(fd); os.execv(sys.argv[2], sys.argv[2:])"
        )
        supervisor.args = [sys.executable, "-c", take_terminal, os.ttyname(slave), *supervisor.args]
        supervisor.start()
        with open(f"/proc/{supervisor.process.pid}/stat") as f:
            tty_nr = int(f.read().rsplit(")", 1)[1].split()[4])
        assert tty_nr == os.stat(os.ttyname(slave)).st_rdev  # the terminal is really its own
        with open_session(supervisor, unique("mallory")) as attacker:
            output, _ = bash(attacker, TIOCSTI)
        assert "INJECTED" not in output, output
        assert "denied /dev/tty" in output, output
        with pytest.raises(BlockingIOError):
            print(os.read(slave, 1024))
        assert supervisor.stop() == 0
    finally:
        # Stopped before its terminal hangs up: a hang-up (SIGHUP) would kill it
        # before it removes its cgroups.
        supervisor.stop()
        os.close(master)
        os.close(slave)
