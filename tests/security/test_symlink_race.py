"""Root's one step inside a tenant's directory, raced: creating a conversation directory.

A hello for a new conversation makes root create ``<owner dir>/<conversation>``
(``supervisor/fsutil.py:ensure_private_directory``) in a directory the
tenant owns. The tenant swaps that name, as fast as it can, between a
directory, a symlink to a root-only directory and a symlink to a root-only
file while hellos arrive. Root must never touch either target.
"""

import os
import threading
import time

import pytest

from supervisor.client import HelloRefused, Session
from tests.security.helpers import bash, open_session, tree_snapshot, unique
from tests.support import wait_until

pytestmark = [pytest.mark.root, pytest.mark.integration]

SWAPPER = """nohup python3 - >swapper.log 2>&1 <<'PY' &
import ctypes, os, random, shutil, time
libc = ctypes.CDLL(None, use_errno=True)
AT_FDCWD, RENAME_EXCHANGE = -100, 2
os.chdir({owner_dir!r})
def remove(name):
    if os.path.islink(name) or os.path.isfile(name):
        os.unlink(name)
    elif os.path.isdir(name):
        shutil.rmtree(name, ignore_errors=True)
        if os.path.lexists(name):  # root's, half-made: keep it out of the way
            os.rename(name, f"stuck.{{time.monotonic_ns()}}")
def fresh():
    for name in ("race", "race.dir", "race.to-dir", "race.to-file", "race.gone"):
        remove(name)
    os.mkdir("race.dir", 0o700)
    os.symlink({canary_dir!r}, "race.to-dir")
    os.symlink({canary_file!r}, "race.to-file")
    os.symlink({canary_dir!r}, "race")
def step():
    global swaps
    other = random.choice((b"race.dir", b"race.to-dir", b"race.to-file"))
    if libc.renameat2(AT_FDCWD, b"race", AT_FDCWD, other, RENAME_EXCHANGE) == 0:
        swaps += 1
    else:
        fresh()
    if swaps % 50 == 0:
        # Now and then no entry at all, so that root's mkdir wins and the
        # swap races its open and chown instead.
        remove("race.gone")
        os.rename("race", "race.gone")
        time.sleep(0.0005)
        remove("race")
        os.rename("race.gone", "race")
swaps = failures = 0
deadline = time.monotonic() + {seconds}
while time.monotonic() < deadline and not os.path.exists("stop"):
    try:
        if failures % 100 == 0 and failures:
            fresh()
        step()
    except OSError:
        # root's mkdir raced ours: start over.
        failures += 1
with open("swaps", "w") as f:
    f.write(str(swaps))
PY
echo swapping"""


def state(path: str) -> tuple:
    st = os.lstat(path)
    return (st.st_uid, st.st_gid, st.st_mode, st.st_ctime_ns, st.st_mtime_ns)


def test_symlink_swaps_never_redirect_roots_mkdir_or_chown(supervisor):
    """Racing hellos against a tenant swapping symlinks: root-only canaries stay untouched, nothing appears elsewhere.

    The canary directory and file (root, 0700/0600, outside the workspace
    root) keep their owner, mode, times, content and listing; no hello
    creates or changes anything outside the owner's directory.
    """
    canary_dir = os.path.join(supervisor.base, "canary-dir")
    canary_file = os.path.join(supervisor.base, "canary-file")
    os.mkdir(canary_dir, 0o700)
    with open(os.path.join(canary_dir, "inside"), "w") as f:
        f.write("root-only inside\n")
    with open(canary_file, "w") as f:
        f.write("root-only canary\n")
    os.chmod(canary_file, 0o600)
    owner = unique("mallory")
    with open_session(supervisor, owner) as attacker:
        owner_dir = os.path.dirname(attacker.reply["workspace"])
        outside_before = {
            path: meta[:3]
            for path, meta in tree_snapshot(supervisor.base, skip=owner_dir).items()
        }
        canaries_before = {path: state(path) for path in (canary_dir, canary_file)}
        output, _ = bash(
            attacker,
            SWAPPER.format(owner_dir=owner_dir, canary_dir=canary_dir,
                           canary_file=canary_file, seconds=30),
        )
        assert "swapping" in output
        wait_until(lambda: os.path.lexists(os.path.join(owner_dir, "race.to-file")))
        outcomes = {"ok": 0}
        lock = threading.Lock()
        deadline = time.monotonic() + 6

        def hellos():
            while time.monotonic() < deadline:
                try:
                    session = Session.connect(supervisor.socket, owner, "race", timeout=30)
                except HelloRefused as e:
                    key = e.code
                else:
                    session.close()
                    key = "ok"
                with lock:
                    outcomes[key] = outcomes.get(key, 0) + 1

        threads = [threading.Thread(target=hellos) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        with open(os.path.join(owner_dir, "stop"), "w"):
            pass
        def swap_count():
            try:
                with open(os.path.join(owner_dir, "swaps")) as f:
                    return f.read().strip()
            except FileNotFoundError:
                return ""

        try:
            # The swapper writes its count with a plain redirection: wait for
            # the number, not just the file.
            swaps_text = wait_until(swap_count, timeout=10)
        except AssertionError:
            with open(os.path.join(attacker.reply["workspace"], "swapper.log")) as f:
                raise AssertionError(f"the swapper failed: {f.read()}") from None
        swaps = int(swaps_text)
    assert swaps > 1000, f"the tenant swapped only {swaps} times"
    assert sum(outcomes.values()) >= 40, outcomes
    assert set(outcomes) <= {"ok", "unavailable"}, outcomes
    assert outcomes.get("unavailable", 0) > 0, f"no hello ever met a symlink: {outcomes}"
    for path, before in canaries_before.items():
        assert state(path) == before, path
    assert os.listdir(canary_dir) == ["inside"]
    with open(os.path.join(canary_dir, "inside")) as f:
        assert f.read() == "root-only inside\n"
    with open(canary_file) as f:
        assert f.read() == "root-only canary\n"
    outside_after = {
        path: meta[:3] for path, meta in tree_snapshot(supervisor.base, skip=owner_dir).items()
    }
    # The one expected change: root's lifecycle record of the conversation
    # (supervisor.workspaces), a regular file named after the validated name.
    record = os.path.join(supervisor.state_dir, "lifecycle", owner, "race")
    assert outside_after.pop(record, (0, 0, 0o100600))[:3] == (0, 0, 0o100600)
    changed = {
        path: (outside_before.get(path), outside_after.get(path))
        for path in set(outside_before) | set(outside_after)
        if outside_before.get(path) != outside_after.get(path)
    }
    assert changed == {}, changed
