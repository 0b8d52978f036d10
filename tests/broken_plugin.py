"""A plugin module for tests: offers an isolation whose object lacks the Interface."""

from supervisor.hookspecs import hookimpl


class NotAStrategy:
    """Has a name but none of IIsolationStrategy's methods."""

    name = "broken"


@hookimpl
def corral_isolation_strategies():
    """Offer ``broken``."""
    return {"broken": lambda argument, config: NotAStrategy()}
