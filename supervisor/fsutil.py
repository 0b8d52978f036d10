"""File-system steps that root takes inside directories a tenant controls.

Every step opens directories relative to a descriptor with ``O_NOFOLLOW``,
so a symlink a tenant plants is refused instead of followed.
"""

import os
import shutil
import stat

#: Open a directory, never through a symlink.
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def ensure_private_directory(parent: str, name: str, uid: int, gid: int, mode: int) -> str:
    """Make ``parent/name`` a directory owned by ``uid:gid`` without following symlinks.

    ``parent`` itself must be a path root trusts (the owner directory: created
    by root, its parents root's). An existing directory is kept, chowned if
    it is owned by anyone else (root, after a crash between mkdir and chown); anything else there (a
    symlink, a file) raises ``NotADirectoryError``.
    """
    parent_fd = os.open(parent, DIR_FLAGS)
    try:
        try:
            os.mkdir(name, mode, dir_fd=parent_fd)
        except FileExistsError:
            pass
        try:
            fd = os.open(name, DIR_FLAGS, dir_fd=parent_fd)
        except OSError as e:
            raise NotADirectoryError(
                f"{os.path.join(parent, name)} is not a directory"
            ) from e
        try:
            st = os.fstat(fd)
            if not stat.S_ISDIR(st.st_mode):
                raise NotADirectoryError(f"{os.path.join(parent, name)} is not a directory")
            if (st.st_uid, st.st_gid) != (uid, gid) and os.geteuid() == 0:
                os.fchown(fd, uid, gid)
        finally:
            os.close(fd)
    finally:
        os.close(parent_fd)
    return os.path.join(parent, name)


def make_directories(path: str, mode: int) -> None:
    """``mkdir -p`` whose created directories get exactly ``mode``, whatever the umask."""
    missing = []
    while not os.path.isdir(path):
        missing.append(path)
        path = os.path.dirname(path)
    for directory in reversed(missing):
        try:
            os.mkdir(directory)
        except FileExistsError:
            continue
        os.chmod(directory, mode)


def open_directory(parent: str, name: str) -> int:
    """Open ``parent/name`` as a directory descriptor, refusing a symlink at ``name``."""
    parent_fd = os.open(parent, DIR_FLAGS)
    try:
        return os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    finally:
        os.close(parent_fd)


def remove_entry(parent: str, name: str) -> bool:
    """Remove ``parent/name`` and everything below it without following any symlink.

    ``parent`` must be a path root trusts; below it every step goes through
    directory descriptors (``shutil.rmtree`` with ``dir_fd``), so a tenant's
    symlink is removed, never followed. Returns False when nothing was there.
    Blocking: run it in a thread.
    """
    parent_fd = os.open(parent, DIR_FLAGS)
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
