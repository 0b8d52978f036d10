"""What a plugin must provide: one zope Interface per extension point.

pluggy finds plugins (``supervisor.hookspecs``); these interfaces say what the
objects they build can do. ``supervisor.plugins`` checks every object with
``verifyObject`` when it is loaded.
"""

from zope.interface import Attribute, Interface


class IStorageBackend(Interface):
    """Where a workspace's bytes live."""

    name = Attribute("The backend's configuration name, such as 'local'.")

    def prepare_workspace(identity, conversation):
        """Make ``<root>/<owner>/<conversation>/`` ready for a runner.

        ``identity`` is a ``supervisor.identities.OwnerIdentity`` whose owner
        directory exists. Returns a Deferred firing with the workspace's
        absolute path, owned by ``identity.uid``. Must not follow symlinks the
        tenant controls.
        """

    def release_workspace(identity, conversation, path):
        """The last runner of a conversation has exited: persist what it changed.

        Returns a Deferred that fires when the workspace is durable.
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
