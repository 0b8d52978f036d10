"""One client connection: the hello, the reply, then a byte relay to the runner.

States: ``hello`` (reading at most 4096 bytes for at most ``hello_timeout``
seconds) → ``starting`` (identity, workspace, spawn; the client is paused)
→ ``relaying`` (bytes flow both ways with backpressure; nothing is parsed)
→ ``closed``. A refusal writes one ``{"ok": false}`` line and closes.
"""

import itertools
import json
import os
import socket
import struct

from twisted.internet.defer import Deferred, succeed
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger

from supervisor.errors import BAD_HELLO, INTERNAL, LIMIT, UNAVAILABLE, CorralError
from supervisor.hello import MAX_HELLO_BYTES, Hello, parse_hello
from supervisor.runner_process import RunnerOutputProducer, RunnerProcessProtocol
from supervisor.spawn import RunnerLaunch, runner_env

_connection_ids = itertools.count(1)


def peer_credentials(transport) -> dict:
    """The connecting process's pid, uid and gid from SO_PEERCRED, or {} if unknown."""
    sock = getattr(transport, "socket", None)
    if sock is None:
        return {}
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return {}
    pid, uid, gid = struct.unpack("3i", raw)
    return {"peer_pid": pid, "peer_uid": uid, "peer_gid": gid}


class ConversationProtocol(Protocol):
    """A client asking for a conversation's runner, then talking to it."""

    log = Logger()

    def __init__(self, supervisor):
        self.supervisor = supervisor
        self.reactor = supervisor.reactor
        self.state = "hello"
        self.connection_id = next(_connection_ids)
        self.hello: Hello | None = None
        self.identity = None
        self.workspace: str | None = None
        self.runner: RunnerProcessProtocol | None = None
        self._buffer = bytearray()
        self._hello_timer = None
        self.bytes_in = 0
        self.bytes_out = 0
        self.closed: Deferred = Deferred()

    # -- hello ---------------------------------------------------------

    def connectionMade(self):
        """Count the connection, audit who connected, and start the hello timer."""
        self.started_at = self.reactor.seconds()
        supervisor = self.supervisor
        supervisor.connections.add(self)
        supervisor.auditor.emit(
            "connection_accepted",
            connection=self.connection_id,
            **peer_credentials(self.transport),
        )
        if len(supervisor.connections) > supervisor.config.max_connections:
            self.refuse(
                CorralError(
                    LIMIT,
                    f"the supervisor already serves {supervisor.config.max_connections} "
                    "connections (max_connections); retry later",
                )
            )
            return
        self._hello_timer = self.reactor.callLater(
            supervisor.config.hello_timeout, self._hello_timed_out
        )

    def _hello_timed_out(self):
        self._hello_timer = None
        self.refuse(
            CorralError(
                BAD_HELLO,
                f"no hello within {self.supervisor.config.hello_timeout:g} s; send one "
                "JSON line right after connecting",
            )
        )

    def dataReceived(self, data: bytes):
        """Relay bytes to the runner, or collect the hello line."""
        if self.state == "relaying":
            self.bytes_in += len(data)
            self.runner.write(data)
        elif self.state == "hello":
            self._buffer += data
            end = self._buffer.find(b"\n", 0, MAX_HELLO_BYTES)
            if end < 0:
                if len(self._buffer) >= MAX_HELLO_BYTES:
                    self.refuse(
                        CorralError(
                            BAD_HELLO,
                            f"the hello is longer than {MAX_HELLO_BYTES} bytes or "
                            "lacks its newline",
                        )
                    )
                return
            line = bytes(self._buffer[:end])
            del self._buffer[: end + 1]
            self._cancel_hello_timer()
            try:
                hello = parse_hello(line)
            except CorralError as e:
                self.refuse(e)
                return
            self.hello = hello
            self.state = "starting"
            self.transport.pauseProducing()
            self._start(hello).addErrback(self._start_failed)
        elif self.state == "starting":
            self._buffer += data

    def _cancel_hello_timer(self):
        if self._hello_timer is not None and self._hello_timer.active():
            self._hello_timer.cancel()
        self._hello_timer = None

    # -- start ---------------------------------------------------------

    def _start(self, hello: Hello) -> Deferred:
        return Deferred.fromCoroutine(self._start_runner(hello))

    async def _start_runner(self, hello: Hello) -> None:
        supervisor = self.supervisor
        self.identity = await deferToThreadPool(
            self.reactor,
            self.reactor.getThreadPool(),
            supervisor.identities.resolve,
            hello.owner,
        )
        if self.state != "starting":
            return
        created = not os.path.lexists(
            os.path.join(self.identity.directory, hello.conversation)
        )
        self.workspace = await supervisor.storage.prepare_workspace(
            self.identity, hello.conversation
        )
        if self.state != "starting":
            return
        if created:
            supervisor.auditor.emit("workspace_created", **self._audit_ids())
        self._spawn()
        self._reply(
            {
                "ok": True,
                "owner": hello.owner,
                "conversation": hello.conversation,
                "uid": self.identity.uid,
                "workspace": self.workspace,
                "isolation": supervisor.isolation.name,
            }
        )
        self.state = "relaying"
        self.runner.transport.pipes[0].registerProducer(self.transport, True)
        self.transport.registerProducer(RunnerOutputProducer(self.runner), True)
        if self._buffer:
            pending, self._buffer = bytes(self._buffer), bytearray()
            self.dataReceived(pending)
        self.transport.resumeProducing()

    def _spawn(self):
        supervisor = self.supervisor
        config = supervisor.config
        launch = RunnerLaunch(
            owner=self.hello.owner,
            conversation=self.hello.conversation,
            uid=self.identity.uid,
            gid=self.identity.gid,
            workspace=self.workspace,
            python=config.runner_python,
            runner_script=supervisor.runner_script,
            runner_args=(
                "--workspace",
                self.workspace,
                "--bash-timeout",
                f"{config.bash_timeout:g}",
                "--bash-max-timeout",
                f"{config.bash_max_timeout:g}",
                "--subreaper",
            ),
            env=runner_env(self.workspace),
        )
        spec = supervisor.isolation.spawn_spec(launch)
        self.runner = RunnerProcessProtocol(
            self.reactor, self._runner_output, {"connection": self.connection_id}
        )
        self.reactor.spawnProcess(
            self.runner,
            spec.executable,
            list(spec.args),
            env=spec.env,
            childFDs={0: "w", 1: "r", 2: "r"},
        )
        self.runner.ended.addCallback(self._runner_ended)
        supervisor.auditor.emit(
            "runner_started",
            pid=self.runner.pid,
            uid=self.identity.uid,
            isolation=supervisor.isolation.name,
            **self._audit_ids(),
        )
        self.log.info(
            "runner {pid} started for {owner}/{conversation} as uid {uid}",
            pid=self.runner.pid,
            owner=self.hello.owner,
            conversation=self.hello.conversation,
            uid=self.identity.uid,
        )

    def _start_failed(self, failure):
        if failure.check(CorralError):
            error = failure.value
        else:
            self.log.failure(
                "could not start a runner for connection {connection}",
                failure,
                connection=self.connection_id,
            )
            if failure.check(OSError):
                error = CorralError(
                    UNAVAILABLE,
                    f"the workspace could not be prepared: {failure.value}; "
                    "see the supervisor's log",
                )
            else:
                error = CorralError(
                    INTERNAL, "the supervisor failed to start a runner; see its log"
                )
        if self.runner is not None:
            self.runner.kill()
        self.refuse(error)

    # -- relay and close -----------------------------------------------

    def _runner_output(self, data: bytes) -> None:
        self.bytes_out += len(data)
        self.transport.write(data)

    def _runner_ended(self, status: dict) -> dict:
        self.supervisor.auditor.emit("runner_exited", **status, **self._audit_ids())
        self.log.info(
            "runner {pid} exited: code {exit_code}, signal {signal}",
            pid=self.runner.pid,
            exit_code=status["exit_code"],
            signal=status["signal"],
        )
        if self.state == "relaying":
            self.transport.unregisterProducer()
            self.transport.loseConnection()
        return status

    def _reply(self, message: dict) -> None:
        self.transport.write(json.dumps(message).encode("utf-8") + b"\n")

    def refuse(self, error: CorralError) -> None:
        """Send an error reply and close; nothing was created for this client."""
        if self.state in ("refused", "closed"):
            return
        self._cancel_hello_timer()
        self.state = "refused"
        self.supervisor.auditor.emit(
            "hello_refused", code=error.code, **self._audit_ids()
        )
        self.log.info(
            "connection {connection} refused: {code}",
            connection=self.connection_id,
            code=error.code,
        )
        self._reply(error.as_reply())
        self.transport.loseConnection()

    def _audit_ids(self) -> dict:
        ids = {"connection": self.connection_id}
        if self.hello is not None:
            ids["owner"] = self.hello.owner
            ids["conversation"] = self.hello.conversation
        return ids

    def connectionLost(self, reason):
        """Kill the runner's tree, let storage persist, then record the close."""
        self._cancel_hello_timer()
        self.state = "closed"
        runner = self.runner
        if runner is None:
            done = succeed(None)
        else:
            runner.kill()
            done = runner.ended
            done.addCallback(self._release)
        done.addBoth(self._closed)

    def _release(self, _):
        return self.supervisor.storage.release_workspace(
            self.identity, self.hello.conversation, self.workspace
        )

    def _closed(self, result):
        if hasattr(result, "check"):
            self.log.failure(
                "closing connection {connection} failed", result, connection=self.connection_id
            )
        self.supervisor.connections.discard(self)
        self.supervisor.auditor.emit(
            "connection_closed",
            bytes_in=self.bytes_in,
            bytes_out=self.bytes_out,
            duration_ms=round((self.reactor.seconds() - self.started_at) * 1000, 3),
            **self._audit_ids(),
        )
        self.closed.callback(None)


class ConversationFactory(Factory):
    """Builds a ConversationProtocol per accepted connection."""

    def __init__(self, supervisor):
        self.supervisor = supervisor
        self.noisy = False

    def buildProtocol(self, addr):
        """A new protocol bound to the supervisor."""
        return ConversationProtocol(self.supervisor)
