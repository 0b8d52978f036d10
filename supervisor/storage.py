"""What every storage backend shares: the prepared-workspace record and the outage error."""

from attrs import frozen

#: The ``code`` of an error that means the durable copy could not be reached.
STORAGE_UNAVAILABLE = "storage_unavailable"


@frozen
class Prepared:
    """A workspace ready for a runner, and what preparing it did (attrs stats or None)."""

    path: str
    stats: object = None


class StorageUnavailable(Exception):
    """The durable copy could not be reached (the store is down, slow or refusing).

    The local copy is intact and the supervisor retries. ``code`` is stable
    for audit events and checkpoint answers.
    """

    code = STORAGE_UNAVAILABLE
