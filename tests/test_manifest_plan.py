"""Incremental change detection: a plan built on the previous one equals a fresh plan."""

import os
import random
import shutil
import time

import pytest

from supervisor import manifest as mf


def _fresh(root_fd, state):
    return mf.plan_sync(root_fd, state, os.getuid())


def _mutate(root: str, rng: random.Random) -> None:
    files = []
    dirs = [root]
    for directory, subdirs, names in os.walk(root):
        dirs += [os.path.join(directory, d) for d in subdirs]
        files += [os.path.join(directory, n) for n in names]
    action = rng.choice(["write", "same-size", "add", "mkdir", "rmdir", "chmod", "link",
                         "unlink", "to-dir", "touch-back"])
    if action in ("write", "same-size", "chmod", "unlink", "to-dir", "touch-back") and not files:
        action = "add"
    if action == "write":
        with open(rng.choice(files), "ab") as f:
            f.write(os.urandom(rng.randint(1, 64)))
    elif action == "same-size":
        # Same size, mtime set back: only ctime (and the content) tell.
        path = rng.choice(files)
        st = os.lstat(path)
        if os.path.islink(path):
            return
        with open(path, "r+b") as f:
            data = f.read()
            f.seek(0)
            f.write(bytes(b ^ 0xFF for b in data) or b"x")
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    elif action == "add":
        with open(os.path.join(rng.choice(dirs), f"f{rng.randint(0, 10**6)}"), "wb") as f:
            f.write(os.urandom(rng.randint(0, 64)))
    elif action == "mkdir":
        os.makedirs(os.path.join(rng.choice(dirs), f"d{rng.randint(0, 10**6)}", "inner"),
                    exist_ok=True)
    elif action == "rmdir" and len(dirs) > 1:
        shutil.rmtree(rng.choice(dirs[1:]), ignore_errors=True)
    elif action == "chmod" and not os.path.islink(files[0]):
        os.chmod(rng.choice([f for f in files if not os.path.islink(f)] or dirs),
                 rng.choice([0o600, 0o644, 0o755]))
    elif action == "link":
        os.symlink(rng.choice(["/etc/shadow", "a", "../b"]),
                   os.path.join(rng.choice(dirs), f"l{rng.randint(0, 10**6)}"))
    elif action == "unlink":
        os.unlink(rng.choice(files))
    elif action == "to-dir":
        path = rng.choice(files)
        os.unlink(path)
        os.mkdir(path)
    elif action == "touch-back":
        path = rng.choice(files)
        if not os.path.islink(path):
            os.utime(path, ns=(0, 0))


@pytest.mark.parametrize("seed", range(8))
def test_incremental_plans_equal_fresh_plans(tmp_path, seed):
    rng = random.Random(seed)
    root = tmp_path / "ws"
    root.mkdir()
    for i in range(30):
        (root / f"f{i}").write_bytes(os.urandom(i))
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        state = mf.SyncState()
        plan = mf.plan_sync(fd, state, os.getuid())
        state = mf.SyncState(manifest=plan.manifest, stamps=plan.stamps, plan=plan)
        for _ in range(40):
            for _ in range(rng.randint(0, 3)):
                _mutate(str(root), rng)
            plan = mf.plan_sync(fd, state, os.getuid(), previous=state.plan)
            fresh = mf.plan_sync(fd, mf.SyncState(), os.getuid())
            assert plan.manifest == fresh.manifest
            assert {p: s.sha256 for p, s in plan.stamps.items()} == {
                p: s.sha256 for p, s in fresh.stamps.items()}
            if rng.random() < 0.5:  # committed, or not: both must hold
                state = mf.SyncState(manifest=plan.manifest, stamps=plan.stamps, plan=plan)
            else:
                state.plan = plan
    finally:
        os.close(fd)


def test_an_unchanged_walk_reuses_the_plan(tmp_path):
    """Nothing changed: no hashing and the very same manifest object."""
    (tmp_path / "a").write_bytes(b"a")
    time.sleep(mf.RACY_NS / 1e9)  # out of the racy window (see the next test)
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        first = mf.plan_sync(fd, mf.SyncState(), os.getuid())
        state = mf.SyncState(manifest=first.manifest, stamps=first.stamps, plan=first)
        again = mf.plan_sync(fd, state, os.getuid(), previous=first)
        assert again.manifest is first.manifest and again.hashed == 0
        (tmp_path / "b").write_bytes(b"b")
        third = mf.plan_sync(fd, state, os.getuid(), previous=again)
        assert third.hashed == 1 and [e.path for e in third.manifest.entries] == ["a", "b"]
    finally:
        os.close(fd)


def test_a_file_changed_just_before_the_walk_is_hashed_again(tmp_path, monkeypatch):
    """Coarse timestamps: a rewrite in the same clock tick leaves size, mtime, ctime and inode
    as they were. A file whose ctime is that recent is never trusted by the next plan.
    (The window is widened to an hour here, so a slow machine cannot leave it.)
    """
    monkeypatch.setattr(mf, "RACY_NS", 3600 * 10**9)
    (tmp_path / "a").write_bytes(b"one")
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        first = mf.plan_sync(fd, mf.SyncState(), os.getuid())
        state = mf.SyncState(manifest=first.manifest, stamps=first.stamps, plan=first)
        assert first.scan["a"].ctime_ns == -1 and first.stamps["a"].mtime_ns == -1
        again = mf.plan_sync(fd, state, os.getuid(), previous=first)
        assert again.hashed == 1
    finally:
        os.close(fd)


class _Store:
    def __init__(self):
        self.blobs = {}

    def exists(self, sha):
        return sha in self.blobs

    def put(self, sha, body, size):
        data = body.read()
        assert mf.hashlib.sha256(data).hexdigest() == sha
        self.blobs[sha] = data


def _upload(root, fd, plan, store):
    from concurrent.futures import ThreadPoolExecutor

    spool = root.parent / "spool"
    spool.mkdir(exist_ok=True)
    with ThreadPoolExecutor(2) as pool:
        return mf.upload_missing(fd, plan, set(), os.getuid(), store.exists, store.put, pool,
                                 str(spool))


def _check_complete(plan, store):
    for entry in plan.manifest.entries:
        if entry.kind == mf.FILE:
            assert entry.sha256 in store.blobs, entry.path


def test_files_that_go_during_the_upload_are_left_out(tmp_path):
    root = tmp_path / "ws"
    (root / "d").mkdir(parents=True)
    (root / "d" / "a").write_bytes(b"a")
    (root / "b").write_bytes(b"b")
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        plan = mf.plan_sync(fd, mf.SyncState(), os.getuid())
        os.rename(root / "d", root / "d2")  # after the walk, before the upload
        store = _Store()
        _upload(root, fd, plan, store)
        assert [e.path for e in plan.manifest.entries] == ["b", "d"]
        _check_complete(plan, store)
    finally:
        os.close(fd)


def test_shared_bytes_are_uploaded_from_a_path_that_still_holds_them(tmp_path):
    root = tmp_path / "ws"
    root.mkdir()
    (root / "one").write_bytes(b"same")
    (root / "two").write_bytes(b"same")
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        plan = mf.plan_sync(fd, mf.SyncState(), os.getuid())
        (root / "one").write_bytes(b"changed")  # the first path's bytes change meanwhile
        store = _Store()
        _upload(root, fd, plan, store)
        entries = plan.manifest.by_path()
        assert store.blobs[entries["one"].sha256] == b"changed"
        assert store.blobs[entries["two"].sha256] == b"same"
        _check_complete(plan, store)
    finally:
        os.close(fd)


def test_a_file_replaced_during_upload_then_removed_leaves_the_manifest(tmp_path):
    """A path decided again later (its bytes changed mid-upload) is still noticed when it goes."""
    root = tmp_path / "ws"
    root.mkdir()
    (root / "keep").write_bytes(b"keep")
    (root / "f3").write_bytes(b"old")
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        plan = mf.plan_sync(fd, mf.SyncState(), os.getuid())
        (root / "f3").write_bytes(b"rewritten")  # between the walk and the upload
        _upload(root, fd, plan, _Store())
        state = mf.SyncState(manifest=plan.manifest, stamps=plan.stamps, plan=plan)
        os.unlink(root / "f3")
        after = mf.plan_sync(fd, state, os.getuid(), previous=plan)
        assert [e.path for e in after.manifest.entries] == ["keep"]
        assert after.changed(state.manifest)
    finally:
        os.close(fd)
