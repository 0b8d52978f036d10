"""``corral serve``: run the supervisor in the foreground until SIGTERM or SIGINT."""

import signal

from twisted.logger import Logger

log = Logger()


def run_serve(config) -> int:
    """Start logging, build the service, run the reactor; return the exit status.

    Raises ConfigError for a configuration that cannot start. SIGTERM,
    SIGINT and SIGHUP stop the reactor; the service's ``stopService`` runs
    as a before-shutdown trigger, so the reactor exits only once every
    runner is gone.
    """
    from twisted.internet import reactor

    from supervisor.logs import start_logging
    from supervisor.plugins import PluginRegistry
    from supervisor.service import CorralService

    start_logging(config.log_format, config.log_level)
    registry = PluginRegistry(config.plugins)
    service = CorralService(reactor, config, registry)
    service.prepare()
    status = {"code": 0}

    def start():
        try:
            service.startService()
        except Exception:
            log.failure("corral could not start listening on {socket}", socket=config.socket)
            status["code"] = 1
            reactor.stop()
            return
        reactor.addSystemEventTrigger("before", "shutdown", service.stopService)

    reactor.callWhenRunning(start)
    # SIGHUP (a closed terminal, a careless `kill -HUP`) stops cleanly too:
    # by default it would kill the supervisor without stopping its runners.
    signal.signal(signal.SIGHUP, lambda signum, frame: reactor.callFromThread(reactor.stop))
    reactor.run()
    return status["code"]
