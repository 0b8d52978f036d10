"""The plugin manager: finds plugins, and builds the ones the configuration names."""

import importlib

import pluggy
from zope.interface.exceptions import Invalid
from zope.interface.verify import verifyObject

from supervisor import hookspecs
from supervisor.errors import ConfigError
from supervisor.interfaces import IAuditSink, IIsolationStrategy, IStorageBackend

#: Built-in plugins, registered before the entry-point group is loaded.
BUILTIN_PLUGINS = (
    "plugins.storage_local",
    "plugins.storage_s3",
    "plugins.audit_jsonl",
    "plugins.isolation_none",
    "plugins.isolation_setpriv",
    "plugins.isolation_bwrap",
    "plugins.isolation_auto",
)

_KINDS = {
    "storage": ("corral_storage_backends", IStorageBackend, "storage backend"),
    "audit": ("corral_audit_sinks", IAuditSink, "audit sink"),
    "isolation": ("corral_isolation_strategies", IIsolationStrategy, "isolation strategy"),
}


def split_spec(spec: str) -> tuple[str, str | None]:
    """Split ``NAME[:ARGUMENT]`` into its name and argument (None when absent)."""
    name, sep, argument = spec.partition(":")
    return name.strip(), (argument if sep else None)


class PluginRegistry:
    """The factories every registered plugin offers, by kind and name."""

    def __init__(self, extra_modules: tuple[str, ...] = (), entry_points: bool = True):
        self.manager = pluggy.PluginManager(hookspecs.PROJECT)
        self.manager.add_hookspecs(hookspecs)
        for module_name in BUILTIN_PLUGINS + tuple(extra_modules):
            try:
                module = importlib.import_module(module_name)
            except ImportError as e:
                raise ConfigError(
                    f"plugins = {module_name!r}: cannot import it ({e})"
                ) from None
            if self.manager.get_plugin(module_name) is None:
                self.manager.register(module, name=module_name)
        if entry_points:
            self.manager.load_setuptools_entrypoints(hookspecs.PROJECT)
        self.manager.check_pending()
        self._factories = {kind: self._collect(kind) for kind in _KINDS}

    def _collect(self, kind: str) -> dict:
        hook_name, _, label = _KINDS[kind]
        factories: dict = {}
        hook = getattr(self.manager.hook, hook_name)
        for result in hook():
            for name, factory in result.items():
                if name in factories:
                    raise ConfigError(
                        f"two plugins offer the {label} {name!r}; uninstall one"
                    )
                factories[name] = factory
        return factories

    def names(self, kind: str) -> list[str]:
        """The names available for ``kind`` ('storage', 'audit' or 'isolation')."""
        return sorted(self._factories[kind])

    def build(self, kind: str, spec: str, config):
        """Build the plugin object ``spec`` (``NAME[:ARGUMENT]``) names, checked against its Interface."""
        _, interface, label = _KINDS[kind]
        name, argument = split_spec(spec)
        factory = self._factories[kind].get(name)
        if factory is None:
            raise ConfigError(
                f"{kind} = {spec!r}: there is no {label} named {name!r}; "
                f"available: {', '.join(self.names(kind))}"
            )
        try:
            provider = factory(argument, config)
        except ValueError as e:
            raise ConfigError(f"{kind} = {spec!r}: {e}") from None
        try:
            verifyObject(interface, provider)
        except Invalid as e:
            raise ConfigError(
                f"{kind} = {spec!r}: the plugin's object does not provide "
                f"{interface.__name__}: {e}"
            ) from None
        return provider
