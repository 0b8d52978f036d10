"""File-system steps that root takes inside directories a tenant controls.

Every step opens directories relative to a descriptor with ``O_NOFOLLOW``,
so a symlink a tenant plants is refused instead of followed.
"""

import os
import stat

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def ensure_private_directory(parent: str, name: str, uid: int, gid: int, mode: int) -> str:
    """Make ``parent/name`` a directory owned by ``uid:gid`` without following symlinks.

    ``parent`` itself must be a path root trusts (the owner directory: created
    by root, its parents root's). An existing directory is kept, chowned if
    it is owned by anyone else (root, after a crash between mkdir and chown); anything else there (a
    symlink, a file) raises ``NotADirectoryError``.
    """
    parent_fd = os.open(parent, _DIR_FLAGS)
    try:
        try:
            os.mkdir(name, mode, dir_fd=parent_fd)
        except FileExistsError:
            pass
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
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
