"""The runner as a child process: one ProcessProtocol per runner.

It exposes an ``ended`` Deferred, reads the runner's stdout in large chunks
through a pipe enlarged to 1 MiB (the relay's throughput depends on both),
logs the runner's stderr with a size cap, and kills the runner's whole
process tree on request.
"""

import errno
import fcntl
import json
import os

from twisted.internet import error
from twisted.internet.abstract import FileDescriptor
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IPushProducer
from twisted.internet.main import CONNECTION_DONE, CONNECTION_LOST
from twisted.internet.protocol import ProcessProtocol
from twisted.logger import Logger
from zope.interface import implementer

from supervisor import proctree

#: Bytes read from the runner's stdout per read call (Twisted's default is 8 KiB;
#: 256 KiB from a 1 MiB pipe moved ~1.5-1.9 GB/s here against ~1.4 with 64 KiB).
READ_SIZE = 1 << 18
#: Pipe capacity asked for with F_SETPIPE_SZ.
PIPE_SIZE = 1 << 20
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
#: Runner stderr logged per connection before the rest is dropped.
STDERR_BUDGET = 64 * 1024
#: Longest stderr line logged.
STDERR_LINE = 1000
#: Stderr lines logged in a burst, and per second after it (a token bucket).
STDERR_BURST_LINES = 100
STDERR_LINES_PER_SECOND = 10.0
#: The side channel: the runner writes events on its fd 3, reads answers on its fd 4.
EVENTS_FD = 3
ANSWERS_FD = 4
#: Longest side-channel line; a longer one is dropped (the channel is tenant-reachable).
MAX_EVENT_LINE = 1024


def _enlarge_pipe(fd: int) -> None:
    try:
        fcntl.fcntl(fd, _F_SETPIPE_SZ, PIPE_SIZE)
    except OSError:
        pass


def write_now(transport, data: bytes) -> None:
    """``transport.write`` that sends at once when nothing is queued.

    Twisted queues every write for the next reactor turn, which costs each
    relayed message two epoll_ctl calls and a wake-up; a relay of small
    request/answer messages is latency-bound, so when the transport's
    buffer is empty the bytes go straight to the socket or pipe, and only
    what the kernel does not take is queued the usual way.
    """
    if (
        not isinstance(transport, FileDescriptor)
        or transport.dataBuffer
        or transport._tempDataBuffer
        or not transport.connected
        or transport.disconnecting
    ):
        transport.write(data)
        return
    sent = transport.writeSomeData(data)
    if isinstance(sent, int):
        if sent < len(data):
            transport.write(data[sent:])
        return
    # An error: let the ordinary path find and report it.
    transport.write(data)


def _read_large(reader) -> object:
    """A ``doRead`` for a Twisted ProcessReader that reads 64 KiB at a time."""
    try:
        data = os.read(reader.fd, READ_SIZE)
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EINTR):
            return None
        return CONNECTION_LOST
    if not data:
        return CONNECTION_DONE
    reader.dataReceived(data)
    return None


@implementer(IPushProducer)
class RunnerOutputProducer:
    """Lets the client's transport pause and resume reading the runner's stdout."""

    def __init__(self, process_protocol: "RunnerProcessProtocol"):
        self.process_protocol = process_protocol

    def _reader(self):
        transport = self.process_protocol.transport
        return transport.pipes.get(1) if transport is not None else None

    def pauseProducing(self):
        """The client is not reading: stop reading the runner's output."""
        reader = self._reader()
        if reader is not None:
            reader.stopReading()

    def resumeProducing(self):
        """The client drained its buffer: read the runner's output again."""
        reader = self._reader()
        if reader is not None:
            reader.startReading()

    def stopProducing(self):
        """The client is gone: its connectionLost kills the runner and drains its output."""


@implementer(IPushProducer)
class ClientInputProducer:
    """Lets the runner's stdin pause and resume reading from the client.

    The client's transport is not registered directly: when the runner
    closes its stdin, Twisted stops the producer of that pipe, and the
    runner's output must still reach the client. Bytes the client sends
    after that are dropped.
    """

    def __init__(self, connection):
        self.connection = connection

    def pauseProducing(self):
        """The runner's stdin is full: stop reading the client."""
        self.connection.pause_client()

    def resumeProducing(self):
        """The runner's stdin drained: read the client again."""
        self.connection.resume_client()

    def stopProducing(self):
        """The runner closed its stdin; the connection lives on for its output."""


class RunnerProcessProtocol(ProcessProtocol):
    """One runner process. ``on_output`` receives its stdout bytes."""

    log = Logger()

    def __init__(self, reactor, on_output, label: dict, on_event=None):
        self.reactor = reactor
        self.on_output = on_output
        #: Receives each side-channel message (a dict) the runner sends.
        self.on_event = on_event
        self._events_partial = b""
        self._events_discarding = False
        self.label = label
        self.ended: Deferred = Deferred()
        self.exit_status: dict | None = None
        self.pid: int | None = None
        self.started_at = reactor.seconds()
        self._stderr_left = STDERR_BUDGET
        self._stderr_partial = b""
        self._stderr_tokens = float(STDERR_BURST_LINES)
        self._stderr_refilled = self.started_at
        self._stderr_dropped = 0

    @property
    def alive_pid(self) -> int | None:
        """The spawned process's pid while it has not been reaped, else None."""
        return self.transport.pid if self.transport is not None else None

    def connectionMade(self):
        """Tune the pipes: larger reads and a larger buffer for stdout and stdin."""
        self.pid = self.transport.pid
        pipes = self.transport.pipes
        if 1 in pipes:
            reader = pipes[1]
            reader.doRead = lambda: _read_large(reader)
            _enlarge_pipe(reader.fileno())
        if 0 in pipes:
            _enlarge_pipe(pipes[0].fileno())

    def discard_output(self) -> None:
        """The client is gone: drop the runner's output and read its pipe to the end.

        Reading may have been paused by backpressure; Twisted reports the
        process ended only once every pipe has reached its end.
        """
        self.on_output = lambda data: None
        transport = self.transport
        if transport is not None and 1 in transport.pipes:
            transport.pipes[1].startReading()

    def write(self, data: bytes) -> None:
        """Send bytes to the runner's stdin (ignored once it has gone)."""
        if self.transport is not None and 0 in self.transport.pipes:
            write_now(self.transport.pipes[0], data)

    def childDataReceived(self, childFD: int, data: bytes) -> None:
        """Route stdout, stderr and the side channel's events."""
        if childFD == EVENTS_FD:
            self._eventsReceived(data)
        else:
            super().childDataReceived(childFD, data)

    def _eventsReceived(self, data: bytes) -> None:
        """Split the side channel into JSON lines; anything malformed or too long is dropped.

        Processes of the tenant's uid could write here too, so nothing read
        from it is trusted: it can only ask for a sync or a checkpoint.
        """
        *lines, partial = (self._events_partial + data).split(b"\n")
        if self._events_discarding and lines:
            # The rest of an over-long line, up to its newline: dropped with it.
            lines.pop(0)
            self._events_discarding = False
        if len(partial) > MAX_EVENT_LINE:
            partial, self._events_discarding = b"", True
        elif self._events_discarding:
            partial = b""
        self._events_partial = partial
        for line in lines:
            if len(line) > MAX_EVENT_LINE or self.on_event is None:
                continue
            try:
                message = json.loads(line)
            except ValueError:
                continue
            if isinstance(message, dict):
                self.on_event(message)

    def answer(self, message: dict) -> None:
        """Send one side-channel answer to the runner (ignored once it has gone)."""
        if self.transport is not None and ANSWERS_FD in self.transport.pipes:
            self.transport.writeToChild(
                ANSWERS_FD, json.dumps(message, separators=(",", ":")).encode() + b"\n")

    def outReceived(self, data: bytes) -> None:
        """Relay stdout to the client."""
        self.on_output(data)

    def errReceived(self, data: bytes) -> None:
        """Log stderr line by line: lines capped, rate-limited, at most STDERR_BUDGET bytes in all."""
        if self._stderr_left <= 0:
            return
        data = self._stderr_partial + data[: self._stderr_left]
        self._stderr_left -= len(data) - len(self._stderr_partial)
        *lines, self._stderr_partial = data.split(b"\n")
        if len(self._stderr_partial) > STDERR_LINE:
            lines.append(self._stderr_partial)
            self._stderr_partial = b""
        now = self.reactor.seconds()
        self._stderr_tokens = min(
            float(STDERR_BURST_LINES),
            self._stderr_tokens + (now - self._stderr_refilled) * STDERR_LINES_PER_SECOND,
        )
        self._stderr_refilled = now
        for line in lines:
            if self._stderr_tokens < 1:
                if not self._stderr_dropped:
                    self.log.warn(
                        "runner {pid} writes to stderr faster than {rate} lines/s; "
                        "lines are dropped",
                        pid=self.pid,
                        rate=STDERR_LINES_PER_SECOND,
                        **self.label,
                    )
                self._stderr_dropped += 1
                continue
            self._stderr_tokens -= 1
            self.log.info(
                "runner {pid} stderr: {line}",
                pid=self.pid,
                line=line[:STDERR_LINE].decode("utf-8", "replace"),
                **self.label,
            )
        if self._stderr_left <= 0:
            self.log.warn(
                "runner {pid} wrote more than {budget} bytes to stderr; the rest is "
                "dropped ({dropped} lines were dropped before by the rate limit)",
                pid=self.pid,
                budget=STDERR_BUDGET,
                dropped=self._stderr_dropped,
                **self.label,
            )

    def kill(self) -> None:
        """SIGKILL the runner and every process below it; ``ended`` fires once it is reaped."""
        pid = self.alive_pid
        if pid is None:
            return
        try:
            proctree.kill_tree(pid)
        except OSError:
            self.log.failure("could not kill runner {pid}", pid=pid)

    def processEnded(self, reason):
        """Record how the runner ended and fire ``ended`` once."""
        if self.exit_status is not None:
            return
        value = reason.value
        status = {"exit_code": None, "signal": None}
        if isinstance(value, (error.ProcessDone, error.ProcessTerminated)):
            status["exit_code"] = value.exitCode
            status["signal"] = value.signal
        status["duration_ms"] = round((self.reactor.seconds() - self.started_at) * 1000, 3)
        self.exit_status = status
        self.ended.callback(status)
