"""The connection protocol's hello phase, on a fake reactor and transport."""

import json
import os

import pytest
from twisted.internet.testing import MemoryReactorClock, StringTransport
from zope.interface import implementer

from supervisor.audit import Auditor
from supervisor.config import load_config
from supervisor.hello import MAX_HELLO_BYTES
from supervisor.identities import IdentityStore
from supervisor.interfaces import IAuditSink
from supervisor.protocol import ConversationProtocol
from supervisor.service import Supervisor


@implementer(IAuditSink)
class ListSink:
    """An audit sink that keeps events in a list."""

    name = "list"

    def __init__(self):
        self.events = []

    def emit(self, event):
        self.events.append(event)

    def close(self):
        pass


@pytest.fixture
def reactor():
    clock = MemoryReactorClock()
    yield clock
    assert clock.getDelayedCalls() == [], "a test left timers pending"


@pytest.fixture
def sink():
    return ListSink()


@pytest.fixture
def supervisor(reactor, sink, tmp_path):
    root = tmp_path / "workspaces"
    root.mkdir()
    config = load_config(
        environ={"CORRAL_STATE_DIR": str(tmp_path), "CORRAL_MAX_CONNECTIONS": "2"}
    )
    return Supervisor(
        reactor=reactor,
        config=config,
        identities=IdentityStore(str(root), config.uid_range, privileged=False),
        storage=None,
        isolation=None,
        auditor=Auditor([sink]),
        runner_script="",
        privileged=False,
    )


def connect(supervisor):
    protocol = ConversationProtocol(supervisor)
    transport = StringTransport()
    protocol.makeConnection(transport)
    return protocol, transport


def reply(transport) -> dict:
    lines = transport.value().split(b"\n")
    assert lines[1:] == [b""], "the refusal must be exactly one line"
    return json.loads(lines[0])


def close(protocol, transport):
    transport.loseConnection()
    protocol.connectionLost(None)


def test_hello_timeout(supervisor, reactor):
    """No hello within hello_timeout: bad_hello and the connection closes."""
    protocol, transport = connect(supervisor)
    reactor.advance(supervisor.config.hello_timeout - 0.1)
    assert transport.value() == b""
    reactor.advance(0.2)
    assert reply(transport)["error"]["code"] == "bad_hello"
    assert transport.disconnecting
    close(protocol, transport)


def test_oversized_hello_without_newline(supervisor, reactor):
    """4096 bytes without a newline are refused at once."""
    protocol, transport = connect(supervisor)
    protocol.dataReceived(b"{" + b" " * (MAX_HELLO_BYTES + 10))
    assert reply(transport)["error"]["code"] == "bad_hello"
    close(protocol, transport)


@pytest.mark.parametrize(
    "line, code",
    [(b"hello\n", "bad_hello"),
     (b'{"corral": 1, "owner": "../etc", "conversation": "c"}\n', "bad_name")],
)
def test_refused_hello_creates_nothing(supervisor, reactor, sink, line, code):
    """A refused hello answers its code, creates no directory, and is audited by code only."""
    protocol, transport = connect(supervisor)
    protocol.dataReceived(line[:5])
    protocol.dataReceived(line[5:])
    assert reply(transport)["error"]["code"] == code
    close(protocol, transport)
    assert os.listdir(supervisor.identities.root) == []
    kinds = [e.kind for e in sink.events]
    assert kinds == ["connection_accepted", "hello_refused", "connection_closed"]
    assert sink.events[1].fields["code"] == code
    assert "etc" not in json.dumps([e.as_dict() for e in sink.events])


def test_data_after_refusal_is_ignored(supervisor, reactor):
    """Bytes that follow a refused hello are dropped, not parsed again."""
    protocol, transport = connect(supervisor)
    protocol.dataReceived(b"bad\n{\"corral\": 1}\n")
    protocol.dataReceived(b"more\n")
    assert reply(transport)["error"]["code"] == "bad_hello"
    close(protocol, transport)


def test_connection_cap(supervisor, reactor):
    """Over max_connections a client gets 'limit' and the count goes back down."""
    first = [connect(supervisor) for _ in range(2)]
    protocol, transport = connect(supervisor)
    assert reply(transport)["error"]["code"] == "limit"
    close(protocol, transport)
    assert len(supervisor.connections) == 2
    for p, t in first:
        close(p, t)
    assert supervisor.connections == set()
