"""Storage backend ``local``: the workspace root on this host is the durable copy."""

from twisted.internet.threads import deferToThread
from zope.interface import implementer

from supervisor.fsutil import ensure_private_directory
from supervisor.hookspecs import hookimpl
from supervisor.interfaces import IStorageBackend


@implementer(IStorageBackend)
class LocalStorage:
    """Conversations are directories ``<root>/<owner>/<conversation>/``, mode 0700."""

    name = "local"

    def prepare_workspace(self, identity, conversation):
        """Create the conversation directory, owned by the owner's uid, off the reactor."""
        return deferToThread(
            ensure_private_directory,
            identity.directory,
            conversation,
            identity.uid,
            identity.gid,
            0o700,
        )

    def release_workspace(self, identity, conversation, path):
        """Nothing to do: the files already are where they are kept."""
        from twisted.internet.defer import succeed

        return succeed(None)


def _build(argument, config):
    if argument:
        raise ValueError("the local backend takes no argument")
    return LocalStorage()


@hookimpl
def corral_storage_backends():
    """Offer the ``local`` backend."""
    return {"local": _build}
