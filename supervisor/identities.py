"""Owner identities: which uid runs an owner's conversations.

The only record of an owner's uid is the ownership of ``<root>/<owner>/``
(DESIGN.md, "Owner identities"). The rules:

* an owner whose directory exists keeps that directory's uid;
* a new owner gets a stable hash of its name into the uid range, or the next
  unused uid after it (probing, wrapping around);
* entries under the root that are not owner directories (not a directory,
  a symlink, a name that is not an owner name, a uid outside the range) are
  ignored when looking for used uids and never adopted;
* an owner whose directory's uid is also another owner directory's uid is
  refused with ``uid_conflict``.

All of this runs in a worker thread, serialised by a lock within the
process and ``flock`` on ``<root>/.corral-identities.lock`` across
processes, so two first hellos for colliding names get distinct uids.
"""

import errno
import fcntl
import hashlib
import os
import secrets
import stat
import threading

from attrs import frozen

from supervisor.errors import LIMIT, UID_CONFLICT, UNAVAILABLE, CorralError
from supervisor.hello import NAME_PATTERN

LOCK_NAME = ".corral-identities.lock"
_TEMP_PREFIX = ".new-"


@frozen
class OwnerIdentity:
    """An owner, the uid and gid its processes run as, and its directory."""

    owner: str
    uid: int
    gid: int
    directory: str


def hashed_uid(owner: str, uid_range: tuple[int, int]) -> int:
    """The first-choice uid of ``owner``: a stable hash of its name into the range."""
    low, high = uid_range
    digest = hashlib.sha256(owner.encode("ascii")).digest()
    return low + int.from_bytes(digest[:8], "big") % (high - low + 1)


def scan_owner_uids(root_fd: int, uid_range: tuple[int, int]) -> dict[str, int]:
    """Map every owner directory directly under the root to its uid.

    Only real directories (never symlinks) with an owner-shaped name and a
    uid inside the range count.
    """
    low, high = uid_range
    owners = {}
    with os.scandir(root_fd) as entries:
        for entry in entries:
            if NAME_PATTERN.fullmatch(entry.name) is None:
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISDIR(st.st_mode) and low <= st.st_uid <= high:
                owners[entry.name] = st.st_uid
    return owners


def choose_uid(owner: str, used: set[int], uid_range: tuple[int, int]) -> int:
    """The hashed uid of ``owner``, or the next one not in ``used`` (wrapping)."""
    low, high = uid_range
    size = high - low + 1
    first = hashed_uid(owner, uid_range)
    for step in range(size):
        candidate = low + (first - low + step) % size
        if candidate not in used:
            return candidate
    raise CorralError(
        LIMIT,
        f"every uid in the range {low}-{high} is taken; widen uid_range or "
        "delete unused owners",
    )


class IdentityStore:
    """Resolves owners to identities under one workspace root.

    With ``privileged`` false (the supervisor is not root) every owner runs
    as the supervisor's own uid and directories are simply created.
    """

    def __init__(self, root: str, uid_range: tuple[int, int], privileged: bool):
        self.root = root
        self.uid_range = uid_range
        self.privileged = privileged
        self._lock = threading.Lock()

    def resolve(self, owner: str) -> OwnerIdentity:
        """Return ``owner``'s identity, creating its directory if needed. Blocking."""
        with self._lock:
            root_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
            try:
                lock_fd = os.open(
                    LOCK_NAME,
                    os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                    0o600,
                    dir_fd=root_fd,
                )
                try:
                    fcntl.flock(lock_fd, fcntl.LOCK_EX)
                    if self.privileged:
                        return self._resolve_privileged(root_fd, owner)
                    return self._resolve_unprivileged(root_fd, owner)
                finally:
                    os.close(lock_fd)
            finally:
                os.close(root_fd)

    def _directory(self, owner: str) -> str:
        return os.path.join(self.root, owner)

    def _resolve_unprivileged(self, root_fd: int, owner: str) -> OwnerIdentity:
        uid, gid = os.getuid(), os.getgid()
        try:
            os.mkdir(owner, 0o700, dir_fd=root_fd)
        except FileExistsError:
            st = os.stat(owner, dir_fd=root_fd, follow_symlinks=False)
            if not stat.S_ISDIR(st.st_mode):
                raise _not_an_owner_directory(self._directory(owner), st) from None
        return OwnerIdentity(owner, uid, gid, self._directory(owner))

    def _resolve_privileged(self, root_fd: int, owner: str) -> OwnerIdentity:
        owners = scan_owner_uids(root_fd, self.uid_range)
        uid = owners.get(owner)
        if uid is not None:
            sharing = sorted(o for o, u in owners.items() if u == uid and o != owner)
            if sharing:
                raise CorralError(
                    UID_CONFLICT,
                    f"owner {owner!r} has uid {uid}, which owner directory "
                    f"{sharing[0]!r} also has; an operator must give one of "
                    f"{self._directory(owner)} and {self._directory(sharing[0])} "
                    "another uid (chown -R) before either can be used",
                )
            return OwnerIdentity(owner, uid, uid, self._directory(owner))
        try:
            st = os.stat(owner, dir_fd=root_fd, follow_symlinks=False)
        except FileNotFoundError:
            pass
        else:
            raise _not_an_owner_directory(self._directory(owner), st)
        uid = choose_uid(owner, set(owners.values()), self.uid_range)
        self._create_owner_directory(root_fd, owner, uid)
        return OwnerIdentity(owner, uid, uid, self._directory(owner))

    def _create_owner_directory(self, root_fd: int, owner: str, uid: int) -> None:
        """Create ``<root>/<owner>`` owned by ``uid``, mode 0700, all at once.

        The directory is made and chowned under a temporary name, then renamed
        into place, so a crash never leaves a root-owned owner directory.
        """
        temp = f"{_TEMP_PREFIX}{owner}-{secrets.token_hex(4)}"
        os.mkdir(temp, 0o700, dir_fd=root_fd)
        try:
            fd = os.open(
                temp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=root_fd
            )
            try:
                os.fchown(fd, uid, uid)
                os.fchmod(fd, 0o700)
            finally:
                os.close(fd)
            os.rename(temp, owner, src_dir_fd=root_fd, dst_dir_fd=root_fd)
        except BaseException:
            try:
                os.rmdir(temp, dir_fd=root_fd)
            except OSError:
                pass
            raise

    def remove_leftovers(self) -> list[str]:
        """Remove temporary owner directories a crash left behind; return their names."""
        removed = []
        root_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for name in os.listdir(root_fd):
                if name.startswith(_TEMP_PREFIX):
                    try:
                        os.rmdir(name, dir_fd=root_fd)
                        removed.append(name)
                    except OSError as e:
                        if e.errno not in (errno.ENOENT, errno.ENOTEMPTY):
                            raise
        finally:
            os.close(root_fd)
        return removed


def _not_an_owner_directory(path: str, st: os.stat_result) -> CorralError:
    kind = "a symlink" if stat.S_ISLNK(st.st_mode) else (
        "a directory" if stat.S_ISDIR(st.st_mode) else "a file")
    return CorralError(
        UNAVAILABLE,
        f"{path} exists but is not an owner directory ({kind} owned by uid "
        f"{st.st_uid}, outside the owner uid range); an operator must move it "
        "away before this owner can be used",
    )
