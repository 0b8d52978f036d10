"""Storage backend ``s3``: an S3-compatible object store holds the durable copy.

``CORRAL_STORAGE=s3:s3://BUCKET/PREFIX``. The local conversation directory is
a cache: hydrated from the conversation's manifest before the runner starts,
synced back when the last runner exits. Layout, per owner (owners share
nothing)::

    PREFIX/<owner>/blobs/<sha256>                              file contents
    PREFIX/<owner>/conversations/<conversation>/manifest.json  every entry
    PREFIX/<owner>/conversations/<conversation>/conflicts/...  losing commits

A manifest is committed with a conditional write (``If-Match`` the ETag this
host last saw, ``If-None-Match: *`` for a new one), so two hosts committing
one conversation never silently overwrite each other: the loser gets
``SyncConflict`` and its version is kept as a conflict copy.

Endpoint: ``CORRAL_S3_ENDPOINT_URL`` (MinIO, Ceph RGW, R2, ...), else AWS.
Credentials and region come from boto3's default chain (``AWS_*`` variables,
``~/.aws``, instance roles); they are never logged nor audited. boto3 is
imported only when the backend is built, so corral runs without it when
``s3`` is not configured. See ``docs/storage.md``.
"""

import hashlib
import os
import re
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
from supervisor.fsutil import ensure_private_directory
from supervisor.hookspecs import hookimpl
from supervisor.interfaces import IStorageBackend

ENDPOINT_VARIABLE = "CORRAL_S3_ENDPOINT_URL"
#: Blob transfers in flight at once, across all conversations of a supervisor.
TRANSFERS = 8
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_PREFIX_PART = re.compile(r"[A-Za-z0-9._=+@,-]+")
_CONFLICT_CODES = {"PreconditionFailed", "ConditionalRequestConflict", "412", "409"}


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
        raise ValueError(f"{ENDPOINT_VARIABLE}={url!r} is not an http:// or https:// URL")
    if parts.username or parts.password:
        raise ValueError(
            f"{ENDPOINT_VARIABLE} must not carry credentials; set AWS_ACCESS_KEY_ID "
            "and AWS_SECRET_ACCESS_KEY instead"
        )
    return url


def _error_code(error) -> str:
    response = getattr(error, "response", None) or {}
    code = str(response.get("Error", {}).get("Code", ""))
    status = str(response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
    return code or status


def _status(error) -> int:
    response = getattr(error, "response", None) or {}
    return int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)


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


@implementer(IStorageBackend)
class S3Storage:
    """Workspaces whose durable copy is a manifest and blobs in an S3 bucket."""

    name = "s3"
    log = Logger()

    def __init__(self, location: S3Location, client, state_dir: str, transfers: int = TRANSFERS):
        self.location = location
        #: A boto3 S3 client (thread-safe); tests hook its events to count requests.
        self.client = client
        self.state_root = os.path.join(state_dir, "s3-state")
        self._transfers = ThreadPoolExecutor(transfers, thread_name_prefix="corral-s3")
        self._locks: dict = {}
        self._locks_guard = threading.Lock()

    # --- IStorageBackend --------------------------------------------------

    def prepare_workspace(self, identity, conversation):
        """Create and hydrate the conversation directory in a worker thread; fires with its path."""
        return deferToThread(self.hydrate_blocking, identity, conversation).addCallback(
            lambda result: result[0])

    def release_workspace(self, identity, conversation, path):
        """Sync the workspace back in a worker thread; fires with SyncStats, or fails with SyncConflict."""
        return deferToThread(self.sync_blocking, identity, conversation)

    def close(self) -> None:
        """Stop the transfer threads once running transfers end."""
        self._transfers.shutdown(wait=True)

    # --- the blocking work ------------------------------------------------

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
        with self._lock(identity.owner, conversation):
            root_fd = mf.open_workspace(identity.directory, conversation)
            try:
                state = self._load_state(identity.owner, conversation)
                plan, committed = self._commit_local(root_fd, identity, conversation, state,
                                                     conflict_ok=True)
                remote, etag = self._get_manifest(identity.owner, conversation, state.etag)
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
                state.stamps = result.stamps
                self._save_state(identity.owner, conversation, state)
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
        """Upload what changed and commit the new manifest; raise SyncConflict when another host won."""
        started = time.monotonic()
        with self._lock(identity.owner, conversation):
            root_fd = mf.open_workspace(identity.directory, conversation)
            try:
                state = self._load_state(identity.owner, conversation)
                plan, committed, uploads = self._commit_local(
                    root_fd, identity, conversation, state, conflict_ok=False, want_uploads=True)
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

    def _commit_local(self, root_fd, identity, conversation, state, conflict_ok,
                      want_uploads=False):
        """Commit the workspace when it differs from the state's manifest.

        Returns ``(plan, committed)`` (plus the uploads when asked). On a
        conflict the state is saved with the conflict noted; then
        SyncConflict is raised unless ``conflict_ok``.
        """
        plan = mf.plan_sync(root_fd, state, identity.uid)
        uploads = []
        committed = False
        if plan.changed(state.manifest) or (state.etag is None and plan.manifest.entries):
            uploads = mf.upload_missing(
                root_fd, plan, state.manifest.hashes(), identity.uid,
                lambda sha: self._blob_exists(identity.owner, sha),
                lambda sha, body, size: self._put_blob(identity.owner, sha, body),
                self._transfers, self._spool_dir(),
            )
            body = plan.manifest.to_bytes(identity.owner, conversation)
            etag = self._put_manifest(identity.owner, conversation, body, state.etag)
            if etag is None:
                digest = hashlib.sha256(body).hexdigest()
                kept = None
                if state.conflict_saved != digest:
                    kept = self._save_conflict(identity.owner, conversation, body)
                    state.conflict_saved = digest
                    self._save_state(identity.owner, conversation, state)
                conflict = SyncConflict(identity.owner, conversation, kept)
                self.log.warn("{message}", message=str(conflict))
                if not conflict_ok:
                    raise conflict
            else:
                committed = True
                state.etag, state.manifest = etag, plan.manifest
                state.stamps, state.conflict_saved = plan.stamps, None
                self._save_state(identity.owner, conversation, state)
        else:
            state.stamps = plan.stamps
        if want_uploads:
            return plan, committed, uploads
        return plan, committed

    # --- the store --------------------------------------------------------

    def _manifest_key(self, owner: str, conversation: str) -> str:
        return self.location.key(owner, "conversations", conversation, "manifest.json")

    def _blob_key(self, owner: str, sha256: str) -> str:
        return self.location.key(owner, "blobs", sha256)

    def _get_manifest(self, owner: str, conversation: str, known_etag: str | None):
        """``(Manifest, etag)``; ``(None, etag)`` when unchanged since ``known_etag``; ``(None, None)`` when absent."""
        from botocore.exceptions import ClientError

        arguments = {"Bucket": self.location.bucket, "Key": self._manifest_key(owner, conversation)}
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

    def _blob_exists(self, owner: str, sha256: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            self.client.head_object(Bucket=self.location.bucket, Key=self._blob_key(owner, sha256))
        except ClientError as e:
            if _status(e) == 404 or _error_code(e) in ("404", "NoSuchKey", "NotFound"):
                return False
            raise
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
        return mf.load_state(self._state_path(owner, conversation)) or mf.SyncState()

    def _save_state(self, owner: str, conversation: str, state: mf.SyncState) -> None:
        os.makedirs(self.state_root, mode=0o700, exist_ok=True)
        mf.save_state(self._state_path(owner, conversation), state)

    def _spool_dir(self) -> str:
        path = os.path.join(self.state_root, "spool")
        os.makedirs(path, mode=0o700, exist_ok=True)
        return path


def make_client(endpoint_url: str | None):
    """A boto3 S3 client for ``endpoint_url`` (None: AWS), credentials from boto3's default chain."""
    try:
        import boto3
        from botocore.config import Config
    except ImportError:
        raise ValueError(
            "the s3 backend needs boto3, which is not installed; install corral[s3]"
        ) from None
    options = {"max_pool_connections": 2 * TRANSFERS + 4,
               "retries": {"max_attempts": 4, "mode": "standard"},
               "connect_timeout": 10, "read_timeout": 60}
    if endpoint_url:
        options["s3"] = {"addressing_style": "path"}
    return boto3.session.Session().client("s3", endpoint_url=endpoint_url, config=Config(**options))


def _build(argument, config):
    location = parse_location(argument)
    endpoint = os.environ.get(ENDPOINT_VARIABLE) or None
    if endpoint:
        check_endpoint(endpoint)
    return S3Storage(location, make_client(endpoint), config.state_dir)


@hookimpl
def corral_storage_backends():
    """Offer the ``s3`` backend."""
    return {"s3": _build}
