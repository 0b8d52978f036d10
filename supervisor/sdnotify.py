"""systemd's readiness protocol (``Type=notify``) without a dependency."""

import os
import socket


def notify(state: str, environ=None) -> bool:
    """Send ``state`` (such as ``READY=1``) to ``$NOTIFY_SOCKET``; False when not under systemd."""
    environ = os.environ if environ is None else environ
    address = environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        sock.connect(address)
        sock.sendall(state.encode("utf-8"))
    return True
