"""The ``s3`` storage backend against a real S3-compatible server process.

The server is moto's standalone server started by ``tests.s3_fixtures``
(or the endpoint in ``CORRAL_TEST_S3_ENDPOINT``). boto3 is never mocked:
request counts come from boto3's own event hooks on real requests.
"""

import hashlib
import os
import stat
import threading
import types

import pytest
import pytest_twisted

from plugins.storage_s3 import SyncConflict, check_endpoint, parse_location
from supervisor import manifest as mf
from supervisor.plugins import PluginRegistry
from tests.s3_fixtures import make_host, s3_location, s3_server  # noqa: F401 (fixtures)
from tests.support import IS_ROOT, traversable_tempdir

OWNER_UID = 31337


def write(root: str, path: str, data: bytes, mode: int = 0o644) -> None:
    """Create ``root/path`` (and its parents) with ``data`` and ``mode``, owned like the root."""
    full = os.path.join(root, path)
    os.makedirs(os.path.dirname(full), exist_ok=True)
    with open(full, "wb") as f:
        f.write(data)
    os.chmod(full, mode)
    _own_like_root(root, full)


def _own_like_root(root: str, full: str) -> None:
    if IS_ROOT:
        st = os.stat(root)
        relative = os.path.relpath(full, root)
        parts = relative.split(os.sep)
        for i in range(1, len(parts) + 1):
            os.chown(os.path.join(root, *parts[:i]), st.st_uid, st.st_gid,
                     follow_symlinks=False)


def snapshot(root: str) -> dict:
    """``{path: (kind, mode, sha256 or target, mtime_ns)}`` of a tree, by lstat."""
    found = {}
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            full = os.path.join(directory, name)
            path = os.path.relpath(full, root)
            st = os.lstat(full)
            if stat.S_ISLNK(st.st_mode):
                found[path] = ("symlink", os.readlink(full))
            elif stat.S_ISDIR(st.st_mode):
                found[path] = ("dir", stat.S_IMODE(st.st_mode))
            else:
                with open(full, "rb") as f:
                    digest = hashlib.sha256(f.read()).hexdigest()
                found[path] = ("file", stat.S_IMODE(st.st_mode), digest, st.st_mtime_ns)
    return found


def populate(root: str) -> None:
    """A tree with nested directories, an empty directory, modes and symlinks."""
    write(root, "README.md", b"hello\n")
    write(root, "bin/run.sh", b"#!/bin/sh\necho run\n", 0o755)
    write(root, "src/pkg/deep/module.py", b"x = 1\n" * 1000, 0o640)
    write(root, "src/pkg/secret.txt", b"mine only", 0o600)
    write(root, "same-a.txt", b"duplicate content")
    write(root, "same-b.txt", b"duplicate content")
    write(root, "empty.txt", b"")
    os.makedirs(os.path.join(root, "empty/nested/dir"))
    os.chmod(os.path.join(root, "empty/nested"), 0o750)
    _own_like_root(root, os.path.join(root, "empty/nested/dir"))
    os.symlink("src/pkg", os.path.join(root, "link-to-pkg"))
    os.symlink("/etc/passwd", os.path.join(root, "abs-link"))
    os.symlink("does/not/exist", os.path.join(root, "dangling"))
    for name in ("link-to-pkg", "abs-link", "dangling"):
        _own_like_root(root, os.path.join(root, name))


# --- configuration ----------------------------------------------------------


class TestConfiguration:
    """The plugin argument and the endpoint variable."""

    def test_locations(self):
        """``s3://BUCKET/PREFIX`` parses; the prefix may be empty or nested."""
        assert parse_location("s3://bucket-1/a/b/").prefix == "a/b"
        assert parse_location("s3://bucket-1").prefix == ""
        assert parse_location("s3://bucket-1/p").key("alice", "blobs", "x") == "p/alice/blobs/x"
        assert parse_location("s3://bucket-1").key("alice", "blobs") == "alice/blobs"

    @pytest.mark.parametrize("bad", [
        None, "", "bucket/prefix", "http://bucket/prefix", "s3://B/x", "s3://ab/x",
        "s3://key:secret@bucket/x", "s3://bucket/../x", "s3://bucket/a//b", "s3://bucket/x?y=1",
    ])
    def test_bad_locations_are_sentences(self, bad):
        """A bad location is refused with a sentence that shows what to write."""
        with pytest.raises(ValueError) as raised:
            parse_location(bad)
        assert len(str(raised.value)) > 30

    def test_endpoint_without_credentials(self):
        """An endpoint URL that embeds credentials is refused (they would reach logs)."""
        assert check_endpoint("http://127.0.0.1:9000") == "http://127.0.0.1:9000"
        with pytest.raises(ValueError, match="must not carry credentials"):
            check_endpoint("http://key:secret@127.0.0.1:9000")
        with pytest.raises(ValueError):
            check_endpoint("ftp://example.com")

    def test_registry_refuses_bad_argument(self):
        """Through the plugin manager a bad argument is a ConfigError naming the key."""
        from supervisor.errors import ConfigError

        registry = PluginRegistry(entry_points=False)
        with pytest.raises(ConfigError, match="storage = 's3'"):
            registry.build("storage", "s3", types.SimpleNamespace(state_dir="/nonexistent"))


class TestManifestFormat:
    """The manifest refuses entries that could escape the workspace."""

    @pytest.mark.parametrize("path", ["../x", "/etc/passwd", "a/../../b", "a//b", ".", "a/./b",
                                      "", "a\0b"])
    def test_unsafe_paths(self, path):
        """Paths with ``..``, ``.``, empty parts, NUL or a leading slash are refused."""
        document = {"format": mf.FORMAT, "version": mf.VERSION,
                    "entries": [{"path": path, "type": "dir", "mode": 0o755}]}
        with pytest.raises(mf.ManifestError):
            mf.Manifest.from_json(document)

    def test_version_and_parents(self):
        """An unknown version, or an entry without its directory, is refused."""
        with pytest.raises(mf.ManifestError, match="version"):
            mf.Manifest.from_json({"format": mf.FORMAT, "version": 99, "entries": []})
        with pytest.raises(mf.ManifestError, match="without its directory"):
            mf.Manifest.from_json({"format": mf.FORMAT, "version": 1, "entries": [
                {"path": "a/b", "type": "symlink", "target": "x"}]})

    def test_round_trip(self):
        """A manifest survives its own serialisation, setuid bits stripped on load."""
        m = mf.Manifest.of([
            mf.Entry("d", "dir", mode=0o755),
            mf.Entry("d/f", "file", mode=0o644, size=3, sha256="a" * 64, mtime_ns=5),
            mf.Entry("l", "symlink", target="../../etc"),
        ])
        assert mf.Manifest.from_bytes(m.to_bytes("alice", "c")) == m
        raw = m.to_json()
        raw["entries"][1]["mode"] = 0o4755
        assert mf.Manifest.from_json(raw).by_path()["d/f"].mode == 0o755


# --- against the server -----------------------------------------------------


@pytest.mark.integration
class TestS3Backend:
    """Hydrate and sync against a real S3-compatible server."""

    def test_registry_builds_a_verified_backend(self, s3_location):
        """``s3:s3://...`` builds through the plugin manager and provides IStorageBackend."""
        registry = PluginRegistry(entry_points=False)
        base = traversable_tempdir("corral-s3-reg-")
        backend = registry.build("storage", "s3:" + s3_location,
                                 types.SimpleNamespace(state_dir=base))
        assert backend.name == "s3"
        backend.close()

    def test_round_trip(self, make_host):
        """Files, modes, mtimes, nested and empty directories and symlinks reach a second host."""
        a, b = make_host(), make_host()
        a.hydrate()
        populate(a.workspace())
        stats = a.sync()
        assert stats.committed and stats.files == 7
        assert stats.uploaded == 6  # two files share one blob
        path, hydrated = b.hydrate()
        assert path == b.workspace()
        assert snapshot(b.workspace()) == snapshot(a.workspace())
        assert hydrated.downloaded == 7
        assert os.readlink(os.path.join(b.workspace(), "abs-link")) == "/etc/passwd"

    def test_warm_rehydrate_downloads_nothing(self, make_host):
        """A directory that already matches costs no blob download, nor the manifest's body."""
        a, b = make_host(), make_host()
        a.hydrate()
        populate(a.workspace())
        a.sync()
        b.hydrate()
        a.requests.clear()
        b.requests.clear()
        _, stats_a = a.hydrate()
        _, stats_b = b.hydrate()
        for host, stats in ((a, stats_a), (b, stats_b)):
            assert host.calls("GetObject", "/blobs/") == []
            assert stats.downloaded == 0 and stats.hashed == 0
            assert [op for op, _ in host.requests] == ["GetObject"]  # the manifest, 304

    def test_one_changed_file_uploads_one_blob_and_the_manifest(self, make_host):
        """Changing one file puts exactly its blob and the manifest; nothing else is hashed."""
        a = make_host()
        a.hydrate()
        populate(a.workspace())
        a.sync()
        a.requests.clear()
        write(a.workspace(), "src/pkg/deep/module.py", b"x = 2\n", 0o640)
        stats = a.sync()
        puts = a.calls("PutObject")
        assert len(puts) == 2
        assert puts[-1].endswith("/conversations/c-1/manifest.json")
        assert puts[0].endswith("/blobs/" + hashlib.sha256(b"x = 2\n").hexdigest())
        assert stats.hashed == 1 and stats.uploaded == 1

    def test_unchanged_sync_commits_nothing(self, make_host):
        """A sync with nothing changed makes no request at all."""
        a = make_host()
        a.hydrate()
        populate(a.workspace())
        a.sync()
        a.requests.clear()
        stats = a.sync()
        assert not stats.committed and a.requests == []

    def test_deletions_propagate(self, make_host):
        """Files and directories deleted locally leave the manifest and the other host."""
        a, b = make_host(), make_host()
        a.hydrate()
        populate(a.workspace())
        a.sync()
        b.hydrate()
        os.unlink(os.path.join(a.workspace(), "README.md"))
        os.unlink(os.path.join(a.workspace(), "dangling"))
        import shutil
        shutil.rmtree(os.path.join(a.workspace(), "empty"))
        a.sync()
        _, stats = b.hydrate()
        remaining = snapshot(b.workspace())
        assert "README.md" not in remaining and "dangling" not in remaining
        assert not any(p == "empty" or p.startswith("empty/") for p in remaining)
        assert remaining == snapshot(a.workspace())
        assert stats.downloaded == 0 and stats.removed >= 5

    def test_concurrent_commits_one_wins_nothing_lost(self, make_host, s3_server):
        """Two hosts commit one conversation at once: one wins, the other gets SyncConflict and its version is kept."""
        a, b = make_host(), make_host()
        a.hydrate()
        write(a.workspace(), "shared.txt", b"base")
        a.sync()
        b.hydrate()
        write(a.workspace(), "from-a.txt", b"work of host a")
        write(b.workspace(), "from-b.txt", b"work of host b")
        barrier = threading.Barrier(2)
        outcomes = {}

        def run(name, host):
            barrier.wait()
            try:
                outcomes[name] = host.sync()
            except SyncConflict as e:
                outcomes[name] = e

        threads = [threading.Thread(target=run, args=item) for item in (("a", a), ("b", b))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        conflicts = [n for n, o in outcomes.items() if isinstance(o, SyncConflict)]
        assert len(conflicts) == 1, outcomes
        loser_name = conflicts[0]
        winner, loser = (b, a) if loser_name == "a" else (a, b)
        error = outcomes[loser_name]
        assert "changed by another host" in str(error) and error.conflict_key
        # The winner's version is the manifest; the loser's is the conflict copy, blobs included.
        copy = mf.Manifest.from_bytes(s3_server.client.get_object(
            Bucket=s3_server.bucket, Key=error.conflict_key)["Body"].read())
        lost = copy.by_path()[f"from-{loser_name}.txt"]
        s3_server.client.head_object(Bucket=s3_server.bucket,
                                     Key=error.conflict_key.split("/conversations/")[0]
                                     + "/blobs/" + lost.sha256)
        # The loser's next attach loads the winner's version; a retry keeps no second copy.
        loser.hydrate()
        assert snapshot(loser.workspace()) == snapshot(winner.workspace())

    def test_sequential_stale_commit_conflicts(self, make_host):
        """A host whose base is stale cannot overwrite the other's commit."""
        a, b = make_host(), make_host()
        a.hydrate()
        b.hydrate()
        write(a.workspace(), "a.txt", b"a")
        a.sync()  # creates the manifest (If-None-Match: *)
        write(b.workspace(), "b.txt", b"b")
        with pytest.raises(SyncConflict):
            b.sync()  # b also believes it is new
        b.hydrate()
        assert sorted(os.listdir(b.workspace())) == ["a.txt"]

    def test_existing_local_directory_is_adopted(self, make_host):
        """Switching from local to s3: files already in the directory are kept and committed."""
        a, b = make_host(), make_host()
        os.mkdir(a.workspace(), 0o700)
        _own_like_root(a.identity.directory, a.workspace())
        write(a.workspace(), "old/notes.txt", b"from the local backend")
        _, stats = a.hydrate()
        assert stats.committed_first
        b.hydrate()
        assert snapshot(b.workspace()) == snapshot(a.workspace())

    def test_unsynced_changes_survive_a_rehydrate(self, make_host):
        """Changes whose sync never ran are committed at the next attach, not thrown away."""
        a = make_host()
        a.hydrate()
        write(a.workspace(), "x.txt", b"1")
        a.sync()
        write(a.workspace(), "x.txt", b"2 (never synced)")
        a.hydrate()
        with open(os.path.join(a.workspace(), "x.txt"), "rb") as f:
            assert f.read() == b"2 (never synced)"

    def test_state_is_root_private_and_outside_the_workspace(self, make_host):
        """The bookkeeping file lives under the state directory, mode 0600, not in the workspace."""
        a = make_host()
        a.hydrate()
        populate(a.workspace())
        a.sync()
        state = os.path.join(a.state_dir, "s3-state", "alice", "c-1.json")
        assert stat.S_IMODE(os.stat(state).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(os.path.dirname(state)).st_mode) == 0o700
        assert not any(".json" in p for p in snapshot(a.workspace()))


@pytest.mark.integration
@pytest.mark.root
class TestRootSideSafety:
    """Root never reads through, writes through or chowns through a tenant's plant."""

    def test_hydrated_entries_belong_to_the_owner(self, make_host):
        """Every hydrated file, directory and symlink is owned by the owner's uid."""
        a, b = make_host(), make_host()
        a.hydrate()
        populate(a.workspace())
        a.sync()
        b.hydrate()
        for directory, dirs, files in os.walk(b.workspace()):
            for name in dirs + files + ["."]:
                st = os.lstat(os.path.join(directory, name))
                assert (st.st_uid, st.st_gid) == (OWNER_UID, OWNER_UID), name

    def test_planted_symlink_to_root_only_file(self, make_host, s3_server):
        """A symlink (and a hard link) to a root-only file is stored as a link, its content never read."""
        secret_dir = traversable_tempdir("corral-secret-")
        secret = os.path.join(secret_dir, "shadow")
        content = b"root-only secret " + os.urandom(8).hex().encode()
        with open(secret, "wb") as f:
            f.write(content)
        os.chmod(secret, 0o600)
        a, b = make_host(), make_host()
        a.hydrate()
        os.symlink(secret, os.path.join(a.workspace(), "leak"))
        os.link(secret, os.path.join(a.workspace(), "hardlink"))
        stats = a.sync()
        assert stats.skipped == 1  # the hard link: not the owner's file
        digest = hashlib.sha256(content).hexdigest()
        blobs = [k for k in a.calls("PutObject") if k.endswith(digest)]
        assert blobs == []
        b.hydrate()
        assert os.readlink(os.path.join(b.workspace(), "leak")) == secret
        assert not os.path.exists(os.path.join(b.workspace(), "hardlink"))
        st = os.stat(secret)
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o600)

    def test_symlinked_directory_is_replaced_not_followed(self, make_host):
        """A tenant's symlink where the manifest has a directory is replaced; root never writes through it."""
        target = traversable_tempdir("corral-target-")
        os.chmod(target, 0o700)
        a, b = make_host(), make_host()
        a.hydrate()
        write(a.workspace(), "d/f.txt", b"payload")
        a.sync()
        b.hydrate()
        write(a.workspace(), "d/f.txt", b"new payload")
        write(a.workspace(), "d/g.txt", b"another")
        a.sync()
        # Meanwhile the tenant on host b swaps the directory for a symlink to a root directory.
        import shutil
        shutil.rmtree(os.path.join(b.workspace(), "d"))
        os.symlink(target, os.path.join(b.workspace(), "d"))
        b.hydrate()  # b's change conflicts (kept as a copy); a's version is loaded
        assert os.listdir(target) == []
        d = os.path.join(b.workspace(), "d")
        assert not os.path.islink(d) and os.path.isdir(d)
        with open(os.path.join(d, "f.txt"), "rb") as f:
            assert f.read() == b"new payload"
        assert os.stat(target).st_uid == 0

    def test_directory_swapped_for_symlink_during_hydrate(self, make_host):
        """A directory swapped for a symlink between the scan and a download is refused, not followed."""
        from concurrent.futures import ThreadPoolExecutor

        target = traversable_tempdir("corral-target-")
        os.chmod(target, 0o700)
        a, b = make_host(), make_host()
        a.hydrate()
        write(a.workspace(), "d/f1.txt", b"one")
        write(a.workspace(), "d/f2.txt", b"two")
        a.sync()
        b.storage._transfers = ThreadPoolExecutor(1)  # downloads in manifest order
        real_fetcher = b.storage._fetcher
        d = os.path.join(b.workspace(), "d")

        def racing_fetcher(owner):
            fetch = real_fetcher(owner)

            def swap_then_fetch(sha256, sink):
                if not os.path.islink(d):
                    os.rename(d, d + "-moved")
                    os.symlink(target, d)
                fetch(sha256, sink)
            return swap_then_fetch

        b.storage._fetcher = racing_fetcher
        with pytest.raises(OSError):
            b.hydrate()
        assert os.listdir(target) == []

    def test_hard_link_to_root_file_is_never_chowned(self, make_host):
        """A hard link to a root file where the manifest has a file is replaced, never chowned or rewritten."""
        secret_dir = traversable_tempdir("corral-secret-")
        secret = os.path.join(secret_dir, "root-file")
        with open(secret, "wb") as f:
            f.write(b"payload")  # same size and content as the manifest's file
        os.chmod(secret, 0o600)
        a, b = make_host(), make_host()
        a.hydrate()
        write(a.workspace(), "f.txt", b"payload", 0o644)
        a.sync()
        b.hydrate()
        b_file = os.path.join(b.workspace(), "f.txt")
        os.unlink(b_file)
        os.link(secret, b_file)
        write(a.workspace(), "g.txt", b"other")
        a.sync()
        b.hydrate()
        st = os.stat(secret)
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, 0, 0o600)
        assert os.stat(b_file).st_ino != st.st_ino
        assert os.stat(b_file).st_uid == OWNER_UID


# --- the shared contract ----------------------------------------------------


def _write_as_owner(identity, path: str, name: str, data: str) -> None:
    """Write a file in the workspace as the owner's uid (root drops to it), like a runner."""
    import subprocess

    kwargs = {"user": identity.uid, "group": identity.gid, "extra_groups": []} if IS_ROOT else {}
    subprocess.run(["/bin/sh", "-c", 'printf %s "$1" > "$2"', "sh", data, name],
                   cwd=path, check=True, **kwargs)


@pytest.fixture(params=["local", "s3"])
def backend(request, make_host):
    """(storage backend, identity) for each built-in backend, on one host's directories."""
    host = make_host()
    if request.param == "local":
        registry = PluginRegistry(entry_points=False)
        return registry.build("storage", "local", types.SimpleNamespace()), host.identity
    return host.storage, host.identity


@pytest.mark.integration
class TestStorageContract:
    """What every IStorageBackend must do, run against ``local`` and ``s3``."""

    @pytest_twisted.ensureDeferred
    async def test_files_survive_release_and_prepare(self, backend):
        """Prepare, write as the owner, release, prepare again: the file is there, owned by the owner."""
        storage, identity = backend
        path = await storage.prepare_workspace(identity, "c-contract")
        assert path == os.path.join(identity.directory, "c-contract")
        st = os.stat(path)
        assert st.st_uid == identity.uid and stat.S_IMODE(st.st_mode) == 0o700
        _write_as_owner(identity, path, "note.txt", "kept")
        await storage.release_workspace(identity, "c-contract", path)
        again = await storage.prepare_workspace(identity, "c-contract")
        assert again == path
        with open(os.path.join(again, "note.txt")) as f:
            assert f.read() == "kept"
        assert os.stat(os.path.join(again, "note.txt")).st_uid == identity.uid

    @pytest_twisted.ensureDeferred
    async def test_refuses_a_symlinked_conversation(self, backend):
        """A conversation path that is a symlink is refused, never followed."""
        storage, identity = backend
        target = traversable_tempdir("corral-elsewhere-")
        os.symlink(target, os.path.join(identity.directory, "c-link"))
        with pytest.raises(NotADirectoryError):
            await storage.prepare_workspace(identity, "c-link")
        assert os.listdir(target) == []


@pytest.mark.integration
@pytest.mark.root
def test_conversation_moves_between_two_supervisors(start_supervisor, isolation, s3_location):
    """Two supervisors on two workspace roots share a bucket: a conversation moves between them."""
    from supervisor.client import Session
    from tests.support import wait_until

    endpoint = {"CORRAL_S3_ENDPOINT_URL": os.environ["CORRAL_S3_ENDPOINT_URL"]}
    first = start_supervisor(isolation, extra_args=["--storage", f"s3:{s3_location}"], env=endpoint)
    second = start_supervisor(isolation, extra_args=["--storage", f"s3:{s3_location}"], env=endpoint)
    with Session.connect(first.socket, "alice", "moving") as session:
        session.initialize()
        session.call_tool("write", {"path": "notes/plan.txt", "content": "step one\n"})
    wait_until(lambda: [e for e in first.audit_events() if e["event"] == "workspace_synced"])
    synced = [e for e in first.audit_events() if e["event"] == "workspace_synced"][0]
    assert synced["owner"] == "alice" and synced["uploaded"] >= 1
    with Session.connect(second.socket, "alice", "moving") as session:
        session.initialize()
        result = session.call_tool("read", {"path": "notes/plan.txt"})
        assert result["content"][0]["text"].startswith("step one")
    with open(first.audit_path) as f:
        audit = f.read()
    assert "step one" not in audit and "AWS_SECRET" not in audit
