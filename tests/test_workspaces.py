"""WorkspaceManager's ordering rules, driven step by step.

A fake storage backend hands out Deferreds the test fires by hand and a
``Clock`` stands in for time, so each rule (a checkpoint waits for a sync
that starts after it, nothing runs concurrently for one conversation, a
deletion never hangs on a sync) is checked at the exact interleaving that
would break it. The same rules run for real in tests/test_lifecycle.py.
"""

import os
import time
import types

import attrs
import pytest
from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock

from supervisor.storage import Prepared, StorageUnavailable
from supervisor.workspaces import WorkspaceManager


@attrs.frozen
class Stats:
    uploaded: int


class FakeStorage:
    """Records every call; each returns a Deferred the test fires (``fire``)."""

    background_sync = True

    def __init__(self):
        self.calls = []

    def _call(self, name, *args):
        d = Deferred()
        self.calls.append((name, d))
        return d

    def names(self):
        return [name for name, _ in self.calls]

    def pending(self, name):
        return [d for n, d in self.calls if n == name and not d.called]

    def fire(self, name, result=None):
        (d,) = self.pending(name)
        d.callback(result)

    def prepare_workspace(self, identity, conversation):
        return self._call("prepare", identity, conversation)

    def sync_workspace(self, identity, conversation, path):
        return self._call("sync", conversation)

    def release_workspace(self, identity, conversation, path):
        return self._call("release", conversation)

    def evict_workspace(self, identity, conversation):
        return self._call("evict", conversation)

    def delete_conversation(self, owner, conversation):
        return self._call("delete", conversation)

    def delete_owner(self, owner):
        return self._call("delete_owner", owner)

    def mark_used(self, owner, conversation):
        return succeed(None)

    def known_conversations(self):
        return succeed([])

    def collect_garbage(self, grace):
        return succeed(None)


class Audit:
    def __init__(self):
        self.events = []

    def emit(self, event, **fields):
        self.events.append((event, fields))


@pytest.fixture
def world(tmp_path):
    clock = Clock()
    storage = FakeStorage()
    config = types.SimpleNamespace(
        sync_delay=2.0, sync_retry_max=8.0, warm_idle_time=900.0, retention=0.0,
        cleanup_interval=300.0, blob_gc_grace=86400.0,
        state_dir=str(tmp_path / "state"), workspace_root=str(tmp_path / "workspaces"))
    audit = Audit()
    manager = WorkspaceManager(clock, config, storage, audit, identities=None)
    manager._in_thread = lambda function, *args: succeed(function(*args))
    identity = types.SimpleNamespace(owner="alice", uid=40000, gid=40000,
                                     directory=os.path.join(config.workspace_root, "alice"))
    return types.SimpleNamespace(clock=clock, storage=storage, config=config, audit=audit,
                                 manager=manager, identity=identity)


def attach(world, name="c"):
    """Attach; fire the prepare it asks for; return the Conversation."""
    attached = Deferred.fromCoroutine(world.manager.attach(world.identity, name))
    if world.storage.pending("prepare"):
        world.storage.fire("prepare", Prepared(os.path.join(world.identity.directory, name)))
    return attached.result


def test_a_checkpoint_waits_for_a_sync_that_starts_after_it(world):
    conversation = attach(world)
    world.manager.changed(conversation)
    world.clock.advance(2)
    assert world.storage.names()[-1] == "sync"
    answered = world.manager.checkpoint(conversation)
    world.storage.fire("sync", Stats(1))  # it began before the checkpoint: not enough
    assert not answered.called
    assert world.storage.names()[-1] == "sync" and world.storage.pending("sync")
    world.storage.fire("sync", Stats(2))
    assert answered.result == {"uploaded": 2}


def test_changes_during_a_sync_start_another_after_the_delay(world):
    conversation = attach(world)
    world.manager.changed(conversation)
    world.clock.advance(2)
    world.manager.changed(conversation)  # while the first sync runs
    world.storage.fire("sync")
    assert not world.storage.pending("sync")
    world.clock.advance(2)
    assert len(world.storage.pending("sync")) == 1


def test_the_last_close_during_a_sync_releases_after_it(world):
    conversation = attach(world)
    world.manager.changed(conversation)
    world.clock.advance(2)
    closed = world.manager.detach(conversation)
    assert not closed.called and not world.storage.pending("release")
    world.storage.fire("sync")
    world.storage.fire("release")
    assert closed.called


def test_an_attach_waits_for_the_final_sync_before_preparing(world):
    conversation = attach(world)
    world.manager.detach(conversation)
    assert world.storage.pending("release")
    again = Deferred.fromCoroutine(world.manager.attach(world.identity, "c"))
    assert not world.storage.pending("prepare")  # not while the release runs
    world.storage.fire("release")
    world.storage.fire("prepare", Prepared(conversation.path))
    assert again.result is conversation and conversation.attached == 1


def test_a_retry_waits_while_a_prepare_runs(world):
    """A retry timer firing during an attach's hydrate does not sync alongside it."""
    conversation = attach(world)
    world.manager.detach(conversation)
    world.storage.pending("release")[0].errback(StorageUnavailable("down"))
    again = Deferred.fromCoroutine(world.manager.attach(world.identity, "c"))
    assert world.storage.pending("prepare")
    world.clock.advance(1)  # the retry is due
    assert not world.storage.pending("sync") and not world.storage.pending("release")
    world.storage.fire("prepare", Prepared(conversation.path))
    assert again.called
    world.clock.advance(2)
    assert world.storage.pending("sync")  # still dirty: synced once the prepare ended


def test_retries_back_off_up_to_sync_retry_max(world):
    conversation = attach(world)
    world.manager.detach(conversation)
    delays = []
    for _ in range(6):
        (pending,) = world.storage.pending("release")
        pending.errback(StorageUnavailable("down"))
        (timer,) = world.clock.getDelayedCalls()
        delays.append(timer.getTime() - world.clock.seconds())
        world.clock.advance(delays[-1])
    assert delays == [1, 2, 4, 8, 8, 8]
    failed = [f for e, f in world.audit.events if e == "workspace_sync_failed"]
    assert [f["attempt"] for f in failed] == [1, 2, 3, 4, 5, 6]
    assert {f["code"] for f in failed} == {"storage_unavailable"}


def test_a_delete_during_a_sync_neither_hangs_nor_syncs_again(world):
    """The closing connection waits for the running sync; the delete waits for the connection."""
    conversation = attach(world)
    world.manager.changed(conversation)
    world.clock.advance(2)
    closed = []
    world.manager.close_connections = lambda owner, name: closed.append(
        world.manager.detach(conversation)) or closed[0]
    checkpoint = world.manager.checkpoint(conversation)
    checkpoint.addErrback(lambda f: f.value)
    deleted = Deferred.fromCoroutine(world.manager.delete("alice", "c"))
    assert not deleted.called
    world.storage.fire("sync")
    assert closed and closed[0].called  # the connection's close did not wait for a next sync
    assert not world.storage.pending("sync") and not world.storage.pending("release")
    world.storage.fire("delete")
    assert deleted.called and deleted.result["reason"] == "request"
    assert world.storage.names().count("sync") == 1
    assert "being deleted" in str(checkpoint.result)


def test_a_failed_delete_stays_pending_and_refuses_hellos(world):
    conversation = attach(world)
    world.manager.detach(conversation)
    world.storage.fire("release")
    world.manager.close_connections = lambda owner, name: succeed(None)
    deleted = Deferred.fromCoroutine(world.manager.delete("alice", "c"))
    world.storage.pending("delete")[0].errback(StorageUnavailable("down"))
    assert isinstance(deleted.result.value, StorageUnavailable)
    deleted.addErrback(lambda f: None)
    marker = os.path.join(world.config.state_dir, "deletions", "alice", "c")
    assert os.path.exists(marker)
    with pytest.raises(Exception, match="being deleted"):
        world.manager.refuse_if_deleting("alice", "c")
    # The next cleanup finishes it.
    cleaned = world.manager.cleanup()
    world.storage.fire("delete")
    assert cleaned.result["resumed_deletions"] == 1
    assert not os.path.exists(marker)
    world.manager.refuse_if_deleting("alice", "c")


def test_retention_spares_an_attached_conversation(world):
    """Even with a record older than retention, an attached conversation is not deleted."""
    world.config.retention = 3600.0
    world.storage.background_sync = False
    os.makedirs(os.path.join(world.identity.directory, "c"))
    conversation = attach(world)
    world.manager._mark_used = lambda conversation: None  # no fresh record: only `busy` protects
    world.manager._touch_record("alice", "c", time.time() - 7200)
    result = world.manager.cleanup().result
    assert result["retention_deleted"] == 0 and not world.storage.pending("delete")
    world.manager.detach(conversation)
    world.storage.fire("release")
    world.manager._touch_record("alice", "c", time.time() - 7200)  # the detach touched it
    world.manager.close_connections = lambda owner, name: succeed(None)
    cleaned = world.manager.cleanup()
    world.storage.fire("delete")
    assert cleaned.result["retention_deleted"] == 1
