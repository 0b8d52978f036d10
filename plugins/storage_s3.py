"""Storage backend ``s3``: an S3-compatible object store holds the durable copy.

``CORRAL_STORAGE=s3:s3://BUCKET/PREFIX``. The local conversation directory is
a cache: hydrated from the conversation's manifest before the runner starts,
synced back while runners work and when the last one exits, evicted once
everything in it is durable. Layout, per owner (owners share nothing)::

    PREFIX/<owner>/blobs/<sha256>                              file contents
    PREFIX/<owner>/conversations/<conversation>/manifest.json  every entry
    PREFIX/<owner>/conversations/<conversation>/used           empty; its time is the last use
    PREFIX/<owner>/conversations/<conversation>/conflicts/...  losing commits

A manifest is committed with a conditional write (``If-Match`` the ETag this
host last saw, ``If-None-Match: *`` for a new one), so two hosts committing
one conversation never silently overwrite each other: the loser gets
``SyncConflict`` and its version is kept as a conflict copy.

Blobs no manifest or conflict copy refers to are deleted only once they are
older than a grace period (``blob_gc_grace``), and a sync never relies on a
stored blob older than half of it (it uploads it again), so collection never
deletes a blob a sync is about to refer to.

Settings come from the configuration (``s3_endpoint_url``, ``s3_region``,
``s3_access_key_id``, ``s3_secret_access_key``, ``s3_session_token``,
``s3_max_concurrency``, ``blob_gc_grace``); without a key id, boto3's default
chain (``AWS_*`` variables, ``~/.aws``, instance roles) provides credentials.
Credentials are never logged, audited, put in an error or a repr. An
unreachable, failing or throttling store surfaces as
``supervisor.storage.StorageUnavailable``. boto3 is imported only when the
backend is built, so corral runs without it when ``s3`` is not configured.
See ``docs/storage.md``.
"""

import contextlib
import hashlib
import os
import re
import shutil
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from urllib.parse import urlsplit

from attrs import frozen
from twisted.internet.threads import deferToThread
from twisted.logger import Logger
from zope.interface import implementer

from supervisor import manifest as mf
from supervisor.fsutil import ensure_private_directory, make_directories, open_directory, remove_entry
from supervisor.hello import NAME_PATTERN
from supervisor.hookspecs import hookimpl
from supervisor.interfaces import IStorageBackend
from supervisor.storage import Prepared, StorageUnavailable

ENDPOINT_VARIABLE = "CORRAL_S3_ENDPOINT_URL"
#: Blob transfers in flight at once, across all conversations of a supervisor (default).
TRANSFERS = 8
#: Default ``blob_gc_grace``: an unreferenced blob younger than this is kept.
GC_GRACE = 86400.0
#: Keys per DeleteObjects request (the S3 maximum).
DELETE_BATCH = 1000
#: Parsed state files kept in memory, the conversations used last, up to this many
#: entries in all (a 10,000-entry state takes about 7.5 MiB; 50,000 about 38 MiB).
STATE_CACHE_ENTRIES = 50_000
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_PREFIX_PART = re.compile(r"[A-Za-z0-9._=+@,-]+")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_CONFLICT_CODES = {"PreconditionFailed", "ConditionalRequestConflict", "412", "409"}
_MISSING_CODES = {"NoSuchKey", "404", "NotFound"}
#: Error codes that mean "slow down" or "try again", whatever the HTTP status.
_TRANSIENT_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "ThrottledException",
    "RequestThrottled", "RequestThrottledException", "TooManyRequests",
    "TooManyRequestsException", "RequestLimitExceeded", "BandwidthLimitExceeded",
    "RequestTimeout", "RequestTimeoutException", "PriorRequestNotComplete",
    "ServiceUnavailable", "InternalError", "ProvisionedThroughputExceededException",
})
_MISSING = object()


def _valid_name(value) -> bool:
    return isinstance(value, str) and value.isascii() and NAME_PATTERN.fullmatch(value) is not None


def _check_names(*names) -> None:
    for name in names:
        if not _valid_name(name):
            raise ValueError(f"{name!r} is not a valid owner or conversation name")


class SyncConflict(Exception):
    """Another host committed this conversation since this host last saw it.

    Nothing is lost: this host's version is stored as ``conflict_key``.
    ``code`` is stable for audit events.
    """

    code = "sync_conflict"

    def __init__(self, owner: str, conversation: str, conflict_key: str | None):
        self.owner = owner
        self.conversation = conversation
        self.conflict_key = conflict_key
        kept = (f"this host's version is kept as {conflict_key}" if conflict_key
                else "this host's version was already kept as a conflict copy")
        super().__init__(
            f"conversation {owner}/{conversation} was changed by another host since "
            f"this host last synced it; its manifest was not overwritten and {kept}; "
            "the next attach loads the other host's version"
        )


class StoreRefused(Exception):
    """A DeleteObjects request that the store answered with per-key errors."""

    def __init__(self, code: str, count: int):
        self.store_code = code
        super().__init__(f"the object store refused to delete {count} objects ({code})")


@frozen
class S3Location:
    """A bucket and a key prefix (no leading or trailing slash; may be empty)."""

    bucket: str
    prefix: str

    def key(self, *parts: str) -> str:
        """The object key of ``parts`` below the prefix."""
        return "/".join((self.prefix, *parts) if self.prefix else parts)

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"


def parse_location(argument: str | None) -> S3Location:
    """Parse ``s3://BUCKET[/PREFIX]``; raise ValueError with a sentence on anything else."""
    if not argument:
        raise ValueError(
            "the s3 backend needs a location: write s3:s3://BUCKET/PREFIX, "
            "for example s3:s3://corral-workspaces/prod"
        )
    parts = urlsplit(argument)
    if parts.scheme != "s3" or parts.query or parts.fragment or "@" in parts.netloc:
        raise ValueError(
            f"{argument!r} is not an s3:// location; write s3://BUCKET/PREFIX "
            "(no credentials, query or fragment in it)"
        )
    if not _BUCKET.fullmatch(parts.netloc) or ".." in parts.netloc:
        raise ValueError(
            f"{parts.netloc!r} is not a valid bucket name: 3 to 63 lower-case "
            "letters, digits, '.' and '-'"
        )
    prefix = parts.path.strip("/")
    if prefix and not all(_PREFIX_PART.fullmatch(p) and p not in (".", "..")
                          for p in prefix.split("/")):
        raise ValueError(
            f"key prefix {prefix!r} must be parts of letters, digits and ._=+@,- "
            "separated by single slashes"
        )
    return S3Location(parts.netloc, prefix)


def check_endpoint(url: str) -> str:
    """Return ``url`` when it is an http(s) URL without credentials; raise ValueError otherwise."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"s3_endpoint_url {url!r} is not an http:// or https:// URL")
    if parts.username or parts.password:
        raise ValueError(
            "s3_endpoint_url must not carry credentials; set s3_access_key_id and "
            "s3_secret_access_key (or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY) instead"
        )
    return url


def _error_code(error) -> str:
    response = getattr(error, "response", None) or {}
    code = str(response.get("Error", {}).get("Code", ""))
    status = str(response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
    return code or status


def _status(error) -> int:
    response = getattr(error, "response", None) or {}
    try:
        return int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    except (TypeError, ValueError):
        return 0


def _is_missing(error) -> bool:
    return _status(error) == 404 or _error_code(error) in _MISSING_CODES


def unavailable_reason(error: BaseException) -> str | None:
    """Why ``error`` means the store could not be reached, as a phrase naming its class; else None.

    Connection failures and timeouts, credentials that could not be
    obtained, server errors (HTTP 5xx) and throttling count; a refusal
    (access denied, a missing bucket, a bad request) does not. The phrase
    holds the exception's class and the store's error code, never its
    message, so no credential or signature can leak through it.
    """
    if isinstance(error, StoreRefused):
        if error.store_code in _TRANSIENT_CODES:
            return f"refused deletes with {error.store_code}"
        return None
    try:
        from botocore import exceptions as bx
    except ImportError:  # pragma: no cover - the backend is never built without botocore
        return None
    name = type(error).__name__
    if isinstance(error, bx.ClientError):
        status, code = _status(error), _error_code(error)
        if code in _TRANSIENT_CODES or status == 429 or code == "503":
            return f"is throttling or busy ({name} {code}, HTTP {status})"
        if status >= 500:
            return f"answered with a server error ({name} {code}, HTTP {status})"
        return None
    if isinstance(error, bx.ConnectionError):
        # EndpointConnectionError, ConnectTimeoutError, ProxyConnectionError, SSLError
        return f"could not be reached ({name})"
    if isinstance(error, (bx.HTTPClientError, bx.IncompleteReadError)):
        # ConnectionClosedError, ReadTimeoutError, ResponseStreamingError
        return f"dropped the connection or did not answer in time ({name})"
    if isinstance(error, (bx.NoCredentialsError, bx.PartialCredentialsError,
                          bx.CredentialRetrievalError)):
        return f"could not be signed for: no usable credentials were found ({name})"
    return None


def _timestamp(value) -> float:
    """A POSIX timestamp from a boto3 ``LastModified`` (an aware datetime)."""
    if value.tzinfo is None:
        value = value.replace(tzinfo=timezone.utc)
    return value.timestamp()


@frozen
class HydrateStats:
    """Metadata of one hydrate, for logs and audit events."""

    downloaded: int
    bytes_downloaded: int
    removed: int
    hashed: int
    committed_first: bool
    duration: float


@frozen
class SyncStats:
    """Metadata of one sync, for logs and audit events."""

    committed: bool
    files: int
    uploaded: int
    bytes_uploaded: int
    hashed: int
    skipped: int
    duration: float


@frozen
class DeleteStats:
    """Metadata of one deletion from the store (a conversation or an owner).

    ``objects_deleted`` counts manifests, ``used`` markers and conflict
    copies; ``blobs_deleted`` the blobs; ``bytes_deleted`` the bytes of
    everything deleted. ``blobs_kept_young`` counts blobs the deleted
    conversation alone referred to but younger than ``blob_gc_grace``: the
    garbage collection deletes them once they are older.
    """

    objects_deleted: int
    blobs_deleted: int
    bytes_deleted: int
    duration: float
    blobs_kept_young: int = 0


@frozen
class GcStats:
    """Metadata of one garbage collection.

    ``owners`` counts the owners whose blobs were examined (an owner with a
    manifest that cannot be read is skipped, and logged); ``blobs_kept_young``
    counts unreferenced blobs younger than the grace period.
    """

    owners: int
    blobs_deleted: int
    bytes_deleted: int
    blobs_kept_young: int
    duration: float


@implementer(IStorageBackend)
class S3Storage:
    """Workspaces whose durable copy is a manifest and blobs in an S3 bucket."""

    name = "s3"
    background_sync = True
    log = Logger()

    def __init__(self, location: S3Location, client, state_dir: str, transfers: int = TRANSFERS,
                 gc_grace: float = GC_GRACE, endpoint: str | None = None):
        self.location = location
        #: A boto3 S3 client (thread-safe); tests hook its events to count requests.
        self.client = client
        self.state_root = os.path.join(state_dir, "s3-state")
        #: Blobs younger than this are never collected; a sync re-uploads a
        #: stored blob older than half of it instead of relying on it.
        self.gc_grace = float(gc_grace)
        #: The clock compared with the store's LastModified (tests move it).
        self.clock = time.time
        self._endpoint = _endpoint_label(endpoint)
        self._transfers = ThreadPoolExecutor(transfers, thread_name_prefix="corral-s3")
        self._locks: dict = {}
        self._locks_guard = threading.Lock()
        #: ``{(owner, conversation): ((st_ino, st_size, st_mtime_ns), SyncState)}`` of the
        #: state files last read or written, most recent last (STATE_CACHE_ENTRIES).
        self._states: dict = {}

    def __repr__(self) -> str:
        return f"<S3Storage {self.location} at {self._endpoint}>"

    # --- IStorageBackend --------------------------------------------------

    def prepare_workspace(self, identity, conversation):
        """Create and hydrate the conversation directory in a worker thread; fires with a Prepared."""
        return deferToThread(self.hydrate_blocking, identity, conversation).addCallback(
            lambda result: Prepared(*result))

    def sync_workspace(self, identity, conversation, path):
        """Commit the workspace's current content; fires with SyncStats, or None when nothing changed."""
        return deferToThread(self.sync_blocking, identity, conversation).addCallback(
            _committed_only)

    def release_workspace(self, identity, conversation, path):
        """The last runner exited: sync like ``sync_workspace``."""
        return deferToThread(self.sync_blocking, identity, conversation).addCallback(
            _committed_only)

    def evict_workspace(self, identity, conversation):
        """Remove the local copy if everything in it is committed; fires True when it is gone."""
        return deferToThread(self.evict_blocking, identity, conversation)

    def delete_conversation(self, owner, conversation):
        """Delete the conversation's manifest, marker, conflict copies and unshared blobs; fires with DeleteStats."""
        return deferToThread(self.delete_conversation_blocking, owner, conversation)

    def delete_owner(self, owner):
        """Delete every object under ``PREFIX/<owner>/``; fires with DeleteStats."""
        return deferToThread(self.delete_owner_blocking, owner)

    def mark_used(self, owner, conversation):
        """Write the empty ``used`` marker, whose LastModified is the conversation's last use."""
        return deferToThread(self.mark_used_blocking, owner, conversation)

    def known_conversations(self):
        """Fires with ``[(owner, conversation, last_used)]`` for every conversation in the store."""
        return deferToThread(self.known_conversations_blocking)

    def collect_garbage(self, grace):
        """Delete blobs no manifest or conflict copy refers to, older than ``grace``; fires with GcStats."""
        return deferToThread(self.collect_garbage_blocking, grace)

    def close(self) -> None:
        """Stop the transfer threads once running transfers end."""
        self._transfers.shutdown(wait=True)

    # --- errors -----------------------------------------------------------

    @contextlib.contextmanager
    def _reaching(self, doing: str, subject: str):
        """Turn a failure to reach the store into StorageUnavailable naming ``subject``."""
        try:
            yield
        except StorageUnavailable:
            raise
        except Exception as e:
            reason = unavailable_reason(e)
            if reason is None:
                raise
            error = StorageUnavailable(
                f"could not {doing} {subject}: the object store at {self._endpoint} {reason}; "
                "the local copy is unchanged and the operation can be retried"
            )
            error.subject = subject
            error.reason = reason
            raise error from None

    # --- hydrate and sync -------------------------------------------------

    def hydrate_blocking(self, identity, conversation: str) -> tuple:
        """Make the local conversation directory match the store; return ``(path, HydrateStats)``.

        Local changes that were never committed (an earlier sync failed, or
        the directory predates this backend) are committed first, so a
        hydrate never throws away work: if that commit conflicts, this
        host's version is kept as a conflict copy and the store's is loaded.
        """
        started = time.monotonic()
        path = ensure_private_directory(identity.directory, conversation, identity.uid,
                                        identity.gid, 0o700)
        with self._lock(identity.owner, conversation), \
                self._reaching("hydrate", f"{identity.owner}/{conversation}"):
            root_fd = open_directory(identity.directory, conversation)
            try:
                state = self._load_state(identity.owner, conversation)
                # Ask the store while the workspace is walked (the usual answer:
                # 304, nothing changed).
                asked = self._transfers.submit(
                    self._get_manifest, identity.owner, conversation, state.etag)
                try:
                    plan, committed, _, tried = self._commit_local(
                        root_fd, identity, conversation, state, conflict_ok=True)
                except BaseException:
                    asked.cancel()
                    raise
                if committed:
                    asked.cancel()
                    remote, etag = None, state.etag  # the store holds this very version
                elif tried:
                    # A conflict: another host committed since; load its version.
                    asked.cancel()
                    remote, etag = self._get_manifest(identity.owner, conversation, state.etag)
                else:
                    remote, etag = asked.result()
                loaded = (state.etag, state.manifest, state.stamps, state.conflict_saved)
                result = mf.HydrateResult(stamps=plan.stamps)
                if etag is None:
                    # No manifest in the store (new, or removed there): keep the
                    # local copy; the next sync creates the manifest.
                    state.etag, state.manifest = None, mf.Manifest()
                elif remote is not None:
                    result = mf.hydrate(root_fd, remote, plan.stamps, identity.uid,
                                        identity.gid, self._fetcher(identity.owner),
                                        self._transfers, scan=plan.scan)
                    state.etag, state.manifest = etag, remote
                    # The directory changed under the plan: the next one starts afresh.
                    state.plan = None
                state.stamps = result.stamps
                if (state.etag, state.manifest, state.stamps, state.conflict_saved) != loaded:
                    self._save_state(identity.owner, conversation, state)
                else:
                    self._remember_plan(identity.owner, conversation, state.plan)
            finally:
                os.close(root_fd)
        stats = HydrateStats(result.downloaded, result.bytes_downloaded, result.removed,
                             result.hashed, committed, time.monotonic() - started)
        self.log.info(
            "hydrated {owner}/{conversation}: {downloaded} files ({bytes} bytes) fetched, "
            "{removed} removed in {duration:.3f} s",
            owner=identity.owner, conversation=conversation, downloaded=stats.downloaded,
            bytes=stats.bytes_downloaded, removed=stats.removed, duration=stats.duration,
        )
        return path, stats

    def sync_blocking(self, identity, conversation: str) -> SyncStats:
        """Upload what changed and commit the new manifest.

        Raises SyncConflict when another host won, StorageUnavailable when
        the store could not be reached; the local copy is untouched either way.
        """
        started = time.monotonic()
        with self._lock(identity.owner, conversation), \
                self._reaching("sync", f"{identity.owner}/{conversation}"):
            root_fd = open_directory(identity.directory, conversation)
            try:
                state = self._load_state(identity.owner, conversation)
                plan, committed, uploads, _ = self._commit_local(
                    root_fd, identity, conversation, state, conflict_ok=False)
            finally:
                os.close(root_fd)
        stats = SyncStats(committed, sum(1 for e in plan.manifest.entries if e.kind == mf.FILE),
                          len(uploads), sum(u.size for u in uploads), plan.hashed, plan.skipped,
                          time.monotonic() - started)
        self.log.info(
            "synced {owner}/{conversation}: {uploaded} blobs ({bytes} bytes) uploaded, "
            "manifest {what} in {duration:.3f} s",
            owner=identity.owner, conversation=conversation, uploaded=stats.uploaded,
            bytes=stats.bytes_uploaded, what="committed" if committed else "unchanged",
            duration=stats.duration,
        )
        return stats

    def _commit_local(self, root_fd, identity, conversation, state, conflict_ok):
        """Commit the workspace when it differs from the state's manifest.

        Returns ``(plan, committed, uploads, tried)``; ``tried`` is True when a
        commit was attempted (it failed when not ``committed``). On a conflict this host's
        version is kept as a conflict copy (every blob it names made
        present first) and the state saved with the conflict noted; then
        SyncConflict is raised unless ``conflict_ok``.
        """
        owner = identity.owner
        plan = mf.plan_sync(root_fd, state, identity.uid, previous=state.plan)
        state.plan = plan
        uploads = []
        committed = False
        tried = plan.changed(state.manifest) or (state.etag is None and bool(plan.manifest.entries))
        if tried:
            uploads = self._upload(root_fd, identity, plan, state.manifest.hashes())
            body = plan.manifest.to_bytes(owner, conversation)
            etag = self._put_manifest(owner, conversation, body, state.etag)
            if etag is None:
                # A crash right after an earlier commit of these very entries
                # (before the state was saved) looks like a conflict: it is not.
                remote, remote_etag = self._get_manifest(owner, conversation, None)
                if remote is not None and remote.entries == plan.manifest.entries:
                    etag = remote_etag
            if etag is None:
                kept = None
                if state.conflict_saved != hashlib.sha256(body).hexdigest():
                    # The blobs of the base manifest were not checked above; the
                    # winner may no longer refer to them, so check them now.
                    uploads += self._upload(root_fd, identity, plan, set())
                    body = plan.manifest.to_bytes(owner, conversation)
                    kept = self._save_conflict(owner, conversation, body)
                    state.conflict_saved = hashlib.sha256(body).hexdigest()
                    self._save_state(owner, conversation, state)
                conflict = SyncConflict(owner, conversation, kept)
                self.log.warn("{message}", message=str(conflict))
                if not conflict_ok:
                    raise conflict
            else:
                committed = True
                state.etag, state.manifest = etag, plan.manifest
                state.stamps, state.conflict_saved = plan.stamps, None
                self._save_state(owner, conversation, state)
        else:
            state.stamps = plan.stamps
            self._remember_plan(owner, conversation, plan)
        return plan, committed, uploads, tried

    def _upload(self, root_fd, identity, plan, known: set) -> list:
        return mf.upload_missing(
            root_fd, plan, known, identity.uid,
            lambda sha: self._blob_usable(identity.owner, sha),
            lambda sha, body, size: self._put_blob(identity.owner, sha, body),
            self._transfers, self._spool_dir(),
        )

    # --- evict ------------------------------------------------------------

    def evict_blocking(self, identity, conversation: str) -> bool:
        """Remove the local directory if it holds nothing that is not committed.

        True when it is gone (also when it was never there); False when it
        holds changes not yet committed, or is not a directory this code
        may remove. Its bookkeeping goes with it.
        """
        owner = identity.owner
        with self._lock(owner, conversation):
            try:
                root_fd = open_directory(identity.directory, conversation)
            except FileNotFoundError:
                self._forget_state(owner, conversation)
                return True
            except OSError as e:
                self.log.warn("not evicting {owner}/{conversation}: its path is not a "
                              "directory ({error})", owner=owner, conversation=conversation,
                              error=e.strerror)
                return False
            try:
                state = self._load_state(owner, conversation)
                plan = mf.plan_sync(root_fd, state, identity.uid, previous=state.plan)
            finally:
                os.close(root_fd)
            committed = state.etag is not None or not plan.manifest.entries
            if plan.changed(state.manifest) or not committed:
                self.log.info("not evicting {owner}/{conversation}: it holds changes not yet "
                              "committed", owner=owner, conversation=conversation)
                return False
            remove_entry(identity.directory, conversation)
            self._forget_state(owner, conversation)
        self.log.info("evicted {owner}/{conversation}: everything in it is committed",
                      owner=owner, conversation=conversation)
        return True

    # --- delete -----------------------------------------------------------

    def delete_conversation_blocking(self, owner: str, conversation: str) -> DeleteStats:
        """Delete the conversation's objects, then the blobs only it referred to.

        Blobs another manifest or conflict copy of the owner refers to are
        kept; so are blobs younger than ``gc_grace`` (a sync elsewhere may be
        about to refer to one), which a later collection deletes. Idempotent.
        """
        _check_names(owner, conversation)
        started = time.monotonic()
        subject = f"{owner}/{conversation}"
        blobs_deleted = blobs_young = blob_bytes = 0
        with self._lock(owner, conversation), self._reaching("delete", subject):
            prefix = self.location.key(owner, "conversations", conversation) + "/"
            objects = list(self._objects(prefix))
            readable = [o["Key"] for o in objects if _is_manifest_key(o["Key"][len(prefix):])]
            candidates = {}
            for key, manifest in zip(readable, mf.run_all(
                    self._transfers, lambda k: self._read_manifest(k, subject), readable)):
                for entry in (manifest.entries if manifest is not None else ()):
                    if entry.kind == mf.FILE:
                        candidates[entry.sha256] = entry.size
            self._delete_keys([o["Key"] for o in objects])
            if candidates:
                remaining = self._references(owner)
                if remaining is None:
                    self.log.warn("deleted {subject} but kept its blobs: another manifest of "
                                  "the owner cannot be read", subject=subject)
                else:
                    doomed = sorted(set(candidates) - remaining)
                    blobs_deleted, blob_bytes, blobs_young = self._delete_old_blobs(
                        owner, doomed, self.clock() - self.gc_grace)
            self._forget_state(owner, conversation)
        stats = DeleteStats(len(objects), blobs_deleted,
                            sum(o.get("Size", 0) for o in objects) + blob_bytes,
                            time.monotonic() - started, blobs_young)
        self.log.info(
            "deleted {subject} from the store: {objects} objects, {blobs} blobs "
            "({bytes} bytes), {young} young blobs left to the collection",
            subject=subject, objects=stats.objects_deleted, blobs=stats.blobs_deleted,
            bytes=stats.bytes_deleted, young=blobs_young)
        return stats

    def delete_owner_blocking(self, owner: str) -> DeleteStats:
        """Delete every object under ``PREFIX/<owner>/`` and the owner's bookkeeping. Idempotent."""
        _check_names(owner)
        started = time.monotonic()
        blobs_prefix = self.location.key(owner, "blobs") + "/"
        with self._reaching("delete owner", owner):
            objects = list(self._objects(self.location.key(owner) + "/"))
            self._delete_keys([o["Key"] for o in objects])
        blobs = sum(1 for o in objects if o["Key"].startswith(blobs_prefix))
        shutil.rmtree(os.path.join(self.state_root, owner), ignore_errors=True)
        stats = DeleteStats(len(objects) - blobs, blobs, sum(o.get("Size", 0) for o in objects),
                            time.monotonic() - started)
        self.log.info("deleted owner {owner} from the store: {objects} objects, {blobs} blobs "
                      "({bytes} bytes)", owner=owner, objects=stats.objects_deleted,
                      blobs=stats.blobs_deleted, bytes=stats.bytes_deleted)
        return stats

    # --- use and listing --------------------------------------------------

    def mark_used_blocking(self, owner: str, conversation: str) -> None:
        """PUT the empty ``conversations/<c>/used`` object; its LastModified is the use."""
        _check_names(owner, conversation)
        with self._reaching("mark as used", f"{owner}/{conversation}"):
            self.client.put_object(
                Bucket=self.location.bucket,
                Key=self.location.key(owner, "conversations", conversation, "used"), Body=b"")

    def known_conversations_blocking(self) -> list:
        """``[(owner, conversation, last_used)]`` sorted, for every conversation with an object.

        ``last_used`` is the latest LastModified of ``manifest.json`` and
        ``used`` (a POSIX timestamp), or None for a conversation that only
        has conflict copies. Names that are not valid are skipped.
        """
        found = {}
        with self._reaching("list", "the stored conversations"):
            for owner in self._owners():
                prefix = self.location.key(owner, "conversations") + "/"
                for obj in self._objects(prefix):
                    conversation, _, rest = obj["Key"][len(prefix):].partition("/")
                    if not _valid_name(conversation) or not rest:
                        continue
                    when = found.setdefault((owner, conversation), None)
                    if rest in ("manifest.json", "used"):
                        stamp = _timestamp(obj["LastModified"])
                        found[(owner, conversation)] = stamp if when is None else max(when, stamp)
        return sorted((owner, name, when) for (owner, name), when in found.items())

    # --- garbage collection -----------------------------------------------

    def collect_garbage_blocking(self, grace: float) -> GcStats:
        """Delete every owner's blobs that nothing refers to and that are older than ``grace``.

        References (every manifest and conflict copy) are read before the
        blobs are listed, and each blob is checked again (HEAD) just before
        it is deleted, so a blob a sync uploaded again meanwhile is kept.
        An owner with a manifest that cannot be read is skipped entirely.
        """
        started = time.monotonic()
        cutoff = self.clock() - max(0.0, float(grace))
        owners = deleted = freed = young = 0
        for owner in self._list_owners():
            with self._reaching("collect garbage of owner", owner):
                references = self._references(owner)
                if references is None:
                    continue
                owners += 1
                doomed = []
                for obj in self._objects(self.location.key(owner, "blobs") + "/"):
                    sha = obj["Key"].rpartition("/")[2]
                    if not _SHA256.fullmatch(sha) or sha in references:
                        continue
                    if _timestamp(obj["LastModified"]) >= cutoff:
                        young += 1
                    else:
                        doomed.append(sha)
                count, size, kept = self._delete_old_blobs(owner, doomed, cutoff)
                deleted, freed, young = deleted + count, freed + size, young + kept
        stats = GcStats(owners, deleted, freed, young, time.monotonic() - started)
        self.log.info("collected garbage of {owners} owners: {blobs} blobs ({bytes} bytes) "
                      "deleted, {young} unreferenced blobs kept as younger than {grace} s",
                      owners=owners, blobs=deleted, bytes=freed, young=young, grace=grace)
        return stats

    def _list_owners(self) -> list:
        with self._reaching("list", "the stored owners"):
            return list(self._owners())

    def _references(self, owner: str) -> set | None:
        """Every blob hash a manifest or conflict copy of ``owner`` names; None if one cannot be read."""
        prefix = self.location.key(owner, "conversations") + "/"
        keys = [o["Key"] for o in self._objects(prefix)
                if _is_manifest_key(o["Key"][len(prefix):].partition("/")[2])]
        references = set()
        try:
            manifests = mf.run_all(self._transfers,
                                   lambda k: self._read_manifest(k, owner, strict=True), keys)
        except mf.ManifestError:
            return None
        for manifest in manifests:
            if manifest is not None:
                references |= manifest.hashes()
        return references

    def _read_manifest(self, key: str, subject: str, strict: bool = False):
        """The manifest stored at ``key``; None when absent (or, unless ``strict``, unreadable)."""
        from botocore.exceptions import ClientError

        try:
            response = self.client.get_object(Bucket=self.location.bucket, Key=key,
                                              ChecksumMode="ENABLED")
        except ClientError as e:
            if _is_missing(e):
                return None
            raise
        body = response["Body"]
        try:
            return mf.Manifest.from_bytes(body.read())
        except mf.ManifestError as e:
            self.log.warn("the manifest {key} of {subject} cannot be read: {error}{what}",
                          key=key, subject=subject, error=e,
                          what="; its blobs are not collected" if strict else "")
            if strict:
                raise
            return None
        finally:
            body.close()

    def _delete_old_blobs(self, owner: str, shas, cutoff: float) -> tuple:
        """Delete each blob whose LastModified, asked just now, is before ``cutoff``.

        Returns ``(deleted, bytes, kept_young)``; an absent blob counts as neither.
        """
        from botocore.exceptions import ClientError

        def one(sha):
            key = self._blob_key(owner, sha)
            try:
                head = self.client.head_object(Bucket=self.location.bucket, Key=key)
            except ClientError as e:
                if _is_missing(e):
                    return 0, 0, 0
                raise
            if _timestamp(head["LastModified"]) >= cutoff:
                return 0, 0, 1
            self.client.delete_object(Bucket=self.location.bucket, Key=key)
            return 1, int(head.get("ContentLength", 0)), 0

        results = mf.run_all(self._transfers, one, list(shas))
        return tuple(sum(r[i] for r in results) for i in range(3))

    # --- the store --------------------------------------------------------

    def _manifest_key(self, owner: str, conversation: str) -> str:
        return self.location.key(owner, "conversations", conversation, "manifest.json")

    def _blob_key(self, owner: str, sha256: str) -> str:
        return self.location.key(owner, "blobs", sha256)

    def _objects(self, prefix: str):
        """Every object under ``prefix``: dicts with Key, Size and LastModified."""
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.location.bucket, Prefix=prefix):
            yield from page.get("Contents", ())

    def _owners(self):
        """The valid owner names with objects under the prefix."""
        base = self.location.key("") if self.location.prefix else ""
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.location.bucket, Prefix=base, Delimiter="/"):
            for common in page.get("CommonPrefixes", ()):
                owner = common["Prefix"][len(base):].rstrip("/")
                if _valid_name(owner):
                    yield owner

    def _delete_keys(self, keys: list) -> None:
        """Delete ``keys`` with DeleteObjects, 1000 at a time; absent keys are fine."""
        for i in range(0, len(keys), DELETE_BATCH):
            batch = keys[i:i + DELETE_BATCH]
            response = self.client.delete_objects(
                Bucket=self.location.bucket,
                Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True})
            errors = [e for e in response.get("Errors", ())
                      if e.get("Code") not in _MISSING_CODES]
            if errors:
                raise StoreRefused(str(errors[0].get("Code", "unknown")), len(errors))

    def _get_manifest(self, owner: str, conversation: str, known_etag: str | None):
        """``(Manifest, etag)``; ``(None, etag)`` when unchanged since ``known_etag``; ``(None, None)`` when absent."""
        from botocore.exceptions import ClientError

        arguments = {"Bucket": self.location.bucket, "Key": self._manifest_key(owner, conversation),
                     "ChecksumMode": "ENABLED"}
        if known_etag:
            arguments["IfNoneMatch"] = known_etag
        try:
            response = self.client.get_object(**arguments)
        except ClientError as e:
            if _status(e) == 304 or _error_code(e) in ("304", "NotModified"):
                return None, known_etag
            if _error_code(e) in ("NoSuchKey", "404"):
                return None, None
            raise
        body = response["Body"]
        try:
            return mf.Manifest.from_bytes(body.read()), response["ETag"]
        finally:
            body.close()

    def _put_manifest(self, owner: str, conversation: str, body: bytes, etag: str | None):
        """Write the manifest only if it is still ``etag`` (absent when None).

        Returns the new ETag, or None when the condition failed (a conflict).
        """
        from botocore.exceptions import ClientError

        condition = {"IfMatch": etag} if etag else {"IfNoneMatch": "*"}
        try:
            response = self.client.put_object(
                Bucket=self.location.bucket, Key=self._manifest_key(owner, conversation),
                Body=body, ContentType="application/json", **condition)
        except ClientError as e:
            code = _error_code(e)
            if code in _CONFLICT_CODES or _status(e) in (409, 412) or (
                    etag and code in ("NoSuchKey", "404")):
                return None
            raise
        return response["ETag"]

    def _save_conflict(self, owner: str, conversation: str, body: bytes) -> str:
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
        host = re.sub(r"[^A-Za-z0-9.-]", "-", socket.gethostname())[:63] or "host"
        key = self.location.key(owner, "conversations", conversation, "conflicts",
                                f"{stamp}-{host}-{os.urandom(3).hex()}.json")
        self.client.put_object(Bucket=self.location.bucket, Key=key, Body=body,
                               ContentType="application/json")
        return key

    def _blob_usable(self, owner: str, sha256: str) -> bool:
        """True when the blob is stored and young enough to rely on.

        A blob older than half the grace period could be collected before
        this sync's manifest refers to it (another conversation referred to
        it and was deleted, say): answering False makes the sync upload it
        again, which makes it young.
        """
        from botocore.exceptions import ClientError

        try:
            head = self.client.head_object(Bucket=self.location.bucket,
                                           Key=self._blob_key(owner, sha256))
        except ClientError as e:
            if _is_missing(e):
                return False
            raise
        modified = head.get("LastModified")
        if modified is not None and self.clock() - _timestamp(modified) > self.gc_grace / 2:
            return False
        return True

    def _put_blob(self, owner: str, sha256: str, body) -> None:
        from boto3.s3.transfer import TransferConfig

        self.client.upload_fileobj(
            body, self.location.bucket, self._blob_key(owner, sha256),
            Config=TransferConfig(use_threads=False, multipart_threshold=64 << 20,
                                  multipart_chunksize=64 << 20),
        )

    def _fetcher(self, owner: str):
        def fetch(sha256: str, sink) -> None:
            response = self.client.get_object(Bucket=self.location.bucket,
                                              Key=self._blob_key(owner, sha256))
            body = response["Body"]
            try:
                for chunk in body.iter_chunks(1 << 20):
                    sink.write(chunk)
            finally:
                body.close()
        return fetch

    # --- local bookkeeping (root's own state directory) -------------------

    def _lock(self, owner: str, conversation: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault((owner, conversation), threading.Lock())

    def _state_path(self, owner: str, conversation: str) -> str:
        return os.path.join(self.state_root, owner, conversation + ".json")

    def _load_state(self, owner: str, conversation: str) -> mf.SyncState:
        """The conversation's state: parsed again only when its file changed (a new inode)."""
        path = self._state_path(owner, conversation)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            self._remember((owner, conversation), None)
            return mf.SyncState()
        signature = (st.st_ino, st.st_size, st.st_mtime_ns)
        with self._locks_guard:
            cached = self._states.get((owner, conversation))
        if cached is None or cached[0] != signature:
            cached = (signature, mf.load_state(path) or mf.SyncState())
        self._remember((owner, conversation), cached)
        return _copy_state(cached[1])

    def _save_state(self, owner: str, conversation: str, state: mf.SyncState) -> None:
        make_directories(self.state_root, 0o700)
        path = self._state_path(owner, conversation)
        mf.save_state(path, state)
        st = os.stat(path)
        self._remember((owner, conversation),
                       ((st.st_ino, st.st_size, st.st_mtime_ns), _copy_state(state)))

    def _remember_plan(self, owner: str, conversation: str, plan) -> None:
        """Keep ``plan`` with the cached state (the state file itself did not change)."""
        with self._locks_guard:
            cached = self._states.get((owner, conversation))
            if cached is not None:
                cached[1].plan = plan

    def _remember(self, key, cached) -> None:
        """Make ``cached`` the most recent state of ``key`` (None: forget it); keep within budget."""
        with self._locks_guard:
            self._states.pop(key, None)
            if cached is None:
                return
            self._states[key] = cached
            total = sum(len(c[1].manifest.entries) for c in self._states.values())
            while total > STATE_CACHE_ENTRIES and len(self._states) > 1:
                oldest = next(iter(self._states))
                total -= len(self._states.pop(oldest)[1].manifest.entries)

    def _forget_state(self, owner: str, conversation: str) -> None:
        self._remember((owner, conversation), None)
        try:
            os.unlink(self._state_path(owner, conversation))
        except FileNotFoundError:
            pass

    def _spool_dir(self) -> str:
        path = os.path.join(self.state_root, "spool")
        make_directories(path, 0o700)
        return path


def _copy_state(state):
    """A SyncState whose fields a caller may replace without touching ``state`` (a manifest is immutable)."""
    return mf.SyncState(state.etag, state.manifest, dict(state.stamps), state.conflict_saved,
                        state.plan)


def _committed_only(stats: SyncStats):
    """The stats of a sync that committed something, else None (nothing to audit)."""
    return stats if stats.committed else None


def _is_manifest_key(rest: str) -> bool:
    """True for ``manifest.json`` and ``conflicts/<name>.json`` below a conversation."""
    if rest == "manifest.json":
        return True
    directory, _, name = rest.partition("/")
    return directory == "conflicts" and name.endswith(".json") and "/" not in name


def _endpoint_label(endpoint: str | None) -> str:
    """The endpoint for messages: scheme, host and port only (never a user part), or 'AWS S3'."""
    if not endpoint:
        return "AWS S3"
    parts = urlsplit(endpoint)
    host = parts.hostname or "?"
    if ":" in host:
        host = f"[{host}]"
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}"


def make_client(endpoint_url: str | None, *, region: str | None = None,
                access_key_id: str | None = None, secret_access_key: str | None = None,
                session_token: str | None = None, transfers: int = TRANSFERS,
                max_attempts: int = 3):
    """A boto3 S3 client for ``endpoint_url`` (None: AWS).

    Credentials given here are handed to boto3 only; without a key id,
    boto3's default chain is used. A stopped store fails fast: connection
    refused is immediate, a connect times out after 5 s, and a request is
    tried ``max_attempts`` times in all (standard retry mode, with jitter).
    """
    try:
        import boto3
        from botocore.config import Config
    except ImportError:
        raise ValueError(
            "the s3 backend needs boto3, which is not installed; install corral[s3]"
        ) from None
    if bool(access_key_id) != bool(secret_access_key):
        raise ValueError("set s3_access_key_id and s3_secret_access_key together, or neither")
    options = {"max_pool_connections": 2 * transfers + 4,
               "retries": {"max_attempts": max_attempts, "mode": "standard"},
               "connect_timeout": 5, "read_timeout": 30,
               # Blobs are checked against their SHA-256; a second (CRC32) pass over
               # every download is redundant. Manifests ask for it (ChecksumMode).
               "response_checksum_validation": "when_required"}
    if endpoint_url:
        options["s3"] = {"addressing_style": "path"}
    session_options = {}
    if access_key_id:
        session_options = {"aws_access_key_id": access_key_id,
                           "aws_secret_access_key": secret_access_key,
                           "aws_session_token": session_token or None}
    session = boto3.session.Session(region_name=region or None, **session_options)
    return session.client("s3", endpoint_url=endpoint_url, config=Config(**options))


def _build(argument, config):
    location = parse_location(argument)
    endpoint = getattr(config, "s3_endpoint_url", _MISSING)
    if endpoint is _MISSING:
        endpoint = os.environ.get(ENDPOINT_VARIABLE)
    endpoint = endpoint or None
    if endpoint:
        check_endpoint(endpoint)
    transfers = getattr(config, "s3_max_concurrency", None)
    transfers = TRANSFERS if transfers is None else transfers
    if not isinstance(transfers, int) or isinstance(transfers, bool) or transfers < 1:
        raise ValueError(f"s3_max_concurrency must be a positive whole number, not {transfers!r}")
    grace = getattr(config, "blob_gc_grace", None)
    grace = GC_GRACE if grace is None else float(grace)
    if grace < 0:
        raise ValueError(f"blob_gc_grace must not be negative, not {grace!r}")
    client = make_client(
        endpoint,
        region=getattr(config, "s3_region", None),
        access_key_id=getattr(config, "s3_access_key_id", None),
        secret_access_key=getattr(config, "s3_secret_access_key", None),
        session_token=getattr(config, "s3_session_token", None),
        transfers=transfers,
    )
    return S3Storage(location, client, config.state_dir, transfers=transfers,
                     gc_grace=grace, endpoint=endpoint)


@hookimpl
def corral_storage_backends():
    """Offer the ``s3`` backend."""
    return {"s3": _build}
