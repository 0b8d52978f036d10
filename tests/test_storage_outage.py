"""The ``s3`` backend while its store is unreachable.

The tests' own moto server is stopped (``s3_outage``: connections refused,
open connections dropped) and started again with everything it stored. A
sync or hydrate during the outage must fail quickly with
``supervisor.storage.StorageUnavailable`` (``code = "storage_unavailable"``),
touch nothing locally, and never let an eviction drop changes that are not
yet durable; once the store is back, a sync makes everything durable.
"""

import os
import time

import pytest
import pytest_twisted
from twisted.internet.threads import deferToThread

from supervisor.storage import STORAGE_UNAVAILABLE, StorageUnavailable
from tests.s3_fixtures import (  # noqa: F401 (fixtures)
    StoreReader, give_to_owner, make_host, manifest_entries, s3_location, s3_outage, s3_server,
    snapshot, tree_entries, write_file,
)

OWNER_UID = 31337
CONVERSATION = "c-outage"
#: A sync or hydrate against a stopped store must give up well within this.
#: (Refused connections: botocore retries 3 times with 50 ms-scale back-off.)
FAIL_WITHIN = 5.0

pytestmark = pytest.mark.integration


def assert_unavailable(error: BaseException) -> None:
    """``error`` is the backend's "store unreachable" error, without secrets in its text."""
    assert getattr(error, "code", None) == STORAGE_UNAVAILABLE, (
        f"expected code {STORAGE_UNAVAILABLE!r}, got {type(error).__module__}."
        f"{type(error).__name__} (code {getattr(error, 'code', None)!r}): {error}")
    assert isinstance(error, StorageUnavailable)
    assert "corral-test-secret" not in str(error)


def timed_failure(call) -> tuple:
    """``(exception, seconds)`` of ``call()``, which must raise."""
    started = time.monotonic()
    with pytest.raises(Exception) as raised:
        call()
    return raised.value, time.monotonic() - started


def state_files(host) -> dict:
    """``snapshot`` of the backend's per-conversation records (``<state_dir>/s3-state``).

    The upload spool, root's scratch directory, is left out; {} when absent.
    """
    found = snapshot(os.path.join(host.state_dir, "s3-state"))
    return {p: v for p, v in found.items() if p != "spool" and not p.startswith("spool/")}


def version_one(root: str) -> None:
    write_file(root, "README.md", b"version one\n")
    write_file(root, "src/app.py", b"print('one')\n", 0o755)
    write_file(root, "notes/todo.txt", b"- nothing yet\n")
    os.makedirs(os.path.join(root, "empty"))
    os.symlink("src/app.py", os.path.join(root, "app"))


def version_two(root: str) -> None:
    write_file(root, "README.md", b"version two, changed\n")
    os.unlink(os.path.join(root, "notes/todo.txt"))
    for i in range(10):
        write_file(root, f"work/result-{i}.txt", f"result {i}\n".encode() * (i + 1))


def committed_host(make_host):
    """A host whose workspace holds version one, committed."""
    host = make_host(OWNER_UID)
    host.hydrate(CONVERSATION)
    version_one(host.workspace(CONVERSATION))
    give_to_owner(host.workspace(CONVERSATION), host.identity)
    assert host.sync(CONVERSATION).committed
    return host


class TestSyncDuringOutage:
    """A sync while the store is down fails, keeps everything, and succeeds once it is back."""

    @pytest_twisted.ensureDeferred
    async def test_sync_fails_keeps_changes_then_commits(self, make_host, s3_outage,
                                                         s3_location):
        """StorageUnavailable quickly, nothing touched, no eviction; after the outage all is durable."""
        host = committed_host(make_host)
        workspace = host.workspace(CONVERSATION)
        store = StoreReader(s3_outage, s3_location, host.identity.owner, CONVERSATION)
        version_one_entries = manifest_entries(store.manifest())
        version_two(workspace)
        give_to_owner(workspace, host.identity)
        local = snapshot(workspace)
        state = state_files(host)

        s3_outage.stop()
        error, seconds = timed_failure(lambda: host.sync(CONVERSATION))
        assert_unavailable(error)
        assert seconds < FAIL_WITHIN, f"a failing sync took {seconds:.2f} s"
        # The Deferred API fails the same way.
        with pytest.raises(Exception) as raised:
            await host.storage.release_workspace(host.identity, CONVERSATION, workspace)
        assert_unavailable(raised.value)
        assert snapshot(workspace) == local
        assert state_files(host) == state
        # The changes are not durable: eviction keeps the directory.
        assert await host.storage.evict_workspace(host.identity, CONVERSATION) is False
        assert snapshot(workspace) == local

        s3_outage.start()
        assert await host.storage.evict_workspace(host.identity, CONVERSATION) is False
        assert snapshot(workspace) == local
        stats = await deferToThread(host.sync, CONVERSATION)
        assert stats.committed
        remote = store.manifest()
        assert manifest_entries(remote) == tree_entries(workspace) != version_one_entries
        store.check_blobs(remote)
        assert snapshot(workspace) == local
        # Now durable: eviction removes the directory, and a hydrate brings all of it back.
        assert await host.storage.evict_workspace(host.identity, CONVERSATION) is True
        assert not os.path.lexists(workspace)
        await deferToThread(host.hydrate, CONVERSATION)
        assert snapshot(workspace) == local

    def test_outage_in_the_middle_of_a_sync(self, make_host, s3_outage, s3_location):
        """The store goes away after the first blob is up: the old manifest stays whole, and a retry commits."""
        host = committed_host(make_host)
        workspace = host.workspace(CONVERSATION)
        store = StoreReader(s3_outage, s3_location, host.identity.owner, CONVERSATION)
        before = store.manifest()
        version_two(workspace)
        give_to_owner(workspace, host.identity)
        local = snapshot(workspace)
        blob_puts = []

        def stop_after_first_blob(model, context, **_):
            if model.name == "PutObject" and "/blobs/" in context.get("corral_key", ""):
                blob_puts.append(1)
                if len(blob_puts) == 1:
                    s3_outage.stop()

        def remember_key(params, context, **_):
            context["corral_key"] = params.get("Key", "")

        events = host.storage.client.meta.events
        events.register("provide-client-params.s3.PutObject", remember_key)
        events.register("after-call.s3.PutObject", stop_after_first_blob)
        error, seconds = timed_failure(lambda: host.sync(CONVERSATION))
        events.unregister("after-call.s3.PutObject", stop_after_first_blob)
        assert_unavailable(error)
        assert seconds < FAIL_WITHIN, f"a sync interrupted by an outage took {seconds:.2f} s"
        assert snapshot(workspace) == local

        s3_outage.start()
        assert store.manifest() == before  # never half-committed
        store.check_blobs(before)
        assert host.sync(CONVERSATION).committed
        remote = store.manifest()
        assert manifest_entries(remote) == tree_entries(workspace)
        store.check_blobs(remote)


class TestHydrateDuringOutage:
    """A hydrate while the store is down fails and writes nothing locally."""

    @pytest.mark.parametrize("local", ["none", "stale", "uncommitted"])
    def test_hydrate_fails_and_writes_nothing(self, local, make_host, s3_outage):
        """No local copy, a stale one, or one with uncommitted changes: all left exactly as they were."""
        writer = committed_host(make_host)
        host = make_host(OWNER_UID)
        workspace = host.workspace(CONVERSATION)
        if local != "none":
            host.hydrate(CONVERSATION)
        if local == "stale":
            version_two(writer.workspace(CONVERSATION))
            give_to_owner(writer.workspace(CONVERSATION), writer.identity)
            assert writer.sync(CONVERSATION).committed
        elif local == "uncommitted":
            write_file(workspace, "unsynced.txt", b"work the store has not seen")
            give_to_owner(workspace, host.identity)
        before = snapshot(workspace) if os.path.lexists(workspace) else None
        state = state_files(host)

        s3_outage.stop()
        error, seconds = timed_failure(lambda: host.hydrate(CONVERSATION))
        assert_unavailable(error)
        assert seconds < FAIL_WITHIN, f"a failing hydrate took {seconds:.2f} s"
        if before is None:
            # At most the empty conversation directory; nothing from the store.
            assert not os.path.lexists(workspace) or os.listdir(workspace) == []
        else:
            assert snapshot(workspace) == before
        assert state_files(host) == state

        s3_outage.start()
        host.hydrate(CONVERSATION)
        expected = snapshot(writer.workspace(CONVERSATION))
        if local == "uncommitted":
            # Committed first, then kept: the hydrate never throws work away.
            with open(os.path.join(workspace, "unsynced.txt"), "rb") as f:
                assert f.read() == b"work the store has not seen"
            got = snapshot(workspace)
            got.pop("unsynced.txt")
            assert got == expected
        else:
            assert snapshot(workspace) == expected

    @pytest_twisted.ensureDeferred
    async def test_prepare_workspace_fails_with_the_code(self, make_host, s3_outage):
        """Through the Deferred API the supervisor uses, prepare fails with storage_unavailable."""
        committed_host(make_host)
        host = make_host(OWNER_UID)
        s3_outage.stop()
        with pytest.raises(Exception) as raised:
            await host.storage.prepare_workspace(host.identity, CONVERSATION)
        assert_unavailable(raised.value)
