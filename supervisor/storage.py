"""What every storage backend shares: the prepared-workspace record and safe removal."""

import os
import shutil
import stat

from attrs import frozen

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

#: The ``code`` of an error that means the durable copy could not be reached.
STORAGE_UNAVAILABLE = "storage_unavailable"


@frozen
class Prepared:
    """A workspace ready for a runner, and what preparing it did (attrs stats or None)."""

    path: str
    stats: object = None


def remove_entry(parent: str, name: str) -> bool:
    """Remove ``parent/name`` and everything below it without following any symlink.

    ``parent`` must be a path root trusts; below it every step goes through
    directory descriptors (``shutil.rmtree`` with ``dir_fd``), so a tenant's
    symlink is removed, never followed. Returns False when nothing was there.
    Blocking: run it in a thread.
    """
    parent_fd = os.open(parent, _DIR_FLAGS)
    try:
        try:
            st = os.lstat(name, dir_fd=parent_fd)
        except FileNotFoundError:
            return False
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(name, dir_fd=parent_fd)
        else:
            os.unlink(name, dir_fd=parent_fd)
        return True
    finally:
        os.close(parent_fd)


class StorageUnavailable(Exception):
    """The durable copy could not be reached (the store is down, slow or refusing).

    The local copy is intact and the supervisor retries. ``code`` is stable
    for audit events and checkpoint answers.
    """

    code = STORAGE_UNAVAILABLE
