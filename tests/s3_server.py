"""moto's standalone S3 server, with conditional PUTs made atomic.

Run as ``python -m tests.s3_server --port N``. This is moto's own server
(``moto.server``: the same WSGI application, request handler and werkzeug
threaded server) with one addition: moto checks ``If-Match`` /
``If-None-Match`` on PutObject and then writes, without a lock, so two
concurrent conditional writes can both pass the check. Real S3, MinIO and
Ceph evaluate the condition atomically; this wrapper serialises conditional
PUTs so the test server does too.
"""

import argparse
import signal
import sys
import threading

from moto.server import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
from werkzeug.serving import run_simple


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


def main() -> None:
    """Serve on 127.0.0.1:PORT until SIGTERM."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    app = DomainDispatcherApplication(create_backend_app)
    run_simple(args.host, args.port, AtomicConditionalPuts(app), threaded=True,
               request_handler=MotoRequestHandler)


if __name__ == "__main__":
    main()
