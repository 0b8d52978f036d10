"""Workspace manifests, and the root-side file-system work of hydrate and sync.

A manifest lists every entry of a conversation's workspace: regular files
(path, size, mode, mtime_ns, SHA-256 of the content), symlinks (their
target; never followed) and directories (so that empty ones survive). The
object-store backend (``plugins.storage_s3``) keeps one manifest per
conversation and the file contents as content-addressed blobs; this module
knows nothing of the store. It is given small callables that fetch or
upload one blob.

Everything here runs as root inside a directory the tenant controls, so
every step works relative to directory descriptors opened with
``O_NOFOLLOW | O_DIRECTORY``; no path is ever resolved from ``/``, and a
symlink the tenant plants is read as a link (``readlink``) or replaced, never
followed. As root, a regular file not owned by the owner's uid (a hard link
to someone else's file) is neither uploaded nor chowned.

All functions block; callers run them in a worker thread.
"""

import bisect
import errno
import hashlib
import json
import os
import re
import secrets
import shutil
import stat
import tempfile
import time
from concurrent.futures import FIRST_EXCEPTION, Executor, wait
from typing import Callable, Iterable, NamedTuple

from attrs import Factory, define, field, frozen

from supervisor.fsutil import DIR_FLAGS, make_directories

#: The ``format`` and ``version`` fields of every manifest this code writes.
FORMAT = "corral-manifest"
VERSION = 1
STATE_VERSION = 1

FILE, DIRECTORY, SYMLINK, OTHER = "file", "dir", "symlink", "other"

_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_TEMP_PREFIX = ".corral-tmp-"
_CHUNK = 1 << 20
_SHA256 = re.compile(r"[0-9a-f]{64}")
#: Spooled copies of files being uploaded stay in memory up to this size.
SPOOL_MEMORY = 1 << 20


class ManifestError(ValueError):
    """A manifest that is not one this code can apply safely."""


class BlobMismatch(Exception):
    """A blob's content does not hash to its name: the store returned wrong bytes."""


@frozen
class Entry:
    """One manifest entry: a regular file, a directory or a symlink."""

    path: str
    kind: str
    mode: int = 0
    size: int = 0
    sha256: str = ""
    mtime_ns: int = 0
    target: str = ""

    def to_json(self) -> dict:
        """The entry as it appears in ``manifest.json``."""
        if self.kind == FILE:
            return {"path": self.path, "type": FILE, "size": self.size, "mode": self.mode,
                    "mtime_ns": self.mtime_ns, "sha256": self.sha256}
        if self.kind == DIRECTORY:
            return {"path": self.path, "type": DIRECTORY, "mode": self.mode}
        return {"path": self.path, "type": SYMLINK, "target": self.target}


@frozen
class Manifest:
    """Every entry of one workspace, sorted by path."""

    entries: tuple = ()

    @classmethod
    def of(cls, entries: Iterable[Entry]) -> "Manifest":
        """A manifest of ``entries``, sorted."""
        return cls(tuple(sorted(entries, key=lambda e: e.path)))

    def by_path(self) -> dict:
        """``{path: Entry}``."""
        return {e.path: e for e in self.entries}

    def hashes(self) -> set:
        """The SHA-256 of every regular file."""
        return {e.sha256 for e in self.entries if e.kind == FILE}

    def to_json(self) -> dict:
        """The manifest as a JSON-ready mapping (without owner and conversation)."""
        return {"format": FORMAT, "version": VERSION,
                "entries": [e.to_json() for e in self.entries]}

    def to_bytes(self, owner: str, conversation: str) -> bytes:
        """The bytes of ``manifest.json``."""
        document = self.to_json()
        document["owner"] = owner
        document["conversation"] = conversation
        return json.dumps(document, sort_keys=True, separators=(",", ":")).encode("ascii")

    @classmethod
    def from_json(cls, document) -> "Manifest":
        """Parse and check a manifest; raise ManifestError on anything unsafe or unknown."""
        if not isinstance(document, dict) or document.get("format") != FORMAT:
            raise ManifestError("not a corral manifest (the format field is missing or wrong)")
        if document.get("version") != VERSION:
            raise ManifestError(
                f"manifest version {document.get('version')!r} is not supported; "
                f"this corral reads version {VERSION}"
            )
        raw = document.get("entries")
        if not isinstance(raw, list):
            raise ManifestError("the manifest's entries field is not a list")
        entries = {}
        for item in raw:
            entry = _entry_from_json(item)
            if entry.path in entries:
                raise ManifestError(f"the manifest lists {entry.path!r} twice")
            entries[entry.path] = entry
        for path in entries:
            parent = path.rpartition("/")[0]
            if parent and getattr(entries.get(parent), "kind", None) != DIRECTORY:
                raise ManifestError(f"the manifest lists {path!r} without its directory {parent!r}")
        return cls.of(entries.values())

    @classmethod
    def from_bytes(cls, data: bytes) -> "Manifest":
        """Parse ``manifest.json`` bytes."""
        try:
            document = json.loads(data)
        except ValueError as e:
            raise ManifestError(f"the manifest is not JSON: {e}") from None
        return cls.from_json(document)


def _int(item: dict, name: str, high: int) -> int:
    value = item.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= high:
        raise ManifestError(f"manifest entry {item.get('path')!r}: bad {name} {value!r}")
    return value


def _entry_from_json(item) -> Entry:
    if not isinstance(item, dict):
        raise ManifestError("a manifest entry is not an object")
    path = item.get("path")
    check_relative_path(path)
    kind = item.get("type")
    if kind == FILE:
        sha = item.get("sha256")
        if not isinstance(sha, str) or not _SHA256.fullmatch(sha):
            raise ManifestError(f"manifest entry {path!r}: bad sha256")
        return Entry(path, FILE, mode=_int(item, "mode", 0o7777) & 0o777,
                     size=_int(item, "size", 1 << 62), sha256=sha,
                     mtime_ns=_int(item, "mtime_ns", 1 << 63))
    if kind == DIRECTORY:
        return Entry(path, DIRECTORY, mode=_int(item, "mode", 0o7777) & 0o777)
    if kind == SYMLINK:
        target = item.get("target")
        if not isinstance(target, str) or not target or "\0" in target:
            raise ManifestError(f"manifest entry {path!r}: bad symlink target")
        return Entry(path, SYMLINK, target=target)
    raise ManifestError(f"manifest entry {path!r}: unknown type {kind!r}")


def check_relative_path(path) -> None:
    """Refuse a path that is not ``name/name/...`` (no ``..``, ``.``, empty part, NUL or leading /)."""
    if not isinstance(path, str) or not path or "\0" in path or path.startswith("/"):
        raise ManifestError(f"manifest path {path!r} is not a relative path")
    if any(part in ("", ".", "..") for part in path.split("/")):
        raise ManifestError(f"manifest path {path!r} has an empty, '.' or '..' part")


def run_all(executor: Executor, fn: Callable, items: Iterable) -> list:
    """``[fn(item) for item in items]`` on ``executor``, results in order.

    Unlike ``Executor.map``, nothing is still running when this returns or
    raises: on the first failure the calls not yet started are cancelled,
    the running ones are waited for, and the failure is raised. Callers
    close the directory descriptors the calls use right afterwards.
    """
    futures = [executor.submit(fn, item) for item in items]
    if not futures:
        return []
    _, pending = wait(futures, return_when=FIRST_EXCEPTION)
    if pending:
        for future in pending:
            future.cancel()
        wait(pending)
        for future in futures:
            if not future.cancelled() and future.exception() is not None:
                raise future.exception()
    return [future.result() for future in futures]


# --- the local side -------------------------------------------------------


class LocalEntry(NamedTuple):
    """What an ``lstat`` walk found at one path of the workspace."""

    path: str
    kind: str
    mode: int
    size: int
    mtime_ns: int
    ctime_ns: int
    ino: int
    uid: int
    target: str = ""


class Stamp(NamedTuple):
    """What a regular file looked like when its hash was last known."""

    size: int
    mtime_ns: int
    ctime_ns: int
    ino: int
    sha256: str

    def matches(self, local: LocalEntry) -> bool:
        """True when ``local`` is unchanged since (size and mtime, plus ctime and inode, which a tenant cannot set back)."""
        return (self.size == local.size and self.mtime_ns == local.mtime_ns
                and self.ctime_ns == local.ctime_ns and self.ino == local.ino)


def _stamp(st: os.stat_result, sha256: str) -> Stamp:
    return Stamp(st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, sha256)


@define
class SyncState:
    """This host's record of the last manifest it hydrated or committed for a conversation."""

    etag: str | None = None
    manifest: Manifest = Factory(Manifest)
    stamps: dict = Factory(dict)
    #: SHA-256 of the last manifest saved as a conflict copy (not saved twice).
    conflict_saved: str | None = None
    #: The last SyncPlan of the workspace, in memory only (never saved): the
    #: next plan decides again only what the walk finds changed since.
    plan: object = field(default=None, eq=False, repr=False)

    def to_bytes(self) -> bytes:
        """The state file's bytes."""
        return json.dumps({
            "version": STATE_VERSION,
            "etag": self.etag,
            "manifest": self.manifest.to_json(),
            "stamps": {p: [s.size, s.mtime_ns, s.ctime_ns, s.ino, s.sha256]
                       for p, s in self.stamps.items()},
            "conflict_saved": self.conflict_saved,
        }, sort_keys=True).encode("ascii")

    @classmethod
    def from_bytes(cls, data: bytes) -> "SyncState":
        """Parse a state file; a damaged or unknown one reads as no state."""
        try:
            document = json.loads(data)
            if document.get("version") != STATE_VERSION:
                return cls()
            return cls(
                etag=document["etag"],
                manifest=Manifest.from_json(document["manifest"]),
                stamps={p: Stamp(*s) for p, s in document["stamps"].items()},
                conflict_saved=document.get("conflict_saved"),
            )
        except (ValueError, KeyError, TypeError, AttributeError):
            return cls()


def load_state(path: str) -> SyncState | None:
    """Read the state file at ``path`` (root's own directory), or None when there is none."""
    try:
        with open(path, "rb") as f:
            return SyncState.from_bytes(f.read())
    except FileNotFoundError:
        return None


def save_state(path: str, state: SyncState) -> None:
    """Replace the state file at ``path`` atomically, mode 0600."""
    directory = os.path.dirname(path)
    make_directories(directory, 0o700)
    fd, temp = tempfile.mkstemp(dir=directory, prefix=".state-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(state.to_bytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        try:
            os.unlink(temp)
        except OSError:
            pass
        raise


def open_dir(root_fd: int, parts: Iterable[str]) -> int:
    """Open the directory ``parts`` below ``root_fd``, one component at a time, never following a symlink."""
    fd = os.dup(root_fd)
    try:
        for part in parts:
            next_fd = os.open(part, DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = next_fd
    except BaseException:
        os.close(fd)
        raise
    return fd


class _DirCache:
    """Open directory descriptors below a workspace, by relative path; single-threaded use."""

    def __init__(self, root_fd: int):
        self.root_fd = root_fd
        self.fds: dict = {}

    def get(self, directory: str) -> int:
        if not directory:
            return self.root_fd
        fd = self.fds.get(directory)
        if fd is None:
            if len(self.fds) >= 64:
                self.close()
            parent, _, name = directory.rpartition("/")
            fd = os.open(name, DIR_FLAGS, dir_fd=self.get(parent))
            self.fds[directory] = fd
        return fd

    def forget(self, directory: str) -> None:
        for key in [k for k in self.fds if k == directory or k.startswith(directory + "/")]:
            os.close(self.fds.pop(key))

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def _split(path: str) -> tuple[str, str]:
    parent, _, name = path.rpartition("/")
    return parent, name


_KINDS = {0o100000: FILE, 0o040000: DIRECTORY, 0o120000: SYMLINK}


def _push_child(stack: list, fd: int, name: str, path: str) -> None:
    try:
        child = os.open(name, DIR_FLAGS, dir_fd=fd)
    except OSError:
        return  # replaced by something else meanwhile
    stack.append((path + "/", child))


def scan_tree(root_fd: int, earlier: dict | None = None, changed: list | None = None) -> dict:
    """``{path: LocalEntry}`` for everything below ``root_fd``, by ``lstat``, never following a symlink.

    With ``earlier`` (a previous scan) and ``changed`` (a list), the paths
    whose entry differs from ``earlier`` are appended to ``changed`` during
    the walk; an equal entry is the earlier object itself.
    """
    found = {}
    compare = earlier is not None and changed is not None
    stack = [("", os.dup(root_fd))]
    while stack:
        prefix, fd = stack.pop()
        try:
            with os.scandir(fd) as entries:
                for item in entries:
                    path = prefix + item.name
                    try:
                        st = item.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    mode = st.st_mode
                    fmt = mode & 0o170000
                    kind = _KINDS.get(fmt, OTHER)
                    if compare:
                        # The inode's ctime changes with its content, mode, owner
                        # and links (a symlink's target never changes in place):
                        # an equal lstat means the earlier entry still holds.
                        prev = earlier.get(path)
                        if (prev is not None and prev[5] == st.st_ctime_ns
                                and prev[6] == st.st_ino and prev[4] == st.st_mtime_ns
                                and prev[3] == st.st_size and prev[1] is kind
                                and prev[2] == mode & 0o777 and prev[7] == st.st_uid):
                            found[path] = prev
                            if fmt == 0o040000:
                                _push_child(stack, fd, item.name, path)
                            continue
                    target = ""
                    if fmt == 0o120000:
                        try:
                            target = os.readlink(item.name, dir_fd=fd)
                        except OSError:
                            continue
                    found[path] = LocalEntry(path, kind, mode & 0o777, st.st_size,
                                             st.st_mtime_ns, st.st_ctime_ns, st.st_ino,
                                             st.st_uid, target)
                    if compare:
                        changed.append(path)
                    if kind == DIRECTORY:
                        _push_child(stack, fd, item.name, path)
        finally:
            os.close(fd)
    return found


def _open_regular(dir_fd: int, name: str, owner_uid: int | None) -> tuple[int, os.stat_result]:
    """Open a regular file for reading without following a symlink or blocking on a FIFO."""
    fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", name)
        if owner_uid is not None and st.st_uid != owner_uid:
            raise PermissionError(errno.EPERM, "not owned by the owner", name)
        return fd, st
    except BaseException:
        os.close(fd)
        raise


def _hash_fd(fd: int, sink=None) -> tuple[str, int]:
    digest = hashlib.sha256()
    size = 0
    while chunk := os.read(fd, _CHUNK):
        digest.update(chunk)
        size += len(chunk)
        if sink is not None:
            sink.write(chunk)
    return digest.hexdigest(), size


def owner_uid_to_enforce(uid: int) -> int | None:
    """The uid files must belong to before root reads or chowns them: ``uid`` as root, else None."""
    return uid if os.geteuid() == 0 else None


# --- sync -----------------------------------------------------------------


@define
class SyncPlan:
    """What changed in a workspace since the base manifest."""

    manifest: Manifest
    stamps: dict
    #: ``{path: LocalEntry}`` the walk found. The next plan decides again only
    #: paths whose ``lstat`` differs from this; a path whose outcome was not
    #: settled (it vanished, or changed while it was read or uploaded) is
    #: recorded with ``ctime_ns`` -1, which no ``lstat`` equals.
    scan: dict
    hashed: int = 0
    skipped: int = 0
    #: The uid files had to belong to (None when not root).
    enforce: int | None = None

    def changed(self, base: Manifest) -> bool:
        """True when this plan's manifest differs from ``base``."""
        return self.manifest != base


#: How recent a change must be to be "racy": coarse kernel timestamps move
#: once per clock tick (up to 10 ms), so a file changed in the same tick as
#: the walk could change again without its ctime moving.
RACY_NS = 50_000_000


def unsettled(local: LocalEntry) -> LocalEntry:
    """``local`` marked so that the next plan decides its path again."""
    return local._replace(ctime_ns=-1)


def _plan_one(path, local, before, stamp, enforce, dirs):
    """Decide one walked path: ``(entry or None, stamp or None, reusable local or None, hashed)``.

    ``before`` is the base manifest's entry at ``path``, reused when equal so
    that comparing manifests stays cheap; ``stamp`` is the last known stamp.
    The reusable local is None when the outcome must be decided again next
    time (the file vanished or changed while it was read).
    """
    kind = local.kind
    if kind == FILE:
        if enforce is not None and local.uid != enforce:
            return None, None, local, 0
        hashed = 0
        if stamp is None or not stamp.matches(local):
            parent, name = _split(path)
            try:
                fd, st = _open_regular(dirs.get(parent), name, enforce)
            except OSError:
                return None, None, None, 0  # gone, replaced or not the owner's meanwhile
            try:
                sha, size = _hash_fd(fd)
            finally:
                os.close(fd)
            hashed = 1
            stamp = _stamp(st, sha)
            local = LocalEntry(path, FILE, stat.S_IMODE(st.st_mode) & 0o777, size,
                               st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_uid)
            if size != st.st_size:
                stamp = Stamp(size, -1, -1, -1, sha)  # changed while read: rehash next time
        if (before is None or before.kind != FILE or before.sha256 != stamp.sha256
                or before.size != stamp.size or before.mode != local.mode
                or before.mtime_ns != local.mtime_ns):
            before = Entry(path, FILE, mode=local.mode, size=stamp.size,
                           sha256=stamp.sha256, mtime_ns=local.mtime_ns)
        return before, stamp, (None if stamp.mtime_ns == -1 else local), hashed
    if kind == DIRECTORY:
        if before is None or before.kind != DIRECTORY or before.mode != local.mode:
            before = Entry(path, DIRECTORY, mode=local.mode)
        return before, None, local, 0
    if kind == SYMLINK:
        if before is None or before.kind != SYMLINK or before.target != local.target:
            before = Entry(path, SYMLINK, target=local.target)
        return before, None, local, 0
    return None, None, local, 0


def plan_sync(root_fd: int, state: SyncState, uid: int,
              previous: SyncPlan | None = None) -> SyncPlan:
    """Walk the workspace and build its manifest, hashing only files whose stamp changed.

    As root, regular files not owned by ``uid``, and FIFOs, sockets and
    devices, are left out (counted in ``skipped``). An entry equal to the
    base manifest's is that very object, so comparing the two is cheap.

    With ``previous`` (the last plan of this workspace, kept in memory),
    only paths whose ``lstat`` differs from what that plan's walk found are
    decided again: change detection then costs little more than the walk.
    """
    enforce = owner_uid_to_enforce(uid)
    racy = time.time_ns() - RACY_NS
    if previous is not None and previous.enforce == enforce:
        changed: list = []
        scan = scan_tree(root_fd, previous.scan, changed)
        plan = _plan_incrementally(root_fd, scan, changed, state, enforce, previous, racy)
        if plan is not None:
            return plan
    else:
        scan = scan_tree(root_fd)
    base = state.manifest.by_path()
    entries, stamps, hashed = _decide(root_fd, scan, sorted(scan), base.get,
                                      state.stamps.get, enforce, racy)
    # Sorted by path already (the same order Manifest.of gives). A skipped
    # file never orphans an entry: every entry's parent is a directory entry
    # because the walk found it.
    return SyncPlan(Manifest(tuple(entries)), stamps, scan, hashed, len(scan) - len(entries),
                    enforce)


def _decide(root_fd, scan, paths, before_of, stamp_of, enforce, racy):
    """Decide ``paths`` (sorted): ``(entries, stamps, hashed)``; ``scan`` records the outcome.

    A file whose ctime is ``racy`` or later may change again within the same
    clock tick without its ctime moving (coarse timestamps): its outcome and
    stamp are not trusted next time, so it is hashed again then.
    """
    entries, stamps = [], {}
    hashed = 0
    dirs = _DirCache(root_fd)
    try:
        for path in paths:
            local = scan[path]
            entry, stamp, reusable, did_hash = _plan_one(
                path, local, before_of(path), stamp_of(path), enforce, dirs)
            hashed += did_hash
            if entry is not None:
                entries.append(entry)
            if stamp is not None:
                if stamp.ctime_ns >= racy:
                    stamp = stamp._replace(mtime_ns=-1)
                stamps[path] = stamp
            if reusable is None or reusable.ctime_ns >= racy:
                reusable = unsettled(local)
            scan[path] = reusable
    finally:
        dirs.close()
    return entries, stamps, hashed


def _plan_incrementally(root_fd, scan, changed, state, enforce, previous,
                        racy) -> SyncPlan | None:
    """``previous`` updated with the paths whose ``lstat`` changed; None when too many did.

    The entries stay a sorted list edited in place by bisection, so the cost
    beyond the walk is one comparison per path plus the changed paths' own.
    """
    before = previous.scan
    # Unchanged paths are in ``before``; when they and the changed ones that
    # were there too account for all of it, nothing is gone (no set difference).
    modified = sum(1 for path in changed if path in before)
    gone = (before.keys() - scan.keys()
            if len(scan) - len(changed) + modified != len(before) else ())
    if not changed and not gone:
        return SyncPlan(previous.manifest, dict(previous.stamps), scan, 0, previous.skipped,
                        enforce)
    if len(changed) + len(gone) > min(1000, len(scan) // 4):
        return None
    entries = list(previous.manifest.entries)
    stamps = dict(previous.stamps)
    base = state.manifest.entries

    def base_entry(path):
        i = bisect.bisect_left(base, path, key=_entry_path)
        return base[i] if i < len(base) and base[i].path == path else None

    def last_stamp(path):
        return stamps.get(path) or state.stamps.get(path)

    changed.sort()
    decided, new_stamps, hashed = _decide(root_fd, scan, changed, base_entry, last_stamp,
                                          enforce, racy)
    for path in (*gone, *changed):
        _remove_entry(entries, path)
        stamps.pop(path, None)
    for entry in decided:
        bisect.insort(entries, entry, key=_entry_path)
    stamps.update(new_stamps)
    return SyncPlan(Manifest(tuple(entries)), stamps, scan, hashed, len(scan) - len(entries),
                    enforce)


def _remove_entry(entries: list, path: str) -> None:
    i = bisect.bisect_left(entries, path, key=_entry_path)
    if i < len(entries) and entries[i].path == path:
        del entries[i]


def _entry_path(entry) -> str:
    return entry.path


@frozen
class Upload:
    """One blob that went up: its hash and size as read at upload time."""

    sha256: str
    size: int


def upload_missing(root_fd: int, plan: SyncPlan, known: set, uid: int,
                   blob_exists: Callable[[str], bool],
                   put_blob: Callable[[str, object, int], None],
                   executor: Executor, spool_dir: str) -> list:
    """Upload every blob the plan needs that the store lacks; return the Uploads.

    ``known`` holds hashes the store is known to have (the base manifest's),
    which are not even asked about. ``blob_exists(sha256)`` is True when the
    store has the blob and it may be relied on (the s3 backend answers
    False for a blob old enough that garbage collection could be about to
    delete it, so it is uploaded again, which makes it young). Each file is copied into a root-private
    spool while it is hashed, and the spool is uploaded, so the bytes stored
    under a hash are always the bytes that hash to it even if the tenant
    rewrites the file meanwhile; when that happens the plan's entry is
    updated to what was actually uploaded.
    """
    enforce = owner_uid_to_enforce(uid)
    paths_of = {}
    for entry in plan.manifest.entries:
        if entry.kind == FILE and entry.sha256 not in known:
            paths_of.setdefault(entry.sha256, []).append(entry.path)
    candidates = list(paths_of.items())
    present = run_all(executor, lambda item: blob_exists(item[0]), candidates)
    missing = [item for item, there in zip(candidates, present) if not there]

    def open_path(path):
        """``path`` opened if it still is a regular file of the owner's, else None."""
        parent, name = _split(path)
        try:
            dir_fd = open_dir(root_fd, parent.split("/") if parent else ())
            try:
                fd, _ = _open_regular(dir_fd, name, enforce)
            finally:
                os.close(dir_fd)
        except OSError:
            return None  # renamed, removed or replaced since the walk
        return fd

    def upload(item):
        """Upload the blob ``expected`` from the first of its paths that still holds it.

        Paths whose bytes changed meanwhile get their own blob (``replaced``);
        paths that went are ``gone``. A committed manifest never names a blob
        that was not stored.
        """
        expected, paths = item
        done, replaced_here, gone = [], {}, []
        for path in paths:
            fd = open_path(path)
            if fd is None:
                gone.append(path)
                continue
            with tempfile.SpooledTemporaryFile(SPOOL_MEMORY, dir=spool_dir) as spool:
                try:
                    sha, size = _hash_fd(fd, spool)
                finally:
                    os.close(fd)
                spool.seek(0)
                if sha == expected or not blob_exists(sha):
                    put_blob(sha, spool, size)
            done.append(Upload(sha, size))
            if sha == expected:
                return done, replaced_here, gone  # the remaining paths keep this blob
            replaced_here[path] = done[-1]
        return done, replaced_here, gone

    uploads = []
    replaced = {}
    vanished = set()
    for done, replaced_here, gone in run_all(executor, upload, missing):
        # Files that went while the sync ran are left out of this manifest; the
        # next sync decides those paths again.
        uploads += done
        replaced.update(replaced_here)
        vanished.update(gone)
    if vanished:
        plan.manifest = Manifest(tuple(e for e in plan.manifest.entries
                                       if e.path not in vanished))
        for path in vanished:
            plan.stamps.pop(path, None)
            if path in plan.scan:
                plan.scan[path] = unsettled(plan.scan[path])
    if replaced:
        entries = [
            Entry(e.path, FILE, mode=e.mode, size=replaced[e.path].size,
                  sha256=replaced[e.path].sha256, mtime_ns=e.mtime_ns)
            if e.path in replaced else e
            for e in plan.manifest.entries
        ]
        plan.manifest = Manifest(tuple(entries))
        for path, done in replaced.items():
            plan.stamps[path] = Stamp(done.size, -1, -1, -1, done.sha256)
            if path in plan.scan:
                plan.scan[path] = unsettled(plan.scan[path])  # decide it again next time
    return uploads


# --- hydrate --------------------------------------------------------------


@define
class HydrateResult:
    """What a hydrate did: the stamps of every file, and counts for the audit."""

    stamps: dict
    downloaded: int = 0
    bytes_downloaded: int = 0
    removed: int = 0
    hashed: int = 0


def _remove(dir_fd: int, name: str) -> None:
    """Remove ``name`` (a whole tree if it is a directory) without following symlinks."""
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    except (IsADirectoryError, PermissionError) as e:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode):
            raise e
        shutil.rmtree(name, dir_fd=dir_fd)


def _fix_owner_mode(fd: int, st: os.stat_result, uid: int, gid: int, mode: int | None) -> None:
    if os.geteuid() == 0 and (st.st_uid, st.st_gid) != (uid, gid):
        os.fchown(fd, uid, gid)
    if mode is not None and stat.S_IMODE(st.st_mode) != mode:
        os.fchmod(fd, mode)


def hydrate(root_fd: int, manifest: Manifest, stamps: dict, uid: int, gid: int,
            fetch_blob: Callable[[str, object], None], executor: Executor,
            scan: dict | None = None) -> HydrateResult:
    """Make the workspace at ``root_fd`` match ``manifest``.

    Downloads only files that are missing or differ (a stamp from the last
    hydrate or sync saves hashing an unchanged file), writes each into a
    temporary file in its directory and renames it into place, sets modes,
    mtimes and ownership, creates directories and symlinks, and removes
    everything the manifest does not list. ``fetch_blob(sha256, fileobj)``
    writes one blob's bytes. ``scan`` is a fresh ``scan_tree`` of the
    workspace, when the caller has one.
    """
    enforce = owner_uid_to_enforce(uid)
    local = scan_tree(root_fd) if scan is None else scan
    wanted = manifest.by_path()
    result = HydrateResult(stamps={})
    dirs = _DirCache(root_fd)
    downloads = []
    try:
        # Extras first, children before parents (a path sorts after its prefix).
        for path in sorted((p for p in local if p not in wanted), reverse=True):
            parent, name = _split(path)
            try:
                _remove(dirs.get(parent), name)
            except FileNotFoundError:
                pass
            dirs.forget(path)
            result.removed += 1
        for entry in manifest.entries:
            have = local.get(entry.path)
            parent, name = _split(entry.path)
            parent_fd = dirs.get(parent)
            if have is not None and have.kind != entry.kind:
                _remove(parent_fd, name)
                dirs.forget(entry.path)
                have = None
            if entry.kind == DIRECTORY:
                if have is None:
                    os.mkdir(name, 0o700, dir_fd=parent_fd)
                fd = dirs.get(entry.path)
                _fix_owner_mode(fd, os.fstat(fd), uid, gid, entry.mode)
            elif entry.kind == SYMLINK:
                if have is None or have.target != entry.target:
                    temp = _TEMP_PREFIX + secrets.token_hex(8)
                    os.symlink(entry.target, temp, dir_fd=parent_fd)
                    os.rename(temp, name, src_dir_fd=parent_fd, dst_dir_fd=parent_fd)
                    have = None
                if os.geteuid() == 0 and (have is None or have.uid != uid):
                    os.chown(name, uid, gid, dir_fd=parent_fd, follow_symlinks=False)
            elif not _keep_file(parent_fd, name, entry, have, stamps, enforce, uid, gid, result):
                downloads.append(entry)
    finally:
        dirs.close()

    def download(entry: Entry):
        parent, name = _split(entry.path)
        dir_fd = open_dir(root_fd, parent.split("/") if parent else ())
        try:
            return entry.path, _download(dir_fd, name, entry, uid, gid, fetch_blob)
        finally:
            os.close(dir_fd)

    for path, stamp in run_all(executor, download, downloads):
        result.stamps[path] = stamp
        result.downloaded += 1
        result.bytes_downloaded += stamp.size
    return result


def _keep_file(parent_fd, name, entry, have, stamps, enforce, uid, gid, result) -> bool:
    """True (and the file's owner, mode and mtime fixed) when the local file has the entry's content."""
    if have is None or have.size != entry.size:
        return False
    if enforce is not None and have.uid != enforce:
        return False  # someone else's file (a hard link): replace it, never chown it
    try:
        fd, st = _open_regular(parent_fd, name, enforce)
    except OSError:
        return False
    try:
        stamp = stamps.get(entry.path)
        if stamp is None or stamp.sha256 != entry.sha256 or not stamp.matches(have) \
                or st.st_ino != have.ino:
            sha, _ = _hash_fd(fd)
            result.hashed += 1
            if sha != entry.sha256:
                return False
        _fix_owner_mode(fd, st, uid, gid, entry.mode)
        if st.st_mtime_ns != entry.mtime_ns:
            os.utime(fd, ns=(entry.mtime_ns, entry.mtime_ns))
        result.stamps[entry.path] = _stamp(os.fstat(fd), entry.sha256)
        return True
    finally:
        os.close(fd)


class _HashingWriter:
    """A file-like sink that writes to a descriptor and hashes what passes."""

    def __init__(self, fd: int):
        self.fd = fd
        self.digest = hashlib.sha256()
        self.size = 0

    def write(self, data) -> int:
        view = memoryview(data)
        self.digest.update(view)
        self.size += len(view)
        while view:
            written = os.write(self.fd, view)
            view = view[written:]
        return len(data)


def _download(dir_fd: int, name: str, entry: Entry, uid: int, gid: int, fetch_blob) -> Stamp:
    temp = _TEMP_PREFIX + secrets.token_hex(8)
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600, dir_fd=dir_fd)
    try:
        try:
            writer = _HashingWriter(fd)
            fetch_blob(entry.sha256, writer)
            if writer.digest.hexdigest() != entry.sha256 or writer.size != entry.size:
                raise BlobMismatch(
                    f"blob {entry.sha256} for {entry.path!r} came back with different "
                    "content; the object store's copy is damaged"
                )
            if os.geteuid() == 0:
                os.fchown(fd, uid, gid)
            os.fchmod(fd, entry.mode)
            os.utime(fd, ns=(entry.mtime_ns, entry.mtime_ns))
            ino = os.fstat(fd).st_ino
        finally:
            os.close(fd)
        os.rename(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(temp, dir_fd=dir_fd)
        except OSError:
            pass
        raise
    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    if st.st_ino != ino:
        return Stamp(entry.size, -1, -1, -1, entry.sha256)  # replaced meanwhile: rehash next time
    return _stamp(st, entry.sha256)
