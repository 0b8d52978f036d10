"""SIGKILL during an S3 sync: the store stays consistent and the next start finishes the job.

A workspace is committed as version A, changed into version B (files
modified, added and deleted, a directory removed, a symlink retargeted), and
a child process (``tests/s3_crash_child.py``) syncs B and SIGKILLs itself at
one point of the sync. Then:

* the store's manifest parses and is exactly A (killed before the manifest
  PUT) or exactly B (after it), and every blob it names exists and hashes to
  its name;
* the local directory is still B: a sync never writes to it;
* "the next start", a fresh backend on the same state directory, hydrates
  and syncs; afterwards the store's manifest is B and the local directory
  is still B, byte for byte, with its modes and mtimes.
"""

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from plugins.storage_s3 import S3Storage, make_client, parse_location
from tests.s3_fixtures import (  # noqa: F401 (fixtures)
    StoreReader, give_to_owner, make_host, manifest_entries, s3_location, s3_server, snapshot,
    tree_entries, write_file,
)
from tests.support import REPO

OWNER_UID = 31337
CONVERSATION = "c-crash"

#: Where the child kills itself: the manifest the store must hold then, and
#: how many of B's new blobs must be in the store at least (None: all).
#: Uploads run in parallel, so more than the minimum may have landed, except
#: before the first blob PUT was sent.
POINTS = {
    "before_first_blob": ("A", 0),
    "after_first_blob": ("A", 1),
    "after_half_blobs": ("A", "half"),
    "before_manifest": ("A", None),
    "after_manifest": ("B", None),
    "after_state_saved": ("B", None),
}


def make_version_a(root: str) -> None:
    """Files, nested and empty directories, a symlink."""
    write_file(root, "README.md", b"version A\n")
    write_file(root, "src/main.py", b"print('a')\n" * 50, 0o755)
    write_file(root, "src/util.py", b"def util(): return 'a'\n")
    write_file(root, "src/keep.py", b"unchanged = True\n", 0o640)
    write_file(root, "docs/guide.md", b"# Guide\n" + b"text\n" * 200)
    write_file(root, "gone/one.txt", b"a directory that B removes")
    write_file(root, "gone/two.txt", b"with two files")
    write_file(root, "delete-me.txt", b"B deletes this file")
    write_file(root, "secret.txt", b"mode 0600", 0o600)
    os.makedirs(os.path.join(root, "empty/nested"))
    os.symlink("src/main.py", os.path.join(root, "latest"))


def make_version_b(root: str) -> int:
    """Turn A into B; return how many new blobs B needs (distinct new contents)."""
    write_file(root, "README.md", b"version B, longer than A\n")
    write_file(root, "src/main.py", b"print('b')\n" * 60, 0o755)
    write_file(root, "src/util.py", b"def util(): return 'b'\n", 0o600)  # content and mode
    os.chmod(os.path.join(root, "docs/guide.md"), 0o600)  # mode only: no new blob
    os.unlink(os.path.join(root, "delete-me.txt"))
    shutil.rmtree(os.path.join(root, "gone"))
    for i in range(12):
        write_file(root, f"added/file-{i:02d}.txt", f"added file {i}\n".encode() * (i + 1))
    write_file(root, "added/copy-of-keep.py", b"unchanged = True\n")  # an existing blob
    os.makedirs(os.path.join(root, "added/empty"))
    os.unlink(os.path.join(root, "latest"))
    os.symlink("added/file-00.txt", os.path.join(root, "latest"))
    return 3 + 12


def run_child(host, location: str, point: str, blobs: int) -> subprocess.CompletedProcess:
    parsed = parse_location(location)
    options = {
        "bucket": parsed.bucket, "prefix": parsed.prefix, "state_dir": host.state_dir,
        "owner": host.identity.owner, "uid": host.identity.uid, "gid": host.identity.gid,
        "directory": host.identity.directory, "conversation": CONVERSATION,
        "point": point, "blobs": blobs,
    }
    return subprocess.run([sys.executable, "-m", "tests.s3_crash_child", json.dumps(options)],
                          cwd=REPO, capture_output=True, timeout=60, stdin=subprocess.DEVNULL)


@pytest.mark.integration
@pytest.mark.parametrize("point", list(POINTS))
def test_sigkill_during_sync(point, make_host, s3_location, s3_server):
    """Killed at ``point`` of a sync: the store holds A or B whole, and the next start commits B."""
    host = make_host(OWNER_UID)
    identity = host.identity
    store = StoreReader(s3_server, s3_location, identity.owner, CONVERSATION)
    workspace = host.workspace(CONVERSATION)

    host.hydrate(CONVERSATION)
    make_version_a(workspace)
    give_to_owner(workspace, identity)
    assert host.sync(CONVERSATION).committed
    version_a = tree_entries(workspace)
    assert manifest_entries(store.manifest()) == version_a
    blobs_a = store.blobs()

    new_blobs = make_version_b(workspace)
    give_to_owner(workspace, identity)
    version_b = tree_entries(workspace)
    local_b = snapshot(workspace)
    hashes_b = {e[4] for e in version_b if e[1] == "file"}
    assert len(hashes_b - blobs_a) == new_blobs

    child = run_child(host, s3_location, point, new_blobs)
    assert child.returncode == -signal.SIGKILL, child.stderr.decode(errors="replace")

    # The store: exactly one whole version, every blob it names present and right.
    crashed = store.manifest()
    version, minimum = POINTS[point]
    assert manifest_entries(crashed) == {"A": version_a, "B": version_b}[version]
    store.check_blobs(crashed)
    uploaded = store.blobs() - blobs_a
    assert uploaded <= hashes_b  # nothing but B's contents went up
    minimum = {None: new_blobs, "half": (new_blobs + 1) // 2}.get(minimum, minimum)
    assert len(uploaded) >= minimum
    if minimum == 0:
        assert uploaded == set()
    assert snapshot(workspace) == local_b  # a sync never writes to the workspace

    # The next start: a fresh backend on the same state directory.
    host.storage.close()
    storage = S3Storage(parse_location(s3_location),
                        make_client(os.environ["CORRAL_S3_ENDPOINT_URL"]), host.state_dir)
    host.storage = storage  # closed by the fixture
    storage.hydrate_blocking(identity, CONVERSATION)
    storage.sync_blocking(identity, CONVERSATION)
    final = store.manifest()
    assert manifest_entries(final) == version_b
    store.check_blobs(final)
    assert snapshot(workspace) == local_b
    # A crash right after the manifest's commit is recognised at the next start:
    # the store already holds B, so nothing is kept aside as a conflict copy.
    assert store.conflict_copies() == {}