"""One client connection: the hello, the reply, then a byte relay to the runner.

States: ``hello`` (reading at most 4096 bytes for at most ``hello_timeout``
seconds) → ``starting`` (identity, workspace, spawn; the client is paused)
→ ``relaying`` (bytes flow both ways with backpressure; nothing is parsed)
→ ``closed``. A refusal writes one ``{"ok": false}`` line and closes.
"""

import itertools
import json
import os
import select
import socket
import struct

from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IHalfCloseableProtocol
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.task import LoopingCall
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger
from zope.interface import implementer

from supervisor.errors import BAD_HELLO, FORBIDDEN, INTERNAL, LIMIT, UNAVAILABLE, CorralError
from supervisor.hello import MAX_HELLO_BYTES, NAME_PATTERN, AdminRequest, Hello, parse_hello
from supervisor.runner_process import (
    ANSWERS_FD,
    EVENTS_FD,
    ClientInputProducer,
    RunnerOutputProducer,
    RunnerProcessProtocol,
    write_now,
)
from supervisor.spawn import RunnerLaunch, runner_env
from supervisor.workspaces import error_code

_connection_ids = itertools.count(1)

#: How often a client that is not being read is checked for a hang-up.
HANGUP_CHECK_SECONDS = 1.0
#: Checkpoints one connection may have waiting (the side channel is tenant-reachable).
MAX_PENDING_CHECKPOINTS = 64
_SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)


def tmpfs_size(tmp_size: int, limits: dict, limited: bool) -> int:
    """The size of a conversation's /tmp and /dev/shm: tmp_size, at most a quarter of its memory.

    tmpfs pages count towards the memory limit, and the OOM killer cannot
    free them: a tmpfs as large as the limit would let one ``cat`` into
    /dev/shm get the runner killed. Capped, both together fill at half the
    limit and the writer gets "no space left", an error it can report.
    """
    memory = limits.get("memory_limit")
    if limited and memory is not None:
        return max(1 << 20, min(tmp_size, memory // 4))
    return tmp_size


def count_conversations(owner_directory: str) -> int:
    """How many conversation directories an owner has (blocking: run it in a thread)."""
    with os.scandir(owner_directory) as entries:
        return sum(
            1 for e in entries
            if NAME_PATTERN.fullmatch(e.name) and e.is_dir(follow_symlinks=False)
        )


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


def peer_groups(transport) -> set:
    """The connecting process's supplementary groups (SO_PEERGROUPS), or an empty set."""
    sock = getattr(transport, "socket", None)
    if sock is None:
        return set()
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, 4 * 1024)
    except OSError:
        return set()
    return set(struct.unpack(f"{len(raw) // 4}I", raw[: len(raw) // 4 * 4]))


def may_administer(transport, credentials: dict, admin_group: int | None) -> bool:
    """Root, the supervisor's own user, or a member of admin_group may make admin requests.

    ``credentials`` are ``peer_credentials(transport)``.
    """
    uid = credentials.get("peer_uid")
    if uid is None:
        return False
    if uid in (0, os.geteuid()):
        return True
    if admin_group is None:
        return False
    return credentials.get("peer_gid") == admin_group or admin_group in peer_groups(transport)


@implementer(IHalfCloseableProtocol)
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
        #: The attached supervisor.workspaces.Conversation, once attached.
        self.conversation = None
        self._checkpoints_pending = 0
        self.runner: RunnerProcessProtocol | None = None
        self.cgroup = None
        self._buffer = bytearray()
        self._hello_timer = None
        self.bytes_in = 0
        self.bytes_out = 0
        self.closed: Deferred = Deferred()
        self._client_eof = False
        self._hangup_watch = None
        self.oom_kills = 0
        # Until the runner's tree is in its cgroup, the client's bytes wait here.
        self._input_held = False
        self._held = bytearray()
        self._adopted: Deferred = succeed(None)

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
            if self._input_held:
                self._held += data
                self.pause_client()
            else:
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
            if isinstance(hello, AdminRequest):
                self.state = "admin"
                self.pause_client()
                Deferred.fromCoroutine(self._admin(hello)).addErrback(self._start_failed)
                return
            self.hello = hello
            self.state = "starting"
            self.pause_client()
            self._start(hello).addErrback(self._start_failed)
        elif self.state == "starting":
            self._buffer += data

    def _cancel_hello_timer(self):
        if self._hello_timer is not None and self._hello_timer.active():
            self._hello_timer.cancel()
        self._hello_timer = None

    # -- reading the client: pauses, end of input, hang-ups -------------

    def pause_client(self):
        """Stop reading the client (its runner is busy), but keep noticing if it hangs up."""
        self.transport.pauseProducing()
        self._watch_hangup()

    def resume_client(self):
        """Read the client again."""
        if not self._client_eof and not self._input_held:
            self._stop_hangup_watch()
            self.transport.resumeProducing()

    def readConnectionLost(self):
        """The client shut down its sending side: the runner's stdin ends, its answers still flow."""
        self._client_eof = True
        if self.state == "hello":
            self.refuse(
                CorralError(BAD_HELLO, "the client ended its input before a complete hello")
            )
        elif self.state == "relaying":
            if not self._input_held:
                self.runner.transport.closeStdin()
            self._watch_hangup()

    def writeConnectionLost(self):
        """The client can no longer receive: nothing the runner says can reach it."""
        self.transport.abortConnection()

    def _watch_hangup(self):
        """While the client is not being read, look for a hang-up once a second.

        A socket nobody reads reports no end of file, so a client that
        disconnects while paused would otherwise leave its runner behind.
        """
        if self._hangup_watch is None and hasattr(self.transport, "fileno"):
            self._hangup_watch = LoopingCall(self._check_hangup)
            self._hangup_watch.clock = self.reactor
            self._hangup_watch.start(HANGUP_CHECK_SECONDS, now=False)

    def _stop_hangup_watch(self):
        if self._hangup_watch is not None:
            if self._hangup_watch.running:
                self._hangup_watch.stop()
            self._hangup_watch = None

    def _check_hangup(self):
        try:
            poller = select.poll()
            poller.register(self.transport.fileno(), select.POLLHUP)
            events = poller.poll(0)
        except (OSError, ValueError):
            events = [(None, select.POLLHUP)]
        if events and events[0][1] & (select.POLLHUP | select.POLLERR | select.POLLNVAL):
            self._stop_hangup_watch()
            self.transport.abortConnection()

    # -- start ---------------------------------------------------------

    def _start(self, hello: Hello) -> Deferred:
        return Deferred.fromCoroutine(self._start_runner(hello))

    async def _start_runner(self, hello: Hello) -> None:
        supervisor = self.supervisor
        config = supervisor.config
        # Before the identity: resolving it would create the owner's directory again.
        supervisor.workspaces.refuse_if_deleting(hello.owner, hello.conversation)
        same_owner = sum(
            1 for c in supervisor.connections
            if c.hello is not None and c.hello.owner == hello.owner and c.state != "refused"
        )
        if same_owner > config.max_connections_per_owner:
            raise CorralError(
                LIMIT,
                f"owner {hello.owner!r} already has {config.max_connections_per_owner} "
                "connections (max_connections_per_owner); close one or retry later",
            )
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
        if created:
            existing = await deferToThreadPool(
                self.reactor,
                self.reactor.getThreadPool(),
                count_conversations,
                self.identity.directory,
            )
            if self.state != "starting":
                return
            if existing >= config.max_conversations_per_owner:
                raise CorralError(
                    LIMIT,
                    f"owner {hello.owner!r} already has {existing} conversations "
                    f"(max_conversations_per_owner is {config.max_conversations_per_owner}); "
                    "delete some before starting new ones",
                )
        conversation = await supervisor.workspaces.attach(self.identity, hello.conversation)
        if self.state != "starting":
            supervisor.workspaces.detach(conversation)
            return
        self.conversation = conversation
        self.workspace = conversation.path
        if created:
            supervisor.auditor.emit("workspace_created", **self._audit_ids())
        self._spawn()
        self._reply(
            {
                "ok": True,
                "owner": hello.owner,
                "conversation": hello.conversation,
                "uid": self.runner_uid,
                "workspace": self.workspace,
                "isolation": supervisor.isolation.name,
            }
        )
        self.state = "relaying"
        self.runner.transport.pipes[0].registerProducer(ClientInputProducer(self), True)
        self.transport.registerProducer(RunnerOutputProducer(self.runner), True)
        if self._buffer:
            pending, self._buffer = bytes(self._buffer), bytearray()
            self.dataReceived(pending)
        if self._client_eof:
            self.readConnectionLost()
        else:
            self.resume_client()

    @property
    def runner_uid(self) -> int:
        """The uid the runner's tools really run as."""
        if self.supervisor.isolation.runs_as_owner:
            return self.identity.uid
        return os.geteuid()

    def _spawn(self):
        supervisor = self.supervisor
        config = supervisor.config
        limits = config.limits_for(self.hello.owner)
        if supervisor.cgroups is not None:
            name = f"{self.connection_id}.{self.hello.owner}.{self.hello.conversation}"
            try:
                self.cgroup = supervisor.cgroups.create(name, limits)
            except OSError as e:
                self.log.error(
                    "cannot create the cgroup {name}: {error}", name=name, error=e.strerror
                )
                raise CorralError(
                    UNAVAILABLE,
                    f"the conversation's cgroup could not be created ({e.strerror}); "
                    "see the supervisor's log",
                ) from None
        oom_args: tuple[str, ...] = ()
        oom_file = self.cgroup.oom_events_file() if self.cgroup is not None else None
        if oom_file is not None:
            oom_args = ("--oom-events", oom_file)
            if limits["memory_limit"] is not None:
                oom_args += ("--memory-limit", str(limits["memory_limit"]))
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
                "--max-read-bytes",
                str(config.max_read_bytes),
                "--max-edit-bytes",
                str(config.max_edit_bytes),
                "--max-spill-bytes",
                str(config.max_output_file_bytes),
                *oom_args,
                "--subreaper",
                "--no-userns",
                "--events-fd",
                str(EVENTS_FD),
                "--answers-fd",
                str(ANSWERS_FD),
                *(("--change-events",) if supervisor.storage.background_sync else ()),
            ),
            env=runner_env(self.workspace),
            tmp_size=tmpfs_size(config.tmp_size, limits, self.cgroup is not None),
            readable_files=(oom_file,) if oom_file else (),
            sharing=config.conversation_sharing,
        )
        spec = supervisor.isolation.spawn_spec(launch)
        executable, args = spec.executable, spec.args
        runner = RunnerProcessProtocol(
            self.reactor, self._runner_output, {"connection": self.connection_id},
            on_event=self._runner_event,
        )
        self.reactor.spawnProcess(
            runner,
            executable,
            list(args),
            env=spec.env,
            childFDs={0: "w", 1: "r", 2: "r", EVENTS_FD: "r", ANSWERS_FD: "w"},
        )
        # Only a process that was spawned is this connection's runner: one that
        # failed to spawn never ends, and the close path would wait for it.
        self.runner = runner
        self.runner.ended.addCallback(self._runner_ended)
        if self.cgroup is not None:
            self._input_held = True
            self._adopted = deferToThreadPool(
                self.reactor, self.reactor.getThreadPool(), self.cgroup.adopt, self.runner.pid
            )
            self._adopted.addCallbacks(self._cgroup_joined, self._cgroup_join_failed)
        supervisor.auditor.emit(
            "runner_started",
            pid=self.runner.pid,
            uid=self.runner_uid,
            isolation=supervisor.isolation.name,
            **self._audit_ids(),
        )
        self.log.info(
            "runner {pid} started for {owner}/{conversation} as uid {uid}",
            pid=self.runner.pid,
            owner=self.hello.owner,
            conversation=self.hello.conversation,
            uid=self.runner_uid,
        )

    # -- the runner's side channel ------------------------------------

    def _runner_event(self, message: dict) -> None:
        """A side-channel message: files may have changed, or a checkpoint is asked for."""
        conversation = self.conversation
        if conversation is None or self.state not in ("relaying", "starting"):
            return
        event = message.get("event")
        if event == "changed":
            self.supervisor.workspaces.changed(conversation)
        elif event == "checkpoint":
            token = message.get("token")
            if not isinstance(token, int) or isinstance(token, bool):
                return
            if self._checkpoints_pending >= MAX_PENDING_CHECKPOINTS:
                self.runner.answer({"checkpoint": token, "ok": False, "code": LIMIT,
                                    "message": "too many checkpoints are waiting"})
                return
            self._checkpoints_pending += 1
            runner = self.runner

            def durable(fields):
                self._checkpoints_pending -= 1
                runner.answer({"checkpoint": token, "ok": True,
                               "result": {"storage": self.supervisor.storage.name,
                                          **(fields or {})}})

            def not_durable(failure):
                self._checkpoints_pending -= 1
                runner.answer({"checkpoint": token, "ok": False, "code": error_code(failure),
                               "message": failure.getErrorMessage()})

            self.supervisor.workspaces.checkpoint(conversation).addCallbacks(durable, not_durable)

    # -- administrative requests ---------------------------------------

    async def _admin(self, request: AdminRequest) -> None:
        supervisor = self.supervisor
        credentials = peer_credentials(self.transport)
        if not may_administer(self.transport, credentials, supervisor.config.admin_group):
            raise CorralError(
                FORBIDDEN,
                "administrative requests are for root, the supervisor's user and members "
                "of admin_group",
            )
        supervisor.auditor.emit(
            "admin_request", action=request.action, connection=self.connection_id,
            **({"owner": request.owner} if request.owner else {}),
            **({"conversation": request.conversation} if request.conversation else {}),
            **credentials,
        )
        if request.action == "cleanup":
            result = await supervisor.workspaces.cleanup()
        else:
            result = await supervisor.workspaces.delete(request.owner, request.conversation)
        if self.state == "admin":
            self._reply({"ok": True, "admin": request.action, "result": result})
            self.state = "done"
            self.transport.loseConnection()

    def _cgroup_joined(self, moved: int) -> None:
        """The runner's tree is in its cgroup: let the client's bytes through."""
        self._input_held = False
        if self.state != "relaying" and self.state != "starting":
            return
        if self._held:
            held, self._held = bytes(self._held), bytearray()
            self.runner.write(held)
        if self._client_eof:
            self.runner.transport.closeStdin()
        elif self.state == "relaying":
            self.resume_client()

    def _cgroup_join_failed(self, failure) -> None:
        if self.state == "closed":
            return  # the client left during the move; the close path kills everything
        self.log.failure(
            "could not move runner {pid} into its cgroup; closing connection {connection}",
            failure,
            pid=self.runner.pid,
            connection=self.connection_id,
        )
        self.runner.kill()
        self.transport.abortConnection()

    def _start_failed(self, failure):
        if failure.check(CorralError):
            error = failure.value
        elif error_code(failure) != INTERNAL:
            # The storage backend's own error (storage_unavailable, ...): retrying may help.
            error = CorralError(UNAVAILABLE, f"{error_code(failure)}: {failure.getErrorMessage()}")
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
        elif self.cgroup is not None:
            self.cgroup.remove()
            self.cgroup = None
        self.refuse(error)

    # -- relay and close -----------------------------------------------

    def _runner_output(self, data: bytes) -> None:
        self.bytes_out += len(data)
        write_now(self.transport, data)

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
        self._stop_hangup_watch()
        self.state = "closed"
        runner = self.runner
        if runner is None:
            done = succeed(None)
            if self.conversation is not None:
                done.addCallback(self._release)
        else:
            runner.discard_output()
            if self.cgroup is not None:
                self.cgroup.kill()
            if self.cgroup is None or self._input_held:
                # Not (yet) all in the cgroup: kill the process tree itself.
                runner.kill()
            if self.cgroup is not None:
                # The move into the cgroup may still be running: let it finish,
                # then kill until the cgroup is empty. Only then wait for the
                # runner's pipes: a process that escaped the first kill (one
                # moved in after it) could hold them open forever.
                done = self._adopted
                done.addCallback(self._empty_cgroup)
                done.addCallback(lambda _: runner.ended)
            else:
                done = runner.ended
            done.addCallback(self._release)
        done.addBoth(self._closed)

    def _empty_cgroup(self, _):
        """Wait until no process is left in the cgroup, record OOM kills, remove it."""
        cgroup = self.cgroup
        self.oom_kills = cgroup.oom_kills()
        if self.oom_kills:
            self.supervisor.auditor.emit(
                "oom_kill", count=self.oom_kills, **self._audit_ids()
            )

        def emptied(empty: bool):
            if not empty:
                self.log.error(
                    "processes of cgroup {name} did not die within {timeout} s; "
                    "the next start removes it",
                    name=cgroup.name,
                    timeout=self.supervisor.config.stop_timeout,
                )
                return
            try:
                cgroup.remove()
            except OSError as e:
                self.log.error(
                    "cannot remove cgroup {name}: {error}", name=cgroup.name, error=e.strerror
                )

        return cgroup.wait_empty(self.reactor, self.supervisor.config.stop_timeout).addCallback(
            emptied
        )

    def _release(self, _):
        """The runner is gone: detach; the last connection's close syncs the workspace."""
        if self.conversation is None:
            return None
        return self.supervisor.workspaces.detach(self.conversation)

    def _closed(self, result):
        if hasattr(result, "check"):
            self.log.failure(
                "closing connection {connection} failed", result, connection=self.connection_id
            )
        self.supervisor.connections.discard(self)
        extra = {"oom_kills": self.oom_kills} if self.cgroup is not None else {}
        self.supervisor.auditor.emit(
            "connection_closed",
            **extra,
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
