"""Isolation ``auto`` (the default): bwrap when usable, else setpriv as root, else none."""

from twisted.logger import Logger

from plugins.isolation_bwrap import BwrapIsolation
from plugins.isolation_none import _build as build_none
from plugins.isolation_setpriv import SetprivIsolation
from supervisor.hookspecs import hookimpl

log = Logger()


def choose_isolation():
    """The strongest strategy this host supports, and the reasons others were passed over."""
    passed_over = []
    for strategy in (BwrapIsolation(), SetprivIsolation()):
        reason = strategy.unavailable_reason()
        if reason is None:
            return strategy, passed_over
        passed_over.append(f"{strategy.name}: {reason}")
    return None, passed_over


def _build(argument, config):
    if argument:
        raise ValueError("auto isolation takes no argument")
    strategy, passed_over = choose_isolation()
    for reason in passed_over:
        log.warn("isolation auto: passed over {reason}", reason=reason)
    if config.conversation_sharing != "owner" and (strategy is None or strategy.name != "bwrap"):
        raise ValueError(
            "conversation_sharing = 'private' needs bwrap isolation, which cannot run "
            "here: " + "; ".join(passed_over)
        )
    if strategy is None:
        return build_none(None, config)
    log.info("isolation auto chose {name}", name=strategy.name)
    return strategy


@hookimpl
def corral_isolation_strategies():
    """Offer ``auto``."""
    return {"auto": _build}
