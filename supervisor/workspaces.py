"""The lifecycle of conversations' workspaces, for every storage backend.

``WorkspaceManager`` is the one place that calls the storage backend. Per
conversation it knows how many connections are attached, whether a prepare
or a sync is running, and what waits for the next sync:

* **attach**: the first connection prepares (hydrates) the workspace; later
  ones share it. A sync or a deletion in progress is waited for first.
* **changed**: the runner said a tool call may have changed files; with a
  backend that syncs (``background_sync``) a sync starts ``sync_delay``
  seconds later. Notices during a sync start another one after it.
* **checkpoint**: a sync that starts after the request; its Deferred fires
  once the changes are durable, or fails with the sync's error.
* **detach**: the last connection's close syncs at once (``release``).
* A failed sync is retried with back-off (1 s doubling up to
  ``sync_retry_max``) while the local copy keeps working; a conflict is not
  retried (the loser's version is kept by the backend as a conflict copy).
* **cleanup**, every ``cleanup_interval``: marks attached conversations as
  used, evicts local copies idle for ``warm_idle_time`` (only when the
  backend confirms they are durable), deletes conversations unused for
  ``retention``, and collects unreferenced stored data.
* **delete**: kills the connections, waits for syncs, deletes the durable
  copy, then the local directory.

When a conversation was last used is kept in root's
``<state_dir>/lifecycle/<owner>/<conversation>`` (its mtime), and for
backends that keep copies elsewhere also in the store (``mark_used``), so
retention counts from the last use on any host.
"""

import os
import time

import attrs
from attrs import define, field
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.task import LoopingCall
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger

from supervisor.errors import UNAVAILABLE, CorralError
from supervisor.hello import NAME_PATTERN
from supervisor.fsutil import make_directories, remove_entry

#: First wait before retrying a failed sync; it doubles up to sync_retry_max.
RETRY_FIRST = 1.0


def stats_fields(stats) -> dict:
    """An attrs stats object's scalar fields, for audit events and answers."""
    if stats is None or not attrs.has(type(stats)):
        return {}
    return {
        name: value
        for name, value in attrs.asdict(stats).items()
        if isinstance(value, (bool, int, float, str))
    }


def error_code(failure) -> str:
    """The stable code of a failure: its ``code`` attribute when a string, else 'internal'."""
    code = getattr(failure.value, "code", None)
    return code if isinstance(code, str) else "internal"


@define(eq=False)
class Conversation:
    """What the supervisor knows about one conversation's workspace."""

    owner: str
    name: str
    identity: object = None
    path: str | None = None
    attached: int = 0
    #: The prepare in progress (a Deferred firing with the path), or None.
    opening: Deferred | None = None
    #: The sync in progress, or None.
    syncing: Deferred | None = None
    #: A scheduled sync (after sync_delay, or a retry), or None.
    timer: object = None
    #: Files may have changed since the running (or last) sync started.
    dirty: bool = False
    #: Failed syncs in a row (the retry waits 1 s, doubling up to sync_retry_max).
    failures: int = 0
    #: The store's "in use" marker being written (s3), or None.
    marking: Deferred | None = None
    #: Checkpoints waiting for a sync that has not started yet.
    waiters: list = field(factory=list)
    deleting: bool = False

    @property
    def busy(self) -> bool:
        """Attached, preparing, syncing or with a sync scheduled: not to be evicted or deleted."""
        return bool(self.attached or self.opening or self.syncing or self.timer or self.deleting)


class WorkspaceManager:
    """Attach, sync, checkpoint, evict and delete conversations' workspaces."""

    log = Logger()

    def __init__(self, reactor, config, storage, auditor, identities):
        self.reactor = reactor
        self.config = config
        self.storage = storage
        self.auditor = auditor
        self.identities = identities
        self.conversations: dict[tuple[str, str], Conversation] = {}
        #: Owners being deleted as a whole.
        self.deleting_owners: set[str] = set()
        #: Deletions asked for and not finished, ``(owner, conversation or None)``,
        #: each with a marker file: hellos for them are refused, and the
        #: cleanup (also at start-up, after a crash) tries them again.
        self.pending_deletions: set[tuple[str, str | None]] = set()
        #: Called with (owner, conversation or None) to close matching connections;
        #: returns a Deferred that fires when they are closed. Set by the service.
        self.close_connections = lambda owner, conversation: succeed(None)
        self.lifecycle_root = os.path.join(config.state_dir, "lifecycle")
        #: Deletions in progress, one marker file each, resumed after a crash.
        self.deletions_root = os.path.join(config.state_dir, "deletions")
        self._last_gc: float | None = None
        self._cleanup_loop: LoopingCall | None = None
        self._cleanup_running: Deferred | None = None
        self.stopping = False

    # -- helpers -----------------------------------------------------------

    def _in_thread(self, function, *args):
        return deferToThreadPool(self.reactor, self.reactor.getThreadPool(), function, *args)

    def _get(self, owner: str, name: str) -> Conversation:
        conversation = self.conversations.get((owner, name))
        if conversation is None:
            conversation = self.conversations[(owner, name)] = Conversation(owner, name)
        return conversation

    def _forget_if_idle(self, conversation: Conversation) -> None:
        if not conversation.busy and conversation.path is None and not conversation.waiters:
            self.conversations.pop((conversation.owner, conversation.name), None)

    def _audit(self, event: str, conversation: Conversation | None = None, **fields) -> None:
        ids = {}
        if conversation is not None:
            ids = {"owner": conversation.owner, "conversation": conversation.name}
        self.auditor.emit(event, **fields, **ids)

    def is_deleting(self, owner: str, name: str) -> bool:
        """Whether the owner or the conversation is being deleted, or a deletion of it is pending."""
        conversation = self.conversations.get((owner, name))
        return (owner in self.deleting_owners or bool(conversation and conversation.deleting)
                or (owner, None) in self.pending_deletions
                or (owner, name) in self.pending_deletions)

    def refuse_if_deleting(self, owner: str, name: str) -> None:
        if self.is_deleting(owner, name):
            raise CorralError(
                UNAVAILABLE,
                f"conversation {owner}/{name} is being deleted; retry once the deletion "
                "has finished",
            )

    # -- lifecycle records (root's, in the state directory) ----------------

    def _record_path(self, owner: str, name: str) -> str:
        return os.path.join(self.lifecycle_root, owner, name)

    def _touch_record(self, owner: str, name: str, when: float | None = None) -> None:
        """Record that the conversation was used (blocking)."""
        path = self._record_path(owner, name)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except FileNotFoundError:
            make_directories(os.path.dirname(path), 0o700)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.utime(fd, None if when is None else (when, when))
        finally:
            os.close(fd)

    def _record_time(self, owner: str, name: str) -> float | None:
        try:
            return os.stat(self._record_path(owner, name)).st_mtime
        except FileNotFoundError:
            return None

    def _remove_records(self, owner: str, name: str | None) -> None:
        if name is None:
            if os.path.isdir(self.lifecycle_root):
                remove_entry(self.lifecycle_root, owner)
            return
        try:
            os.unlink(self._record_path(owner, name))
        except FileNotFoundError:
            pass

    def _mark_used(self, conversation: Conversation) -> None:
        """Record the use here and, in the background, where other hosts see it."""
        def failed(failure):
            self.log.warn(
                "could not record the use of {owner}/{conversation} in the store: {error}",
                owner=conversation.owner, conversation=conversation.name,
                error=failure.getErrorMessage())

        self._in_thread(self._touch_record, conversation.owner, conversation.name).addErrback(
            lambda f: self.log.failure("could not write the lifecycle record", f))
        if self.storage.background_sync and conversation.marking is None:
            # One at a time, and a deletion waits for it: a marker written after
            # the deletion would make the conversation look used.
            def done(_):
                conversation.marking = None

            conversation.marking = self.storage.mark_used(conversation.owner, conversation.name)
            conversation.marking.addErrback(failed).addBoth(done)

    # -- attach and detach -------------------------------------------------

    async def attach(self, identity, name: str) -> Conversation:
        """Make the workspace ready for one more connection; returns its Conversation."""
        self.refuse_if_deleting(identity.owner, name)
        conversation = self._get(identity.owner, name)
        conversation.identity = identity
        conversation.attached += 1
        try:
            while conversation.opening is not None:  # another prepare, or an eviction
                await _quietly(conversation.opening)
                self.refuse_if_deleting(identity.owner, name)
            # A cache (s3) is hydrated by the first connection only: later ones
            # share the live directory. A local directory is checked every time
            # (cheap, and a tenant may have swapped it for a symlink meanwhile).
            if (conversation.path is None or conversation.attached == 1
                    or not self.storage.background_sync):
                conversation.opening = Deferred.fromCoroutine(self._prepare(conversation))
                try:
                    await conversation.opening
                finally:
                    conversation.opening = None
                    self._after_sync(conversation)  # what waited for the prepare
            self.refuse_if_deleting(identity.owner, name)
        except BaseException:
            conversation.attached -= 1
            self._forget_if_idle(conversation)
            raise
        self._mark_used(conversation)
        return conversation

    async def _prepare(self, conversation: Conversation) -> None:
        """Hydrate (or check) the workspace, after a sync that is still running."""
        if conversation.syncing is not None:
            await _quietly(conversation.syncing)  # prepare on the committed state
        conversation.path = None
        prepared = await self.storage.prepare_workspace(conversation.identity, conversation.name)
        conversation.path = prepared.path
        if prepared.stats is not None:
            self._audit("workspace_hydrated", conversation, **stats_fields(prepared.stats))

    def detach(self, conversation: Conversation) -> Deferred:
        """One connection has closed (its runners are dead).

        When it was the last, the workspace is synced; the Deferred fires
        after that attempt (retries go on in the background).
        """
        conversation.attached -= 1
        if conversation.attached > 0 or conversation.deleting or conversation.path is None:
            return succeed(None)
        self._in_thread(self._touch_record, conversation.owner, conversation.name).addErrback(
            lambda f: None)
        return self._request_sync(conversation).addErrback(lambda f: None)

    # -- sync, checkpoints, retries ----------------------------------------

    def changed(self, conversation: Conversation) -> None:
        """A tool call may have changed files: sync within sync_delay (backends that sync)."""
        if not self.storage.background_sync or conversation.deleting:
            return
        conversation.dirty = True
        if conversation.syncing is None and conversation.timer is None:
            conversation.timer = self.reactor.callLater(
                self.config.sync_delay, self._scheduled_sync, conversation)

    def checkpoint(self, conversation: Conversation) -> Deferred:
        """Fires with the sync's stats once everything written before now is durable."""
        if conversation.deleting:
            return fail(CorralError(UNAVAILABLE, "the conversation is being deleted"))
        return self._request_sync(conversation)

    def _request_sync(self, conversation: Conversation) -> Deferred:
        """A Deferred for the outcome of a sync that starts after now (at once when idle).

        Every sync completion is reported this one way: the waiters of a
        sync fire when it ends, whatever its outcome, and never wait on a
        retry timer.
        """
        done = Deferred()
        conversation.waiters.append(done)
        if conversation.syncing is None and conversation.opening is None:
            self._sync(conversation)
        return done

    def _cancel_timer(self, conversation: Conversation) -> None:
        if conversation.timer is not None:
            if conversation.timer.active():
                conversation.timer.cancel()
            conversation.timer = None

    def _scheduled_sync(self, conversation: Conversation) -> None:
        conversation.timer = None
        if conversation.syncing is None and conversation.opening is None:
            self._sync(conversation)
        # else: still dirty; the sync or prepare that runs starts it when it ends.

    def _sync(self, conversation: Conversation) -> None:
        """Start one sync now; its waiters (taken now) fire when it ends."""
        self._cancel_timer(conversation)
        waiters, conversation.waiters = conversation.waiters, []
        conversation.dirty = False
        storage = self.storage
        method = storage.release_workspace if conversation.attached == 0 else \
            storage.sync_workspace
        started = self.reactor.seconds()
        try:
            running = method(conversation.identity, conversation.name, conversation.path)
        except Exception as e:  # a plugin that raises instead of failing its Deferred
            running = fail(e)
        conversation.syncing = running

        def succeeded(stats):
            conversation.syncing = None
            conversation.failures = 0
            fields = stats_fields(stats)
            if fields:
                self._audit("workspace_synced", conversation, **fields)
            for waiter in waiters:
                waiter.callback(fields)
            self._after_sync(conversation)

        def failed(failure):
            conversation.syncing = None
            code = error_code(failure)
            conversation.failures += 1
            if code == "sync_conflict":
                self._audit("workspace_sync_conflict", conversation)
            else:
                self._audit("workspace_sync_failed", conversation, code=code,
                            attempt=conversation.failures,
                            duration_ms=round((self.reactor.seconds() - started) * 1000, 3))
            self.log.warn(
                "sync of {owner}/{conversation} failed ({code}, attempt {attempt}): {error}",
                owner=conversation.owner, conversation=conversation.name, code=code,
                attempt=conversation.failures, error=failure.getErrorMessage())
            for waiter in waiters:
                waiter.errback(failure)
            if code != "sync_conflict" and not conversation.deleting and not self.stopping:
                conversation.dirty = True
                delay = min(self.config.sync_retry_max,
                            RETRY_FIRST * 2 ** min(conversation.failures - 1, 30))
                conversation.timer = self.reactor.callLater(
                    delay, self._scheduled_sync, conversation)
            self._after_sync(conversation)

        running.addCallbacks(succeeded, failed)

    def _after_sync(self, conversation: Conversation) -> None:
        """Start what waited for the sync (or prepare, or eviction) that just ended."""
        if conversation.syncing is not None or conversation.opening is not None:
            return
        if conversation.deleting:
            waiters, conversation.waiters = conversation.waiters, []
            for waiter in waiters:
                waiter.errback(CorralError(UNAVAILABLE, "the conversation is being deleted"))
            return
        if conversation.waiters:
            self._sync(conversation)
        elif conversation.dirty and conversation.timer is None:
            if conversation.attached == 0:
                self._sync(conversation)
            else:
                conversation.timer = self.reactor.callLater(
                    self.config.sync_delay, self._scheduled_sync, conversation)
        elif conversation.attached == 0 and not conversation.busy:
            if not self.storage.background_sync:
                # The directory is the durable copy: nothing more to remember.
                self.conversations.pop((conversation.owner, conversation.name), None)
            elif self.config.warm_idle_time == 0 and not self.stopping:
                self._evict(conversation, resync=False)

    # -- eviction ----------------------------------------------------------

    def _evict(self, conversation: Conversation, resync: bool = True) -> Deferred:
        """Remove an idle local copy if the backend confirms it is durable; fires True if removed.

        Refused (False) while the conversation is attached, preparing,
        syncing, scheduled or being deleted. When the copy holds changes not
        yet durable, and ``resync``, a sync (with retries) starts; the next
        cleanup tries again.
        """
        if conversation.busy or conversation.identity is None:
            return succeed(False)
        conversation.opening = self.storage.evict_workspace(conversation.identity,
                                                            conversation.name)

        def done(evicted):
            conversation.opening = None
            if evicted:
                conversation.path = None
                self._audit("workspace_evicted", conversation)
                self._forget_if_idle(conversation)
            elif resync and not conversation.busy:
                conversation.dirty = True  # changes not yet durable: sync them first
                self._after_sync(conversation)
            return bool(evicted)

        def failed(failure):
            conversation.opening = None
            self.log.warn("could not evict {owner}/{conversation}: {error}",
                          owner=conversation.owner, conversation=conversation.name,
                          error=failure.getErrorMessage())
            return False

        return conversation.opening.addCallbacks(done, failed)

    # -- deletion ----------------------------------------------------------

    async def delete(self, owner: str, name: str | None, reason: str = "request") -> dict:
        """Delete a conversation (or, with ``name`` None, an owner) here and in the store.

        Until it has finished, hellos for it are refused; if it fails (the
        store is unreachable), it stays pending and the cleanup retries it.
        """
        started = self.reactor.seconds()
        existing = self.conversations.get((owner, name)) if name is not None else None
        if owner in self.deleting_owners or (existing is not None and existing.deleting):
            raise CorralError(UNAVAILABLE, f"{owner}/{name or ''} is already being deleted")
        if name is None:
            self.deleting_owners.add(owner)
            affected = [c for (o, _), c in self.conversations.items() if o == owner]
        else:
            affected = [self._get(owner, name)]
        self.pending_deletions.add((owner, name))
        for conversation in affected:
            conversation.deleting = True
            self._cancel_timer(conversation)
            self._after_sync(conversation)  # fails the checkpoints waiting, if idle
        try:
            await self._in_thread(self._mark_deletion, owner, name)
            await self.close_connections(owner, name)
            for conversation in affected:
                for pending in (conversation.opening, conversation.syncing,
                                conversation.marking):
                    if pending is not None:
                        await _quietly(pending)
            if name is None:
                stats = await self.storage.delete_owner(owner)
                removed = await self._in_thread(self._remove_owner_locally, owner)
            else:
                stats = await self.storage.delete_conversation(owner, name)
                removed = await self._in_thread(self._remove_conversation_locally, owner, name)
            await self._in_thread(self._unmark_deletion, owner, name)
        finally:
            for conversation in affected:
                conversation.deleting = False
            self.deleting_owners.discard(owner)
        self.pending_deletions.discard((owner, name))
        if name is None:
            self.pending_deletions -= {p for p in self.pending_deletions if p[0] == owner}
        for conversation in affected:
            conversation.path = None
            self.conversations.pop((conversation.owner, conversation.name), None)
        result = {
            "owner": owner,
            **({"conversation": name} if name is not None else {}),
            "reason": reason,
            "local_removed": removed,
            **stats_fields(stats),
            "duration_ms": round((self.reactor.seconds() - started) * 1000, 3),
        }
        self.auditor.emit("owner_deleted" if name is None else "workspace_deleted", **result)
        self.log.info("deleted {what} ({reason})",
                      what=owner if name is None else f"{owner}/{name}", reason=reason)
        return result

    def _deletion_marker(self, owner: str, name: str | None) -> str:
        # Conversation names start with a letter or digit: ".owner" is never one.
        return os.path.join(self.deletions_root, owner, name or ".owner")

    def _mark_deletion(self, owner: str, name: str | None) -> None:
        """Remember a deletion until it is complete (blocking).

        Deleting touches the store and then the local directory; a crash in
        between would otherwise let the next attach commit the local copy
        again and bring the conversation back. The next start resumes it.
        """
        path = self._deletion_marker(owner, name)
        make_directories(os.path.dirname(path), 0o700)
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))

    def _unmark_deletion(self, owner: str, name: str | None) -> None:
        if name is None:  # the owner's deletion covers its conversations' too
            if os.path.isdir(self.deletions_root):
                remove_entry(self.deletions_root, owner)
            return
        try:
            os.unlink(self._deletion_marker(owner, name))
            os.rmdir(os.path.dirname(self._deletion_marker(owner, name)))
        except OSError:
            pass

    def _pending_deletions(self) -> list[tuple[str, str | None]]:
        pending = []
        try:
            owners = sorted(os.listdir(self.deletions_root))
        except FileNotFoundError:
            return pending
        for owner in owners:
            try:
                names = sorted(os.listdir(os.path.join(self.deletions_root, owner)))
            except OSError:
                continue
            for name in names:
                if NAME_PATTERN.fullmatch(owner) and (
                        name == ".owner" or NAME_PATTERN.fullmatch(name)):
                    pending.append((owner, None if name == ".owner" else name))
        return pending

    def _remove_conversation_locally(self, owner: str, name: str) -> bool:
        directory = os.path.join(self.config.workspace_root, owner)
        removed = False
        if os.path.isdir(directory) and not os.path.islink(directory):
            removed = remove_entry(directory, name)
        self._remove_records(owner, name)
        return removed

    def _remove_owner_locally(self, owner: str) -> bool:
        """Remove the owner's directory: its uid is free again."""
        removed = remove_entry(self.config.workspace_root, owner)
        self._remove_records(owner, None)
        return removed

    # -- the periodic cleanup ----------------------------------------------

    def start(self) -> None:
        """Load the pending deletions; run the cleanup (which finishes them) now and every cleanup_interval."""
        self.pending_deletions = set(self._pending_deletions())
        for owner, name in sorted(self.pending_deletions, key=str):
            self.log.warn("an interrupted deletion of {what} is finished by the cleanup",
                          what=owner if name is None else f"{owner}/{name}")
        self._cleanup_loop = LoopingCall(self._cleanup_tick)
        self._cleanup_loop.clock = self.reactor
        self._cleanup_loop.start(self.config.cleanup_interval, now=True)

    def stop(self) -> None:
        """Stop scheduling: no cleanup, no retry; say what is not durable."""
        self.stopping = True
        if self._cleanup_loop is not None and self._cleanup_loop.running:
            self._cleanup_loop.stop()
        pending = []
        for conversation in self.conversations.values():
            if conversation.timer is not None:
                pending.append(f"{conversation.owner}/{conversation.name}")
            self._cancel_timer(conversation)
        if pending:
            self.log.warn(
                "{count} conversations have changes not yet durable ({names}); they are "
                "synced at their next attach or by the next start's cleanup",
                count=len(pending), names=", ".join(sorted(pending)[:20]))

    def _cleanup_tick(self) -> None:
        if self._cleanup_running is None:
            now = self.reactor.seconds()
            period = max(self.config.cleanup_interval, self.config.blob_gc_grace / 4)
            collect = self._last_gc is None or now - self._last_gc >= period
            self.cleanup(collect).addErrback(
                lambda f: self.log.failure("the cleanup job failed", f))

    def cleanup(self, collect: bool = True) -> Deferred:
        """One run of the cleanup job; fires with its counts (also audited).

        Stored garbage is collected when ``collect``; the periodic runs
        collect at most every ``max(cleanup_interval, blob_gc_grace / 4)``,
        since collection reads every manifest in the store.
        """
        if self._cleanup_running is not None:
            return _quietly(self._cleanup_running).addCallback(lambda _: self.cleanup(collect))
        self._cleanup_running = Deferred.fromCoroutine(self._cleanup(collect))

        def finished(result):
            self._cleanup_running = None
            return result

        return self._cleanup_running.addBoth(finished)

    async def _cleanup(self, collect: bool = True) -> dict:
        started = self.reactor.seconds()
        counts = {"resumed_deletions": 0, "marked_used": 0, "evicted": 0, "kept_not_durable": 0,
                  "retention_deleted": 0, "records_removed": 0, "blobs_deleted": 0}
        now = time.time()
        # 0. Deletions asked for and not finished (a crash, an unreachable store):
        # an owner's first, which covers its conversations'.
        for owner, name in sorted(self.pending_deletions, key=lambda p: (p[0], p[1] or "")):
            if (owner, name) not in self.pending_deletions:
                continue  # done with its owner's
            try:
                await self.delete(owner, name, reason="resumed")
                counts["resumed_deletions"] += 1
            except CorralError:
                pass  # being deleted right now
            except Exception as e:
                self.log.warn("cleanup: the deletion of {what} failed again: {error}",
                              what=owner if name is None else f"{owner}/{name}", error=e)
        # 1. Attached conversations are in use: say so here and in the store.
        for conversation in list(self.conversations.values()):
            if conversation.attached and not conversation.deleting:
                self._mark_used(conversation)
                counts["marked_used"] += 1
        # 2. What is on this host's disk, and when each was last used.
        local = await self._in_thread(self._scan_local, now)
        stored = {}
        counts["store_errors"] = 0
        if self.storage.background_sync or self.config.retention:
            try:
                for owner, name, last_used in await self.storage.known_conversations():
                    stored[(owner, name)] = last_used
            except Exception as e:
                # The store is unreachable: work with what this host knows.
                counts["store_errors"] += 1
                self.log.warn("cleanup: cannot list the stored conversations: {error}", error=e)
        # 3. Evict idle local copies (backends that keep the durable copy elsewhere).
        if self.storage.background_sync:
            identities = {}
            for (owner, name), last_used in local.items():
                if now - last_used < self.config.warm_idle_time or self.is_deleting(owner, name):
                    continue
                conversation = self.conversations.get((owner, name))
                if conversation is not None and conversation.busy:
                    continue
                if conversation is None or conversation.identity is None:
                    if owner not in identities:
                        try:
                            identities[owner] = await self._in_thread(
                                self.identities.resolve, owner)
                        except Exception as e:
                            self.log.warn("cleanup: cannot resolve owner {owner}: {error}",
                                          owner=owner, error=e)
                            identities[owner] = None
                    if identities[owner] is None or self.is_deleting(owner, name):
                        continue
                    conversation = self._get(owner, name)
                    if conversation.identity is None:
                        conversation.identity = identities[owner]
                        conversation.path = os.path.join(identities[owner].directory, name)
                if conversation.busy:
                    continue  # attached meanwhile
                if await self._evict(conversation):
                    counts["evicted"] += 1
                else:
                    counts["kept_not_durable"] += 1
        # 4. Retention: delete what no host used for that long.
        if self.config.retention:
            candidates = dict(local)
            for key, last_used in stored.items():
                candidates[key] = max(filter(None, (candidates.get(key), last_used)), default=now)
            for (owner, name), last_used in sorted(candidates.items()):
                conversation = self.conversations.get((owner, name))
                if conversation is not None and conversation.busy:
                    continue
                if now - last_used < self.config.retention or self.is_deleting(owner, name):
                    continue
                try:
                    await self.delete(owner, name, reason="retention")
                    counts["retention_deleted"] += 1
                except Exception as e:
                    self.log.warn("retention: could not delete {owner}/{conversation}: {error}",
                                  owner=owner, conversation=name, error=e)
        # 5. Records of conversations that exist nowhere any more.
        counts["records_removed"] = await self._in_thread(
            self._remove_orphan_records, set(local) | set(stored) | set(self.conversations))
        # 6. Stored data nothing refers to.
        try:
            garbage = None
            if collect:
                self._last_gc = self.reactor.seconds()
                garbage = await self.storage.collect_garbage(self.config.blob_gc_grace)
        except Exception as e:
            counts["store_errors"] += 1
            garbage = None
            self.log.warn("cleanup: cannot collect garbage: {error}", error=e)
        counts.update({k: v for k, v in stats_fields(garbage).items() if k != "duration"})
        counts["duration_ms"] = round((self.reactor.seconds() - started) * 1000, 3)
        self.auditor.emit("cleanup_finished", **counts)
        self.log.info("cleanup: {counts}", counts=counts)
        return counts

    def _scan_local(self, now: float) -> dict:
        """``{(owner, conversation): last_used}`` for every local conversation directory.

        A directory without a record gets one now: its idle time and
        retention count from the first time this supervisor saw it.
        """
        found = {}
        root = self.config.workspace_root
        try:
            owners = os.scandir(root)
        except FileNotFoundError:
            return found
        with owners:
            for owner in owners:
                if not NAME_PATTERN.fullmatch(owner.name) or not owner.is_dir(
                        follow_symlinks=False):
                    continue
                try:
                    conversations = os.scandir(owner.path)
                except OSError:
                    continue
                with conversations:
                    for entry in conversations:
                        if not NAME_PATTERN.fullmatch(entry.name) or not entry.is_dir(
                                follow_symlinks=False):
                            continue
                        last_used = self._record_time(owner.name, entry.name)
                        if last_used is None:
                            self._touch_record(owner.name, entry.name, now)
                            last_used = now
                        found[(owner.name, entry.name)] = last_used
        return found

    def _remove_orphan_records(self, known: set) -> int:
        removed = 0
        try:
            owners = os.listdir(self.lifecycle_root)
        except FileNotFoundError:
            return 0
        for owner in owners:
            directory = os.path.join(self.lifecycle_root, owner)
            try:
                names = os.listdir(directory)
            except OSError:
                continue
            for name in names:
                if (owner, name) not in known:
                    try:
                        os.unlink(os.path.join(directory, name))
                        removed += 1
                    except OSError:
                        pass
            try:
                os.rmdir(directory)
            except OSError:
                pass
        return removed


def _quietly(deferred: Deferred) -> Deferred:
    """A Deferred that fires (with None) when ``deferred`` does, whatever its outcome."""
    done = Deferred()

    def fire(result):
        done.callback(None)
        return result

    deferred.addBoth(fire)
    return done

