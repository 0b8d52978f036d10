"""moto's standalone S3 server, with conditional PUTs made atomic and outages on demand.

Run as ``python -m tests.s3_server --port N``. This is moto's own server
(``moto.server``: the same WSGI application, request handler and werkzeug
threaded server) with two additions:

* moto checks ``If-Match`` / ``If-None-Match`` on PutObject and then
  writes, without a lock, so two concurrent conditional writes can both
  pass the check. Real S3, MinIO and Ceph evaluate the condition
  atomically; this wrapper serialises conditional PUTs so the test server
  does too.
* Outages. ``SIGUSR1`` stops serving: the listening socket is closed and
  every open connection is shut down, so a client sees exactly what a
  stopped server looks like (connection refused, a pooled connection
  reset or closed). ``SIGUSR2`` listens again on the same port
  (``SO_REUSEADDR``). moto keeps its buckets and objects in this process's
  memory, so nothing stored is lost across an outage. Both are idempotent.
  ``tests.s3_fixtures`` sends them and waits until the port is refused, or
  answers again.
"""

import argparse
import errno
import signal
import socket
import sys
import threading
import time

from moto.server import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
from werkzeug.serving import ThreadedWSGIServer

#: Signals the main thread waits for (blocked everywhere, taken with sigwait).
STOP, START = signal.SIGUSR1, signal.SIGUSR2
_CONTROL = {STOP, START, signal.SIGTERM, signal.SIGINT}


class AtomicConditionalPuts:
    """WSGI middleware: one conditional PUT at a time."""

    def __init__(self, app):
        self.app = app
        self.lock = threading.Lock()

    def __call__(self, environ, start_response):
        conditional = environ.get("REQUEST_METHOD") == "PUT" and (
            "HTTP_IF_MATCH" in environ or "HTTP_IF_NONE_MATCH" in environ)
        if not conditional:
            return self.app(environ, start_response)
        with self.lock:
            # moto computes the whole response inside the call; materialise it
            # under the lock so the check and the write happen together.
            return list(self.app(environ, start_response))


class DroppingServer(ThreadedWSGIServer):
    """werkzeug's threaded server that knows its open connections, to drop them."""

    def __init__(self, *args, **kwargs):
        self._connections = set()
        self._connections_lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def process_request(self, request, client_address):
        with self._connections_lock:
            self._connections.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request):
        with self._connections_lock:
            self._connections.discard(request)
        super().shutdown_request(request)

    def drop_connections(self) -> None:
        """Shut every open connection down both ways; its handler thread then ends."""
        with self._connections_lock:
            connections = list(self._connections)
        for connection in connections:
            try:
                connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _listening_socket(host: str, port: int) -> socket.socket:
    """A socket listening on ``host:port`` with SO_REUSEADDR, retrying a busy port for 10 s."""
    deadline = time.monotonic() + 10
    while True:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
            sock.listen(128)
            return sock
        except OSError as e:
            sock.close()
            if e.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


class Outages:
    """Serve ``app`` on ``host:port``; stop and start again on request, keeping the app."""

    def __init__(self, host: str, port: int, app):
        self.host, self.port, self.app = host, port, app
        self.server = None
        self.thread = None

    def start(self) -> None:
        if self.server is not None:
            return
        sock = _listening_socket(self.host, self.port)
        try:
            # werkzeug dups the descriptor it is given.
            server = DroppingServer(self.host, self.port, self.app,
                                    handler=MotoRequestHandler, fd=sock.fileno())
        finally:
            sock.close()
        self.server = server
        self.thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                                       name="s3-server", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        server, self.server = self.server, None
        if server is None:
            return
        server.shutdown()  # no accept() after this returns
        server.drop_connections()
        server.server_close()  # pending connections in the backlog are reset
        self.thread.join()


def main() -> None:
    """Serve on 127.0.0.1:PORT until SIGTERM; SIGUSR1 stops serving, SIGUSR2 serves again."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    # Blocked before any thread exists, so every thread inherits the mask and
    # only the main thread's sigwait takes these signals.
    signal.pthread_sigmask(signal.SIG_BLOCK, _CONTROL)
    app = AtomicConditionalPuts(DomainDispatcherApplication(create_backend_app))
    outages = Outages(args.host, args.port, app)
    outages.start()
    while True:
        received = signal.sigwait(_CONTROL)
        if received == STOP:
            outages.stop()
        elif received == START:
            outages.start()
        else:
            outages.stop()
            sys.exit(0)


if __name__ == "__main__":
    main()
