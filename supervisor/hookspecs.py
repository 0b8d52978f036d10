"""pluggy hook specifications of the project ``corral``.

A plugin is a module (or object) with functions named like these, marked
with ``supervisor.hookspecs.hookimpl``, registered through the entry-point
group ``corral`` or the ``plugins`` configuration key. Each hook returns a
mapping from configuration names to factories; the results of all plugins
are merged, and a name given twice stops start-up.
"""

import pluggy

PROJECT = "corral"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def corral_storage_backends():
    """Return ``{name: factory}``; ``factory(argument, config)`` returns an IStorageBackend.

    ``argument`` is the text after ``NAME:`` in the configuration, or None.
    Not ``firstresult``: every plugin's mapping is collected.
    """


@hookspec
def corral_audit_sinks():
    """Return ``{name: factory}``; ``factory(argument, config)`` returns an IAuditSink.

    Not ``firstresult``: every plugin's mapping is collected.
    """


@hookspec
def corral_isolation_strategies():
    """Return ``{name: factory}``; ``factory(argument, config)`` returns an IIsolationStrategy.

    Not ``firstresult``: every plugin's mapping is collected.
    """
