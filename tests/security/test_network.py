"""The network seen from a tenant: no host services, no abstract sockets of others, no corral socket."""

import os
import socket
import subprocess
import uuid

import pytest

from tests.security.helpers import bash, open_session, unique

pytestmark = [pytest.mark.root, pytest.mark.integration]


def host_addresses() -> list[str]:
    """Every IPv4 and IPv6 address configured on the host (loopback included), without scope."""
    output = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout
    addresses = []
    for line in output.splitlines():
        fields = line.split()
        if len(fields) > 3 and fields[2] in ("inet", "inet6"):
            address = fields[3].split("/")[0]
            if not address.startswith("fe80"):
                addresses.append(address)
    return addresses


CONNECT = """python3 - <<'PY'
import socket
for family, address in {targets!r}:
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.settimeout(2)
    try:
        sock.connect(address)
        print("CONNECTED", address)
    except OSError as e:
        print("refused", address, e)
    finally:
        sock.close()
PY"""


def test_host_services_are_unreachable(supervisor):
    """A TCP service on the host (loopback and every host address, IPv4 and IPv6) cannot be reached."""
    listeners, targets = [], []
    try:
        for family, any_address in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
            listener = socket.socket(family, socket.SOCK_STREAM)
            if family == socket.AF_INET6:
                listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            listener.bind((any_address, 0))
            listener.listen(16)
            listener.setblocking(False)
            listeners.append(listener)
            port = listener.getsockname()[1]
            for address in host_addresses():
                if (":" in address) == (family == socket.AF_INET6):
                    targets.append((int(family), (address, port)))
        assert any(address[0] == "127.0.0.1" for _, address in targets)
        # The listeners answer from the host itself: the attack would work without isolation.
        for family, address in targets:
            with socket.create_connection(address, timeout=2):
                pass
        for listener in listeners:
            while True:
                try:
                    listener.accept()[0].close()
                except BlockingIOError:
                    break
        with open_session(supervisor, unique("mallory")) as attacker:
            output, _ = bash(attacker, CONNECT.format(targets=targets))
        assert "CONNECTED" not in output, output
        refused = [line for line in output.splitlines() if line.startswith("refused")]
        assert len(refused) == len(targets), output
        for listener in listeners:
            with pytest.raises(BlockingIOError):
                listener.accept()
    finally:
        for listener in listeners:
            listener.close()


ABSTRACT_CONNECT = """python3 - <<'PY'
import socket
sock = socket.socket(socket.AF_UNIX)
sock.settimeout(2)
try:
    sock.connect({name!r})
    print("CONNECTED", sock.recv(100))
except OSError as e:
    print("refused", e)
PY"""

ABSTRACT_LISTEN = """nohup python3 - >/dev/null 2>&1 <<'PY' &
import socket
server = socket.socket(socket.AF_UNIX)
server.bind({name!r})
server.listen(8)
while True:
    client, _ = server.accept()
    client.sendall(b"LEAKED")
    client.close()
PY
sleep 0.5; echo listening"""


def test_host_abstract_socket_is_unreachable(supervisor):
    """A host process listening on an abstract Unix socket cannot be connected to from a tenant."""
    name = f"\0corral-test-{uuid.uuid4().hex}"
    server = socket.socket(socket.AF_UNIX)
    server.bind(name)
    server.listen(8)
    server.setblocking(False)
    try:
        with socket.socket(socket.AF_UNIX) as probe:
            probe.connect(name)
        server.accept()[0].close()
        with open_session(supervisor, unique("mallory")) as attacker:
            output, _ = bash(attacker, ABSTRACT_CONNECT.format(name=name))
        assert "CONNECTED" not in output and "refused" in output, output
        with pytest.raises(BlockingIOError):
            server.accept()
    finally:
        server.close()


def test_other_tenants_abstract_socket_is_unreachable(supervisor):
    """An abstract Unix socket another owner (or conversation) listens on cannot be connected to."""
    name = f"\0corral-test-{uuid.uuid4().hex}"
    alice, mallory = unique("alice"), unique("mallory")
    with open_session(supervisor, alice) as victim, open_session(
        supervisor, mallory
    ) as attacker, open_session(supervisor, alice, "c-2") as sibling:
        assert "listening" in bash(victim, ABSTRACT_LISTEN.format(name=name))[0]
        # The victim's own conversation reaches it: the socket is really there.
        assert "CONNECTED b'LEAKED'" in bash(victim, ABSTRACT_CONNECT.format(name=name))[0]
        for other in (attacker, sibling):
            output, _ = bash(other, ABSTRACT_CONNECT.format(name=name))
            assert "CONNECTED" not in output and "refused" in output, output


def test_tenant_cannot_reach_the_supervisor_socket(supervisor):
    """A tenant cannot connect to corral's own socket (which would let it speak as any owner)."""
    with open_session(supervisor, unique("mallory")) as attacker:
        output, _ = bash(
            attacker,
            CONNECT.format(targets=[(int(socket.AF_UNIX), supervisor.socket)])
            + f"\nls -la {os.path.dirname(supervisor.socket)} 2>&1",
        )
    assert "CONNECTED" not in output and "refused" in output, output
