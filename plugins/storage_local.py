"""Storage backend ``local``: the workspace root on this host is the durable copy."""

import ctypes
import ctypes.util
import os

from twisted.internet.defer import succeed
from twisted.internet.threads import deferToThread
from zope.interface import implementer

from supervisor.fsutil import ensure_private_directory, open_directory
from supervisor.hookspecs import hookimpl
from supervisor.interfaces import IStorageBackend
from supervisor.storage import Prepared

_libc = None


def flush_file_system(parent: str, name: str) -> None:
    """``syncfs`` the file system holding ``parent/name``: its writes reach the disk.

    Blocking. Opens the directory without following a symlink; falls back to
    ``sync()`` where ``syncfs`` is missing.
    """
    global _libc
    fd = open_directory(parent, name)
    try:
        if _libc is None:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        syncfs = getattr(_libc, "syncfs", None)
        if syncfs is None or syncfs(fd) != 0:
            os.sync()
    finally:
        os.close(fd)


@implementer(IStorageBackend)
class LocalStorage:
    """Conversations are directories ``<root>/<owner>/<conversation>/``, mode 0700.

    The directory is the durable copy: nothing is synced elsewhere, a
    checkpoint flushes the file system to disk, and an idle directory is
    never evicted (deleting it is deleting the conversation).
    """

    name = "local"
    background_sync = False

    def prepare_workspace(self, identity, conversation):
        """Create the conversation directory, owned by the owner's uid, off the reactor."""
        return deferToThread(
            ensure_private_directory,
            identity.directory,
            conversation,
            identity.uid,
            identity.gid,
            0o700,
        ).addCallback(Prepared)

    def sync_workspace(self, identity, conversation, path):
        """Flush the file system to disk, so a checkpoint survives a power loss."""
        return deferToThread(flush_file_system, identity.directory, conversation).addCallback(
            lambda _: None)

    def release_workspace(self, identity, conversation, path):
        """Nothing to do: the files already are where they are kept."""
        return succeed(None)

    def evict_workspace(self, identity, conversation):
        """Never: the local directory is the only copy."""
        return succeed(False)

    def delete_conversation(self, owner, conversation):
        """Nothing is kept elsewhere; the supervisor removes the directory."""
        return succeed(None)

    def delete_owner(self, owner):
        """Nothing is kept elsewhere; the supervisor removes the directory."""
        return succeed(None)

    def mark_used(self, owner, conversation):
        """Nothing to record elsewhere: the supervisor keeps this host's record."""
        return succeed(None)

    def known_conversations(self):
        """None kept elsewhere: every conversation is a directory the supervisor sees."""
        return succeed([])

    def collect_garbage(self, grace):
        """Nothing to collect."""
        return succeed(None)


def _build(argument, config):
    if argument:
        raise ValueError("the local backend takes no argument")
    return LocalStorage()


@hookimpl
def corral_storage_backends():
    """Offer the ``local`` backend."""
    return {"local": _build}
