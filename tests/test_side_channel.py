"""The supervisor's end of the runner's side channel: only well-formed, short lines count."""

from twisted.internet.task import Clock

from supervisor.runner_process import MAX_EVENT_LINE, RunnerProcessProtocol


def _protocol():
    received = []
    protocol = RunnerProcessProtocol(Clock(), lambda data: None, {}, on_event=received.append)
    return protocol, received


def test_lines_are_split_across_reads():
    protocol, received = _protocol()
    protocol.childDataReceived(3, b'{"event": "chan')
    protocol.childDataReceived(3, b'ged"}\n{"event": "checkpoint", "token": 1}\n')
    assert received == [{"event": "changed"}, {"event": "checkpoint", "token": 1}]


def test_garbage_is_dropped():
    protocol, received = _protocol()
    protocol.childDataReceived(3, b"not json\n[1, 2]\n\xff\xfe\n" + b"x" * (4 * MAX_EVENT_LINE))
    protocol.childDataReceived(3, b'\n{"event": "changed"}\n')
    assert received == [{"event": "changed"}]


def test_an_overlong_line_is_dropped_whole():
    protocol, received = _protocol()
    protocol.childDataReceived(3, b'{"event": "changed", "pad": "' + b"p" * MAX_EVENT_LINE)
    protocol.childDataReceived(3, b'"}\n')
    assert received == []


def test_an_overlong_line_in_one_chunk_is_dropped():
    protocol, received = _protocol()
    protocol.childDataReceived(3, b'{"event":"changed","pad":"' + b"p" * 2000 + b'"}\n')
    assert received == []


def test_the_tail_of_an_overlong_line_is_not_a_line_of_its_own():
    """A long line split over reads: its tail (after the cut) must not pass as a message."""
    protocol, received = _protocol()
    protocol.childDataReceived(3, b'{"pad":"' + b"p" * (MAX_EVENT_LINE + 10))
    protocol.childDataReceived(3, b"p" * 5000)
    assert len(protocol._events_partial) <= MAX_EVENT_LINE
    protocol.childDataReceived(3, b'{"event":"checkpoint","token":7}\n{"event":"changed"}\n')
    assert received == [{"event": "changed"}]
