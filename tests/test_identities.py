"""Owner identities: the hash, probing, ignoring non-owners, uid_conflict, races."""

import os
import stat
import threading

import pytest

from supervisor.errors import LIMIT, UID_CONFLICT, UNAVAILABLE, CorralError
from supervisor.identities import (
    IdentityStore,
    choose_uid,
    hashed_uid,
    scan_owner_uids,
)

RANGE = (30000, 30009)


def colliding_names(uid_range=RANGE, count=2) -> list[str]:
    """Owner names whose first-choice uids are equal."""
    seen: dict[int, list[str]] = {}
    for i in range(1000):
        name = f"owner{i}"
        names = seen.setdefault(hashed_uid(name, uid_range), [])
        names.append(name)
        if len(names) == count:
            return names
    raise AssertionError("no collision found")


def test_hash_is_stable_and_in_range():
    """The first-choice uid depends only on the name and lies in the range."""
    uid = hashed_uid("alice", (20000, 59999))
    assert uid == hashed_uid("alice", (20000, 59999))
    assert 20000 <= uid <= 59999
    assert len({hashed_uid(f"o{i}", (20000, 59999)) for i in range(100)}) > 90


def test_probing_skips_used_uids_and_wraps():
    """A taken first choice moves to the next free uid, wrapping at the top."""
    first = hashed_uid("alice", RANGE)
    assert choose_uid("alice", set(), RANGE) == first
    assert choose_uid("alice", {first}, RANGE) == (first + 1 if first < RANGE[1] else RANGE[0])
    used = set(range(RANGE[0], RANGE[1] + 1)) - {RANGE[0]}
    assert choose_uid("alice", used, RANGE) == RANGE[0]


def test_full_range_is_limit():
    """When every uid is taken the refusal is 'limit' with advice."""
    with pytest.raises(CorralError) as caught:
        choose_uid("alice", set(range(RANGE[0], RANGE[1] + 1)), RANGE)
    assert caught.value.code == LIMIT


@pytest.fixture
def root_dir(tmp_path):
    path = tmp_path / "workspaces"
    path.mkdir()
    return path


def test_unprivileged_store_uses_own_uid(root_dir):
    """Without root, every owner runs as the supervisor's uid, each in its own directory."""
    store = IdentityStore(str(root_dir), RANGE, privileged=False)
    alice = store.resolve("alice")
    bob = store.resolve("bob")
    assert alice.uid == bob.uid == os.getuid()
    assert os.path.isdir(alice.directory) and os.path.isdir(bob.directory)
    assert stat.S_IMODE(os.stat(alice.directory).st_mode) == 0o700



@pytest.mark.root
def test_new_owner_directory_owned_and_private(root_dir):
    """A new owner's directory is created owned by its hashed uid, mode 0700."""
    store = IdentityStore(str(root_dir), RANGE, privileged=True)
    identity = store.resolve("alice")
    st = os.lstat(identity.directory)
    assert identity.uid == hashed_uid("alice", RANGE)
    assert (st.st_uid, st.st_gid) == (identity.uid, identity.uid)
    assert stat.S_IMODE(st.st_mode) == 0o700
    assert store.resolve("alice") == identity
    assert not [n for n in os.listdir(root_dir) if n.startswith(".new-")]


@pytest.mark.root
def test_existing_directory_keeps_its_uid(root_dir):
    """An owner whose directory exists keeps that directory's uid, hash or not."""
    (root_dir / "alice").mkdir()
    os.chown(root_dir / "alice", 30007, 30007)
    store = IdentityStore(str(root_dir), RANGE, privileged=True)
    assert store.resolve("alice").uid == 30007


@pytest.mark.root
def test_collision_probes_to_a_distinct_uid(root_dir):
    """Two owners with the same hashed uid get different uids."""
    first, second = colliding_names()
    store = IdentityStore(str(root_dir), RANGE, privileged=True)
    a, b = store.resolve(first), store.resolve(second)
    assert a.uid == hashed_uid(first, RANGE)
    assert b.uid != a.uid


@pytest.mark.root
def test_concurrent_first_hellos_get_distinct_uids(root_dir):
    """Colliding owners resolved at once by many threads and two stores never share a uid."""
    names = colliding_names(count=3)
    stores = [IdentityStore(str(root_dir), RANGE, privileged=True) for _ in range(2)]
    results = {}
    barrier = threading.Barrier(len(names) * 2)

    def resolve(store, name, key):
        barrier.wait()
        results[key] = store.resolve(name)

    threads = [
        threading.Thread(target=resolve, args=(store, name, (i, name)))
        for i, store in enumerate(stores) for name in names
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    by_name = {}
    for (_, name), identity in results.items():
        by_name.setdefault(name, set()).add(identity.uid)
    assert all(len(uids) == 1 for uids in by_name.values())
    assert len({uids.pop() for uids in by_name.values()}) == len(names)


@pytest.mark.root
def test_non_owner_entries_are_ignored_and_never_adopted(root_dir):
    """Stray files, symlinks, root's and out-of-range directories do not count as used uids."""
    first = hashed_uid("alice", RANGE)
    (root_dir / "stray").write_text("x")
    os.chown(root_dir / "stray", first, first)
    (root_dir / "outside").mkdir()
    os.chown(root_dir / "outside", 12345, 12345)
    (root_dir / "rootdir").mkdir()
    (root_dir / ".hidden").mkdir()
    os.chown(root_dir / ".hidden", first, first)
    os.symlink("/tmp", root_dir / "link")
    os.lchown(root_dir / "link", first, first)
    fd = os.open(root_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert scan_owner_uids(fd, RANGE) == {}
    finally:
        os.close(fd)
    store = IdentityStore(str(root_dir), RANGE, privileged=True)
    assert store.resolve("alice").uid == first
    for name in ("rootdir", "outside", "link", "stray"):
        with pytest.raises(CorralError) as caught:
            store.resolve(name)
        assert caught.value.code == UNAVAILABLE
    assert os.lstat(root_dir / "rootdir").st_uid == 0


@pytest.mark.root
def test_shared_uid_is_uid_conflict(root_dir):
    """Two owner directories with one uid: both owners are refused, nothing changes."""
    for name in ("alice", "bob"):
        (root_dir / name).mkdir()
        os.chown(root_dir / name, 30003, 30003)
    store = IdentityStore(str(root_dir), RANGE, privileged=True)
    for name in ("alice", "bob"):
        with pytest.raises(CorralError) as caught:
            store.resolve(name)
        assert caught.value.code == UID_CONFLICT
        assert "alice" in caught.value.message and "bob" in caught.value.message
    assert os.lstat(root_dir / "alice").st_uid == 30003


@pytest.mark.root
def test_leftover_temporary_directories_are_removed(root_dir):
    """A crash between mkdir and rename leaves a .new- directory that start-up removes."""
    (root_dir / ".new-alice-1234").mkdir()
    store = IdentityStore(str(root_dir), RANGE, privileged=True)
    assert store.remove_leftovers() == [".new-alice-1234"]
    assert not (root_dir / ".new-alice-1234").exists()
