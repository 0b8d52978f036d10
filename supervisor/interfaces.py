"""What a plugin must provide: one zope Interface per extension point.

pluggy finds plugins (``supervisor.hookspecs``); these interfaces say what the
objects they build can do. ``supervisor.plugins`` checks every object with
``verifyObject`` when it is loaded.
"""

from zope.interface import Attribute, Interface


class IStorageBackend(Interface):
    """Where a workspace's bytes live, and the lifecycle of their local copy.

    Every method returns a Deferred and does its blocking work off the
    reactor thread. ``identity`` is a ``supervisor.identities.OwnerIdentity``
    whose owner directory exists. None of these methods may follow a symlink
    the tenant controls. The supervisor (``supervisor.workspaces``) calls
    them one at a time per conversation, except ``sync_workspace`` while
    runners are attached and ``mark_used``, which runs in the background.
    """

    name = Attribute("The backend's configuration name, such as 'local'.")
    background_sync = Attribute(
        "True when the local directory is a cache whose changes must be copied "
        "elsewhere to be durable (s3): the supervisor then syncs within "
        "sync_delay of a tool call that may have changed files, retries failed "
        "syncs with back-off, and evicts idle local copies. False when the "
        "local directory is the durable copy (local)."
    )

    def prepare_workspace(identity, conversation):
        """Make ``<root>/<owner>/<conversation>/`` ready for a runner.

        Fires with a ``supervisor.storage.Prepared``: the workspace's absolute
        path, owned by ``identity.uid``, and attrs stats (or None) for the
        ``workspace_hydrated`` audit event.
        """

    def sync_workspace(identity, conversation, path):
        """Make the workspace's current content durable; runners may still be attached.

        Fires with attrs stats (for ``workspace_synced``) or None when there
        was nothing to do; fails with an exception carrying a string
        ``code`` (``sync_conflict``, ``storage_unavailable``) when the
        content is not durable.
        """

    def release_workspace(identity, conversation, path):
        """The last runner of a conversation has exited: persist what it changed.

        Same result as ``sync_workspace``.
        """

    def evict_workspace(identity, conversation):
        """Remove the local copy if, and only if, everything in it is durable.

        Fires True when the directory is gone (or was never there), False
        when it was kept: it holds changes not yet durable, or the local
        directory is the durable copy (``local`` always answers False).
        """

    def delete_conversation(owner, conversation):
        """Delete the conversation's durable copy kept outside this host.

        The supervisor has killed its runners and removes the local
        directory itself afterwards. Fires with attrs stats or None.
        """

    def delete_owner(owner):
        """Delete everything kept outside this host for ``owner``. Fires with attrs stats or None."""

    def mark_used(owner, conversation):
        """Record, where other hosts can see it, that the conversation is in use now.

        Retention counts from the latest use any host recorded.
        """

    def known_conversations():
        """Fires with a list of ``(owner, conversation, last_used)`` kept outside this host.

        ``last_used`` is a POSIX timestamp or None. ``local`` fires with [].
        """

    def collect_garbage(grace):
        """Delete stored data no conversation refers to and older than ``grace`` seconds.

        Fires with attrs stats or None.
        """


class IAuditSink(Interface):
    """Where audit events go. Events carry metadata only, never payloads."""

    name = Attribute("The sink's configuration name, such as 'jsonl'.")

    def emit(event):
        """Record one ``supervisor.audit.AuditEvent``. Must not block for long."""

    def close():
        """Flush and release resources; may return a Deferred."""


class IIsolationStrategy(Interface):
    """How a runner is started: which uid, which namespaces, which sandbox."""

    name = Attribute("The strategy's configuration name, such as 'bwrap'.")
    runs_as_owner = Attribute(
        "True when runners run as the owner's uid; False when they run as "
        "the supervisor's own user (the reply then reports that uid)."
    )

    def unavailable_reason():
        """None when this strategy can run here, else a sentence saying why not."""

    def spawn_spec(launch):
        """Return a ``supervisor.spawn.SpawnSpec`` that starts the runner.

        ``launch`` is a ``supervisor.spawn.RunnerLaunch``: the owner's
        identity, the workspace, the interpreter and the runner's arguments.
        The returned argv must drop to ``launch.uid``/``launch.gid`` itself
        (the supervisor never forks as the tenant), chdir to the workspace,
        and leave only the environment in ``launch.env``.
        """
