"""The ``s3`` storage backend against a real S3-compatible server process.

The server is moto's standalone server started by ``tests.s3_fixtures``
(or the endpoint in ``CORRAL_TEST_S3_ENDPOINT``). boto3 is never mocked:
request counts come from boto3's own event hooks on real requests.
"""

import functools
import hashlib
import os
import secrets
import stat
import threading
import time
import types

import pytest
import pytest_twisted

from plugins import storage_s3
from plugins.storage_s3 import (DeleteStats, GcStats, S3Storage, SyncConflict, SyncStats,
                                check_endpoint, parse_location, unavailable_reason)
from supervisor import manifest as mf
from supervisor.plugins import PluginRegistry
from supervisor.fsutil import remove_entry
from supervisor.storage import Prepared, StorageUnavailable
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
        assert backend.name == "s3" and backend.background_sync is True
        from zope.interface.verify import verifyObject

        from supervisor.interfaces import IStorageBackend
        assert verifyObject(IStorageBackend, backend)
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
        time.sleep(mf.RACY_NS / 1e9)  # files changed just before a walk are hashed again
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

    def test_a_commit_racing_a_hydrate_loads_the_winner(self, make_host):
        """Another host commits while this one walks: the conflict is seen and its version loaded.

        The manifest request of a hydrate is sent while the workspace is
        walked; if this host's own commit then fails, that early answer is stale.
        """
        a, b = make_host(), make_host()
        a.hydrate()
        write(a.workspace(), "x.txt", b"base")
        a.sync()
        b.hydrate()
        write(b.workspace(), "from-b.txt", b"b wins")
        write(a.workspace(), "from-a.txt", b"a loses")  # never synced

        def b_commits_first(params, **_):
            if params.get("Key", "").endswith("manifest.json") and not raced:
                raced.append(True)
                b.sync()

        raced = []
        a.storage.client.meta.events.register("provide-client-params.s3.PutObject",
                                              b_commits_first)
        _, stats = a.hydrate()
        assert raced and not stats.committed_first
        assert sorted(os.listdir(a.workspace())) == ["from-b.txt", "x.txt"]
        conflicts = a.calls("PutObject", "/conflicts/")
        assert len(conflicts) == 1

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

    def test_shared_old_blob_is_uploaded_again(self, make_host):
        """Race guard: a stored blob older than half the grace period is uploaded again, not relied on."""
        a = make_host()
        data = b"content shared by conversations"
        key_part = "/blobs/" + hashlib.sha256(data).hexdigest()
        a.hydrate("c-1")
        write(a.workspace("c-1"), "f.txt", data)
        a.sync("c-1")
        a.hydrate("c-2")
        write(a.workspace("c-2"), "g.txt", data)
        a.requests.clear()
        a.sync("c-2")
        assert a.calls("HeadObject", key_part) and a.calls("PutObject", key_part) == []
        # Half the grace period later, the same content is not trusted: it goes up again.
        a.storage.clock = lambda: time.time() + a.storage.gc_grace / 2 + 1
        a.hydrate("c-3")
        write(a.workspace("c-3"), "h.txt", data)
        a.requests.clear()
        stats = a.sync("c-3")
        assert len(a.calls("PutObject", key_part)) == 1 and stats.uploaded == 1

    def test_delete_keeps_young_blobs_for_the_collection(self, make_host):
        """A deleted conversation's blobs younger than the grace period are left to the collection."""
        a = make_host()
        a.hydrate()
        write(a.workspace(), "f.txt", b"young content")
        a.sync()
        stats = a.storage.delete_conversation_blocking("alice", "c-1")
        assert (stats.objects_deleted, stats.blobs_deleted, stats.blobs_kept_young) == (1, 0, 1)
        assert blob_stored(a.storage, "alice", b"young content")
        gc = a.storage.collect_garbage_blocking(a.storage.gc_grace)
        assert (gc.blobs_deleted, gc.blobs_kept_young) == (0, 1)
        a.storage.clock = lambda: time.time() + a.storage.gc_grace + 1
        gc = a.storage.collect_garbage_blocking(a.storage.gc_grace)
        assert (gc.blobs_deleted, gc.bytes_deleted) == (1, len(b"young content"))
        assert not blob_stored(a.storage, "alice", b"young content")

    def test_collection_skips_an_owner_whose_manifest_cannot_be_read(self, make_host, s3_server):
        """An owner with an unreadable manifest keeps every blob; other owners are collected."""
        a, b = make_host(owner="alice"), make_host(owner="bob")
        for host in (a, b):
            host.hydrate()
            write(host.workspace(), "f.txt", b"kept")
        a.sync()
        b.sync()
        storage = a.storage
        for owner in ("alice", "bob"):
            s3_server.client.put_object(Bucket=s3_server.bucket, Body=b"orphan",
                                        Key=storage.location.key(
                                            owner, "blobs", hashlib.sha256(b"orphan").hexdigest()))
        s3_server.client.put_object(
            Bucket=s3_server.bucket, Body=b"{not a manifest",
            Key=storage.location.key("bob", "conversations", "c-2", "manifest.json"))
        time.sleep(0.05)
        stats = storage.collect_garbage_blocking(0)
        assert (stats.owners, stats.blobs_deleted) == (1, 1)
        assert not blob_stored(storage, "alice", b"orphan")
        assert blob_stored(storage, "bob", b"orphan") and blob_stored(storage, "bob", b"kept")

    def test_delete_owner_in_batches(self, make_host, monkeypatch):
        """delete_owner deletes with DeleteObjects in batches (1000 in production)."""
        monkeypatch.setattr(storage_s3, "DELETE_BATCH", 3)
        a = make_host()
        a.hydrate()
        for i in range(7):
            write(a.workspace(), f"f{i}.txt", b"file %d" % i)
        a.sync()
        a.requests.clear()
        stats = a.storage.delete_owner_blocking("alice")
        assert (stats.objects_deleted, stats.blobs_deleted) == (1, 7)
        assert len(a.calls("DeleteObjects")) == 3
        assert stored_keys(a.storage, "alice") == []

    def test_conflict_copy_names_only_stored_blobs(self, make_host):
        """A conflict copy's blobs are made present even when the winner no longer names them."""
        a, b = make_host(), make_host()
        a.hydrate()
        write(a.workspace(), "old.txt", b"in the base only")
        a.sync()
        b.hydrate()
        os.unlink(os.path.join(a.workspace(), "old.txt"))
        a.sync()  # the winner drops old.txt; collection may now delete its blob
        a.storage.clock = lambda: time.time() + 10
        a.storage.collect_garbage_blocking(5)
        assert not blob_stored(a.storage, "alice", b"in the base only")
        write(b.workspace(), "new.txt", b"b's work")
        with pytest.raises(SyncConflict) as raised:
            b.sync()
        copy = mf.Manifest.from_bytes(b.storage.client.get_object(
            Bucket=b.storage.location.bucket, Key=raised.value.conflict_key)["Body"].read())
        assert "old.txt" in copy.by_path()
        assert blob_stored(b.storage, "alice", b"in the base only")


@pytest.mark.integration
class TestStoreUnavailable:
    """A store that cannot be reached surfaces as StorageUnavailable; the local copy is kept."""

    SECRET = "secret-" + secrets.token_hex(8)

    @pytest.fixture
    def dead(self, make_host, s3_location):
        """A host whose backend points at a closed port (connection refused), credentials configured."""
        from tests.s3_fixtures import _free_port

        host = make_host()
        host.hydrate()
        write(host.workspace(), "work.txt", b"not yet durable")
        host.storage.close()
        host.storage = storage_s3._build(s3_location, types.SimpleNamespace(
            state_dir=host.state_dir, s3_endpoint_url=f"http://127.0.0.1:{_free_port()}",
            s3_access_key_id="corral-test", s3_secret_access_key=self.SECRET))
        return host

    def _check(self, error: StorageUnavailable, subject: str) -> None:
        message = str(error)
        assert error.code == "storage_unavailable"
        assert subject in message and "EndpointConnectionError" in message
        assert self.SECRET not in message and self.SECRET not in repr(error)
        assert message.count(". ") == 0 and message[0].islower()  # one sentence
        assert error.__cause__ is None

    def test_sync_and_hydrate(self, dead):
        """sync and hydrate fail fast with StorageUnavailable naming the conversation; files stay."""
        before = snapshot(dead.workspace())
        started = time.monotonic()
        with pytest.raises(StorageUnavailable) as raised:
            dead.sync()
        self._check(raised.value, "alice/c-1")
        with pytest.raises(StorageUnavailable) as raised:
            dead.hydrate()
        self._check(raised.value, "alice/c-1")
        assert time.monotonic() - started < 5.0  # no 3 x 5 s connect timeouts: refused at once
        assert snapshot(dead.workspace()) == before
        assert dead.storage.evict_blocking(dead.identity, "c-1") is False
        assert snapshot(dead.workspace()) == before
        assert self.SECRET not in repr(dead.storage) and self.SECRET not in str(dead.storage)

    @pytest_twisted.ensureDeferred
    async def test_every_operation(self, dead):
        """delete, mark_used, listing and collection fail with StorageUnavailable too."""
        storage = dead.storage
        calls = [
            ("alice/c-1", storage.sync_workspace(dead.identity, "c-1", dead.workspace())),
            ("alice/c-1", storage.prepare_workspace(dead.identity, "c-1")),
            ("alice/c-1", storage.delete_conversation("alice", "c-1")),
            ("owner alice", storage.delete_owner("alice")),
            ("alice/c-1", storage.mark_used("alice", "c-1")),
            ("stored conversations", storage.known_conversations()),
            ("stored owners", storage.collect_garbage(0)),
        ]
        for subject, deferred in calls:
            with pytest.raises(StorageUnavailable) as raised:
                await deferred
            self._check(raised.value, subject)
        assert os.path.exists(os.path.join(dead.workspace(), "work.txt"))

    def test_server_errors_and_throttling(self, make_host, monkeypatch):
        """HTTP 5xx and throttling answers surface as StorageUnavailable; a refusal does not."""
        from botocore.awsrequest import AWSResponse

        class Raw:
            def __init__(self, body):
                self.body = body

            def stream(self, **_):
                yield self.body

        monkeypatch.setattr(storage_s3, "make_client",
                            functools.partial(storage_s3.make_client, max_attempts=1))
        host = make_host()
        host.hydrate()
        answer = {}

        def fake(request, **_):
            status, code = answer["status"], answer["code"]
            body = (f"<?xml version='1.0'?><Error><Code>{code}</Code>"
                    f"<Message>no</Message></Error>").encode()
            return AWSResponse(request.url, status, {"Content-Type": "application/xml"}, Raw(body))

        host.storage.client.meta.events.register("before-send.s3.PutObject", fake)
        write(host.workspace(), "f.txt", b"data")
        for status, code in ((503, "SlowDown"), (500, "InternalError"), (400, "RequestTimeout")):
            answer.update(status=status, code=code)
            with pytest.raises(StorageUnavailable, match=f"{code}.*HTTP {status}"):
                host.sync()
        answer.update(status=403, code="AccessDenied")
        from botocore.exceptions import ClientError
        with pytest.raises(ClientError):
            host.sync()
        assert os.path.exists(os.path.join(host.workspace(), "f.txt"))

    def test_classification(self):
        """Which errors mean unreachable: connection problems, 5xx, throttling; not refusals."""
        from botocore import exceptions as bx

        def client_error(status, code):
            return bx.ClientError({"Error": {"Code": code, "Message": "m"},
                                   "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")

        assert "could not be reached" in unavailable_reason(
            bx.EndpointConnectionError(endpoint_url="http://x"))
        assert "could not be reached" in unavailable_reason(
            bx.ConnectTimeoutError(endpoint_url="http://x"))
        assert "ReadTimeoutError" in unavailable_reason(bx.ReadTimeoutError(endpoint_url="http://x"))
        assert "ConnectionClosedError" in unavailable_reason(
            bx.ConnectionClosedError(endpoint_url="http://x"))
        assert "NoCredentialsError" in unavailable_reason(bx.NoCredentialsError())
        assert "HTTP 502" in unavailable_reason(client_error(502, "BadGateway"))
        assert "SlowDown" in unavailable_reason(client_error(503, "SlowDown"))
        assert "Throttling" in unavailable_reason(client_error(400, "Throttling"))
        assert unavailable_reason(client_error(429, "TooManyRequests"))
        for refusal in (client_error(403, "AccessDenied"), client_error(404, "NoSuchBucket"),
                        client_error(412, "PreconditionFailed"),
                        bx.ParamValidationError(report="bad"), ValueError("x"), OSError(5, "x")):
            assert unavailable_reason(refusal) is None


@pytest.mark.integration
class TestConfigurationKeys:
    """Settings come from the configuration object; secrets go nowhere but boto3."""

    def test_credentials_from_the_configuration(self, s3_server, s3_location, monkeypatch):
        """Key id, secret, token, region, concurrency and grace from the config; the secret never shows."""
        from twisted.logger import formatEvent, globalLogPublisher

        secret, token = "s3cr3t-" + secrets.token_hex(8), "t0ken-" + secrets.token_hex(8)
        monkeypatch.delenv("CORRAL_S3_ENDPOINT_URL")
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            monkeypatch.delenv(name, raising=False)
        base = traversable_tempdir("corral-s3-cfg-")
        config = types.SimpleNamespace(
            state_dir=base, s3_endpoint_url=s3_server.endpoint, s3_region="eu-west-1",
            s3_access_key_id="corral-config-key", s3_secret_access_key=secret,
            s3_session_token=token, s3_max_concurrency=3, blob_gc_grace=120)
        events = []
        globalLogPublisher.addObserver(events.append)
        storage = PluginRegistry(entry_points=False).build("storage", "s3:" + s3_location, config)
        try:
            assert isinstance(storage, S3Storage)
            assert storage._transfers._max_workers == 3 and storage.gc_grace == 120
            assert storage.client.meta.region_name == "eu-west-1"
            credentials = storage.client._request_signer._credentials
            assert (credentials.access_key, credentials.token) == ("corral-config-key", token)
            from supervisor.identities import OwnerIdentity

            directory = os.path.join(base, "workspaces", "alice")
            os.makedirs(directory, mode=0o700)
            uid, gid = (OWNER_UID, OWNER_UID) if IS_ROOT else (os.getuid(), os.getgid())
            if IS_ROOT:
                os.chown(directory, uid, gid)
            identity = OwnerIdentity("alice", uid, gid, directory)
            path, _ = storage.hydrate_blocking(identity, "c-1")
            write(path, "f.txt", b"through the configured credentials")
            assert storage.sync_blocking(identity, "c-1").committed
            storage.mark_used_blocking("alice", "c-1")
            assert storage.known_conversations_blocking()[0][:2] == ("alice", "c-1")
        finally:
            globalLogPublisher.removeObserver(events.append)
            storage.close()
        text = " ".join([repr(storage), str(storage)] + [formatEvent(e) for e in events]
                        + [repr(e) for e in events])
        assert secret not in text and token not in text
        assert "synced alice/c-1" in text

    def test_endpoint_from_the_environment_when_the_key_is_absent(self, s3_location):
        """A configuration without s3_endpoint_url (tests, old configs) reads CORRAL_S3_ENDPOINT_URL."""
        storage = storage_s3._build(s3_location, types.SimpleNamespace(
            state_dir=traversable_tempdir("corral-s3-env-")))
        try:
            assert storage.client.meta.endpoint_url == os.environ["CORRAL_S3_ENDPOINT_URL"]
            assert storage.gc_grace == storage_s3.GC_GRACE
        finally:
            storage.close()

    @pytest.mark.parametrize("settings, message", [
        ({"s3_access_key_id": "k"}, "together"),
        ({"s3_secret_access_key": "s"}, "together"),
        ({"s3_endpoint_url": "http://k:s@127.0.0.1:1"}, "must not carry credentials"),
        ({"s3_max_concurrency": 0}, "s3_max_concurrency"),
        ({"blob_gc_grace": -1}, "blob_gc_grace"),
    ])
    def test_bad_settings(self, settings, message):
        """Half a key pair, an endpoint with credentials, or a bad number is refused with a sentence."""
        config = types.SimpleNamespace(state_dir="/nonexistent", **settings)
        with pytest.raises(ValueError, match=message) as raised:
            storage_s3._build("s3://bucket-1/p", config)
        assert "s:" not in str(raised.value).replace("s3:", "")


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


def prepared_path(result) -> str:
    """The path a ``prepare_workspace`` fired with: a plain str, or a Prepared's path."""
    if isinstance(result, Prepared):
        assert result.path and isinstance(result.path, str)
        return result.path
    assert isinstance(result, str), result
    return result


def stored_keys(storage, *parts: str) -> list:
    """Every key below ``PREFIX/<parts...>/`` in the s3 backend's bucket."""
    prefix = storage.location.key(*parts) + "/"
    pages = storage.client.get_paginator("list_objects_v2").paginate(
        Bucket=storage.location.bucket, Prefix=prefix)
    return [o["Key"] for page in pages for o in page.get("Contents", ())]


def blob_stored(storage, owner: str, data: bytes) -> bool:
    """True when the s3 backend's bucket holds the blob of ``data`` for ``owner``."""
    key = storage.location.key(owner, "blobs", hashlib.sha256(data).hexdigest())
    return key in stored_keys(storage, owner, "blobs")


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
        path = prepared_path(await storage.prepare_workspace(identity, "c-contract"))
        assert path == os.path.join(identity.directory, "c-contract")
        st = os.stat(path)
        assert st.st_uid == identity.uid and stat.S_IMODE(st.st_mode) == 0o700
        _write_as_owner(identity, path, "note.txt", "kept")
        await storage.release_workspace(identity, "c-contract", path)
        again = prepared_path(await storage.prepare_workspace(identity, "c-contract"))
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

    @pytest_twisted.ensureDeferred
    async def test_sync_while_attached_then_prepare_keeps_files(self, backend):
        """``sync_workspace`` (runners still attached) makes the content durable; prepare keeps it."""
        storage, identity = backend
        path = prepared_path(await storage.prepare_workspace(identity, "c-sync"))
        _write_as_owner(identity, path, "draft.txt", "first")
        stats = await storage.sync_workspace(identity, "c-sync", path)
        if storage.background_sync:
            assert isinstance(stats, SyncStats) and stats.committed and stats.uploaded == 1
            assert await storage.sync_workspace(identity, "c-sync", path) is None  # unchanged
        else:
            assert stats is None
        again = prepared_path(await storage.prepare_workspace(identity, "c-sync"))
        with open(os.path.join(again, "draft.txt")) as f:
            assert f.read() == "first"

    @pytest_twisted.ensureDeferred
    async def test_evict_when_durable(self, backend):
        """local never evicts; s3 removes a committed copy, and the next prepare brings it back."""
        storage, identity = backend
        path = prepared_path(await storage.prepare_workspace(identity, "c-evict"))
        _write_as_owner(identity, path, "kept.txt", "durable")
        await storage.release_workspace(identity, "c-evict", path)
        evicted = await storage.evict_workspace(identity, "c-evict")
        if not storage.background_sync:
            assert evicted is False and os.path.isdir(path)
            return
        assert evicted is True
        assert not os.path.lexists(path)
        assert not os.path.exists(storage._state_path(identity.owner, "c-evict"))
        assert await storage.evict_workspace(identity, "c-evict") is True  # already gone
        again = prepared_path(await storage.prepare_workspace(identity, "c-evict"))
        with open(os.path.join(again, "kept.txt")) as f:
            assert f.read() == "durable"
        assert os.stat(os.path.join(again, "kept.txt")).st_uid == identity.uid

    @pytest_twisted.ensureDeferred
    async def test_evict_never_removes_uncommitted_changes(self, backend):
        """A copy with a change not yet committed (or never committed) is kept: False."""
        storage, identity = backend
        path = prepared_path(await storage.prepare_workspace(identity, "c-dirty"))
        _write_as_owner(identity, path, "new.txt", "never committed")
        assert await storage.evict_workspace(identity, "c-dirty") is False
        await storage.release_workspace(identity, "c-dirty", path)
        _write_as_owner(identity, path, "new.txt", "changed since")
        assert await storage.evict_workspace(identity, "c-dirty") is False
        with open(os.path.join(path, "new.txt")) as f:
            assert f.read() == "changed since"
        if storage.background_sync:
            # An empty directory that was never committed holds nothing to lose.
            empty = prepared_path(await storage.prepare_workspace(identity, "c-empty"))
            assert await storage.evict_workspace(identity, "c-empty") is True
            assert not os.path.lexists(empty)

    @pytest_twisted.ensureDeferred
    async def test_delete_conversation_then_prepare_is_empty(self, backend):
        """After delete_conversation (and the supervisor's local removal) a prepare gives an empty workspace.

        s3: nothing is left under the conversation, its unshared blob is
        gone, a blob another conversation of the owner refers to is kept.
        """
        storage, identity = backend
        if storage.background_sync:
            storage.gc_grace = 0  # the blobs were just written; see test_delete_keeps_young_blobs
        for name, files in (("c-gone", {"mine.txt": "only here", "both.txt": "in two"}),
                            ("c-stays", {"both.txt": "in two"})):
            path = prepared_path(await storage.prepare_workspace(identity, name))
            for file, text in files.items():
                _write_as_owner(identity, path, file, text)
            await storage.release_workspace(identity, name, path)
        await storage.mark_used(identity.owner, "c-gone")
        stats = await storage.delete_conversation(identity.owner, "c-gone")
        remove_entry(identity.directory, "c-gone")  # what the supervisor does next
        if storage.background_sync:
            assert isinstance(stats, DeleteStats)
            assert (stats.objects_deleted, stats.blobs_deleted) == (2, 1)  # manifest, used
            assert stats.bytes_deleted > len("only here")
            assert stored_keys(storage, identity.owner, "conversations", "c-gone") == []
            assert not blob_stored(storage, identity.owner, b"only here")
            assert blob_stored(storage, identity.owner, b"in two")
            assert not os.path.exists(storage._state_path(identity.owner, "c-gone"))
            again = await storage.delete_conversation(identity.owner, "c-gone")
            assert (again.objects_deleted, again.blobs_deleted, again.bytes_deleted) == (0, 0, 0)
        else:
            assert stats is None
        path = prepared_path(await storage.prepare_workspace(identity, "c-gone"))
        assert os.listdir(path) == []
        other = prepared_path(await storage.prepare_workspace(identity, "c-stays"))
        with open(os.path.join(other, "both.txt")) as f:
            assert f.read() == "in two"

    @pytest_twisted.ensureDeferred
    async def test_delete_owner_leaves_nothing(self, backend):
        """delete_owner removes every key under PREFIX/<owner>/ and the owner's bookkeeping; twice is fine."""
        storage, identity = backend
        for name in ("c-1", "c-2"):
            path = prepared_path(await storage.prepare_workspace(identity, name))
            _write_as_owner(identity, path, "f.txt", name)
            await storage.release_workspace(identity, name, path)
            await storage.mark_used(identity.owner, name)
        stats = await storage.delete_owner(identity.owner)
        if not storage.background_sync:
            assert stats is None
            return
        assert (stats.objects_deleted, stats.blobs_deleted) == (4, 2)
        assert stored_keys(storage, identity.owner) == []
        assert not os.path.exists(os.path.join(storage.state_root, identity.owner))
        again = await storage.delete_owner(identity.owner)
        assert (again.objects_deleted, again.blobs_deleted, again.bytes_deleted) == (0, 0, 0)

    @pytest_twisted.ensureDeferred
    async def test_known_conversations_and_mark_used(self, backend):
        """mark_used writes the empty ``used`` marker; known_conversations lists what the store holds."""
        storage, identity = backend
        started = time.time()
        path = prepared_path(await storage.prepare_workspace(identity, "c-synced"))
        _write_as_owner(identity, path, "f.txt", "x")
        await storage.release_workspace(identity, "c-synced", path)
        await storage.mark_used(identity.owner, "c-marked")
        known = await storage.known_conversations()
        if not storage.background_sync:
            assert known == []
            return
        client, bucket = storage.client, storage.location.bucket
        used = storage.location.key(identity.owner, "conversations", "c-marked", "used")
        assert client.get_object(Bucket=bucket, Key=used)["Body"].read() == b""
        # A conversation with only a conflict copy is listed; names not valid are not.
        base = storage.location.key(identity.owner, "conversations")
        client.put_object(Bucket=bucket, Key=f"{base}/c-conflicted/conflicts/x.json", Body=b"{}")
        client.put_object(Bucket=bucket, Key=f"{base}/.hidden/used", Body=b"")
        client.put_object(Bucket=bucket, Key=storage.location.key("bad..owner!", "x"), Body=b"")
        known = await storage.known_conversations()
        assert [(o, c) for o, c, _ in known] == [
            ("alice", "c-conflicted"), ("alice", "c-marked"), ("alice", "c-synced")]
        times = {c: t for _, c, t in known}
        assert times["c-conflicted"] is None
        for name in ("c-marked", "c-synced"):
            assert started - 5 <= times[name] <= time.time() + 5

    @pytest_twisted.ensureDeferred
    async def test_collect_garbage(self, backend):
        """Only unreferenced blobs older than the grace period are deleted."""
        storage, identity = backend
        path = prepared_path(await storage.prepare_workspace(identity, "c-gc"))
        _write_as_owner(identity, path, "f.txt", "referenced")
        await storage.release_workspace(identity, "c-gc", path)
        if not storage.background_sync:
            assert await storage.collect_garbage(0) is None
            return
        client, bucket = storage.client, storage.location.bucket
        orphan = b"orphan " + os.urandom(8)
        kept_by_copy = b"named by a conflict copy"
        for data in (orphan, kept_by_copy):
            client.put_object(Bucket=bucket, Body=data, Key=storage.location.key(
                identity.owner, "blobs", hashlib.sha256(data).hexdigest()))
        copy = mf.Manifest.of([mf.Entry("k", mf.FILE, mode=0o600, size=len(kept_by_copy),
                                        sha256=hashlib.sha256(kept_by_copy).hexdigest())])
        client.put_object(Bucket=bucket, Body=copy.to_bytes(identity.owner, "c-gc"),
                          Key=storage.location.key(identity.owner, "conversations", "c-gc",
                                                   "conflicts", "copy.json"))
        young = await storage.collect_garbage(3600)
        assert isinstance(young, GcStats)
        assert (young.owners, young.blobs_deleted, young.blobs_kept_young) == (1, 0, 1)
        time.sleep(0.05)
        stats = await storage.collect_garbage(0)
        assert (stats.owners, stats.blobs_deleted, stats.bytes_deleted) == (1, 1, len(orphan))
        assert not blob_stored(storage, identity.owner, orphan)
        assert blob_stored(storage, identity.owner, kept_by_copy)
        assert blob_stored(storage, identity.owner, b"referenced")
        assert (await storage.collect_garbage(0)).blobs_deleted == 0


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
