"""A synchronous client for corral: the hello, then JSON-RPC with a conversation's runner.

Standard library only, and no Twisted: agent runtimes import this module to
use a workspace, and the ``corral relay``, ``corral exec`` and ``corral
call`` commands are built on it.  The wire protocol is described in
``docs/protocol.md``.

Example::

    from supervisor.client import Session

    with Session.connect(None, "alice", "c-42") as session:
        session.initialize()
        result = session.call_tool("bash", {"command": "ls -la"})
        print(result["content"][0]["text"], result["structuredContent"]["exitCode"])

A :class:`Session` is not thread-safe: use it from one thread, or one
session per thread.
"""

import json
import os
import socket
import sys
import time

from supervisor import paths
from supervisor.errors import (  # noqa: F401 (re-exported for clients)
    BAD_HELLO,
    BAD_NAME,
    INTERNAL,
    LIMIT,
    UID_CONFLICT,
    UNAVAILABLE,
)

#: The hello protocol version this client speaks.
HELLO_VERSION = 1

#: The MCP protocol version :meth:`Session.initialize` asks for by default.
MCP_PROTOCOL_VERSION = "2025-11-25"

#: Refusals that may succeed if the same hello is sent again later.
RETRYABLE_CODES = frozenset({LIMIT, UNAVAILABLE})

#: JSON-RPC error codes the runner answers with.
PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603

#: Seconds allowed, by default, for connecting and getting the reply (which
#: includes preparing the workspace and starting the runner).
DEFAULT_CONNECT_TIMEOUT = 60.0

#: Largest reply line accepted from the supervisor.
MAX_REPLY_BYTES = 64 * 1024

_READ_SIZE = 64 * 1024


# -- errors ----------------------------------------------------------------


class HelloRefused(Exception):
    """The supervisor refused the hello; ``code`` is one of the stable error codes."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message

    @property
    def retryable(self) -> bool:
        """Whether sending the same hello later may succeed (``limit``, ``unavailable``)."""
        return self.code in RETRYABLE_CODES


class SupervisorUnreachable(ConnectionError):
    """No connection to the supervisor's socket could be made; ``path`` says which."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(message)
        self.path = path


class SocketNotFound(SupervisorUnreachable):
    """Nothing listens at the socket path: corral serve is not running there."""


class SocketPermissionDenied(SupervisorUnreachable):
    """The socket exists but this user may not connect to it."""


class ConnectionClosed(ConnectionError):
    """The supervisor or the runner closed the connection before the expected answer."""


class ProtocolError(Exception):
    """The other side sent something that is not the protocol (not JSON, a bad reply)."""


class RpcError(Exception):
    """A JSON-RPC error answer: ``code`` (for example -32602), ``message``, ``data``."""

    def __init__(self, code: int, message: str, data=None) -> None:
        super().__init__(f"{message} (JSON-RPC error {code})")
        self.code = code
        self.message = message
        self.data = data


def default_socket() -> str:
    """The socket to use when none is given: ``CORRAL_SOCKET``, else this user's default."""
    return os.environ.get("CORRAL_SOCKET") or paths.default_socket()


def _unreachable(path: str, error: OSError) -> SupervisorUnreachable:
    """Turn a failed ``connect`` into an error that says which path and what to do."""
    default = paths.default_socket()
    where = (
        "pass --socket or set CORRAL_SOCKET if it listens elsewhere"
        if path != default
        else "set CORRAL_SOCKET or pass --socket if it listens elsewhere"
    )
    if isinstance(error, FileNotFoundError):
        return SocketNotFound(
            path,
            f"no corral socket at {path}: is `corral serve` running? "
            f"(the default socket for this user is {default}; {where})",
        )
    if isinstance(error, ConnectionRefusedError):
        return SocketNotFound(
            path,
            f"nothing is listening on {path} (a stale socket left by a stopped "
            f"supervisor?): is `corral serve` running? ({where})",
        )
    if isinstance(error, PermissionError):
        return SocketPermissionDenied(
            path,
            f"permission denied connecting to {path}: this user (uid {os.getuid()}) "
            "must be allowed into the socket's directory and group (by default the "
            "'corral' group); ask the operator to add you, or use a supervisor you run "
            "yourself",
        )
    if isinstance(error, TimeoutError):
        return SupervisorUnreachable(
            path, f"connecting to {path} timed out: the supervisor is not accepting connections"
        )
    reason = error.strerror or str(error)
    return SupervisorUnreachable(path, f"cannot connect to the corral socket {path}: {reason}")


# -- the session ------------------------------------------------------------


class Session:
    """One connection to a conversation's runner: the hello, then JSON-RPC requests.

    Make one with :meth:`connect`.  After it returns, ``reply`` holds the
    supervisor's reply (``owner``, ``conversation``, ``uid``, ``workspace``,
    ``isolation``) and the connection speaks MCP: call :meth:`initialize`
    first, then :meth:`call_tool`, :meth:`request` or :meth:`notify`.

    Messages that arrive while waiting for an answer are dispatched as they
    come: progress notifications to the ``on_progress`` of the call they
    belong to, other notifications to ``on_notification`` (if set),
    answers to other in-flight requests kept until asked for.
    """

    def __init__(self, sock: socket.socket, reply: dict, buffered: bytes = b"") -> None:
        self.sock = sock
        #: The supervisor's ``{"ok": true, ...}`` reply.
        self.reply = reply
        #: Called with each notification's message dict that nothing else consumed.
        self.on_notification = None
        #: The ``initialize`` result, once :meth:`initialize` has run.
        self.server = None
        self._buffer = bytearray(buffered)
        self._scanned = 0  # how much of _buffer is known to hold no newline
        self._next_id = 0
        self._pending: set = set()
        self._answers: dict = {}
        self._progress: dict = {}
        self._eof = False

    # -- connecting ----------------------------------------------------

    @classmethod
    def connect(
        cls,
        socket_path: str | None,
        owner: str,
        conversation: str,
        timeout: float | None = DEFAULT_CONNECT_TIMEOUT,
    ) -> "Session":
        """Connect, send the hello and read the reply; return the session.

        ``socket_path`` None means :func:`default_socket`.  ``timeout`` bounds
        connecting plus the reply (which includes preparing the workspace and
        starting the runner).  Raises :class:`HelloRefused` with the stable
        code, :class:`SupervisorUnreachable` (:class:`SocketNotFound`,
        :class:`SocketPermissionDenied`) when the socket cannot be reached,
        :class:`ConnectionClosed` or ``TimeoutError`` when no reply comes.
        """
        hello = {"corral": HELLO_VERSION, "owner": owner, "conversation": conversation}
        return cls.connect_with_hello(socket_path, hello, timeout)

    @classmethod
    def connect_with_hello(
        cls,
        socket_path: str | None,
        hello,
        timeout: float | None = DEFAULT_CONNECT_TIMEOUT,
    ) -> "Session":
        """Like :meth:`connect`, with the hello given whole: a dict, or the raw line as bytes.

        For clients that need a hello this module does not build (and for
        tests of refusals); a newline is added to bytes that lack one.
        """
        if isinstance(hello, dict):
            line = json.dumps(hello).encode() + b"\n"
        else:
            line = bytes(hello) if bytes(hello).endswith(b"\n") else bytes(hello) + b"\n"
        sock, reply, rest = _open(socket_path, line, timeout)
        return cls(sock, reply, rest)

    @property
    def owner(self) -> str:
        """The owner named in the hello."""
        return self.reply["owner"]

    @property
    def conversation(self) -> str:
        """The conversation named in the hello."""
        return self.reply["conversation"]

    @property
    def uid(self) -> int:
        """The uid the runner and its tools run as."""
        return self.reply["uid"]

    @property
    def workspace(self) -> str:
        """The conversation directory: the tools' working directory."""
        return self.reply["workspace"]

    @property
    def isolation(self) -> str:
        """The isolation strategy the runner was started with (``bwrap``, ``setpriv``, ...)."""
        return self.reply["isolation"]

    # -- MCP -----------------------------------------------------------

    def initialize(
        self,
        protocol_version: str = MCP_PROTOCOL_VERSION,
        client_name: str = "corral-client",
        client_version: str = "1",
        timeout: float | None = 30.0,
    ) -> dict:
        """Perform MCP's handshake (``initialize``, then ``notifications/initialized``).

        Returns the ``initialize`` result (``protocolVersion``, ``serverInfo``,
        ``capabilities``, ``instructions``), also kept as ``self.server``.
        """
        result = self.request(
            "initialize",
            {
                "protocolVersion": protocol_version,
                "capabilities": {},
                "clientInfo": {"name": client_name, "version": client_version},
            },
            timeout=timeout,
        )
        self.notify("notifications/initialized")
        self.server = result
        return result

    def ping(self, timeout: float | None = 30.0) -> None:
        """Check that the runner answers."""
        self.request("ping", timeout=timeout)

    def list_tools(self, timeout: float | None = 30.0) -> list:
        """The runner's tools: each a dict with ``name``, ``description``, ``inputSchema``."""
        return self.request("tools/list", timeout=timeout)["tools"]

    def call_tool(
        self,
        name: str,
        arguments: dict | None = None,
        on_progress=None,
        timeout: float | None = None,
    ) -> dict:
        """Call a tool and return its CallToolResult dict.

        The result has ``content`` (a list of ``{"type": "text", "text": ...}``
        or image items), ``isError`` and ``structuredContent``.  A tool that
        fails (a non-zero exit, a missing file) gives a result with
        ``isError`` true, not an exception; :class:`RpcError` means the call
        itself was wrong (an unknown tool, bad arguments).

        ``on_progress``, if given, is called with each progress
        notification's params (``progressToken``, ``progress``, ``message``):
        for ``bash``, ``message`` is the next chunk of output.  ``timeout`` is
        how long to wait for the answer, in seconds (None: forever); when it
        runs out the call is cancelled and ``TimeoutError`` raised.  It is not
        the ``bash`` tool's own ``timeout`` argument, which the runner
        enforces and reports in the result.
        """
        request_id = self.start_call(name, arguments, on_progress)
        try:
            return self.wait(request_id, timeout)
        except TimeoutError:
            self.cancel(request_id, "the client stopped waiting")
            self.abandon(request_id)
            raise

    def checkpoint(self, timeout: float | None = 300.0) -> dict:
        """Return once every change made so far is durable (synced to the store).

        Returns ``{"durable": True, "storage": NAME, ...sync statistics}``;
        raises :class:`RpcError` (``data["code"]`` such as
        ``storage_unavailable`` or ``sync_conflict``) when it is not.
        """
        return self.request("corral/checkpoint", {}, timeout)

    def start_call(self, name: str, arguments: dict | None = None, on_progress=None):
        """Send a ``tools/call`` without waiting; return its request id for :meth:`wait`."""
        params = {"name": name, "arguments": {} if arguments is None else arguments}
        request_id = self._new_id()
        if on_progress is not None:
            params["_meta"] = {"progressToken": request_id}
            self._progress[request_id] = on_progress
        self._send_request(request_id, "tools/call", params)
        return request_id

    def cancel(self, request_id, reason: str | None = None) -> None:
        """Ask the runner to stop an in-flight request (its processes are killed).

        The runner still answers the call (for ``bash``, a result whose
        ``structuredContent.cancelled`` is true); :meth:`wait` for it if the
        output so far matters.
        """
        params = {"requestId": request_id}
        if reason is not None:
            params["reason"] = reason
        self.notify("notifications/cancelled", params)

    # -- JSON-RPC ------------------------------------------------------

    def request(self, method: str, params: dict | None = None, timeout: float | None = None):
        """Send a request and return its result; raise :class:`RpcError` on an error answer."""
        request_id = self._new_id()
        self._send_request(request_id, method, params)
        return self.wait(request_id, timeout)

    def send_request(self, method: str, params: dict | None = None):
        """Send a request without waiting; return its id for :meth:`wait`."""
        request_id = self._new_id()
        self._send_request(request_id, method, params)
        return request_id

    def notify(self, method: str, params: dict | None = None) -> None:
        """Send a notification (no answer comes)."""
        message = {"jsonrpc": "2.0", "method": method}
        if params is not None:
            message["params"] = params
        self._send(message)

    def wait(self, request_id, timeout: float | None = None):
        """Wait for the answer to ``request_id``; return its result or raise :class:`RpcError`.

        Other messages that arrive meanwhile are dispatched (see the class
        docstring).  Raises ``TimeoutError`` after ``timeout`` seconds (the
        request stays pending: wait again, or :meth:`cancel` it), and
        :class:`ConnectionClosed` if the connection ends first.
        """
        if request_id not in self._pending:
            raise ValueError(f"request {request_id!r} is not in flight on this session")
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while request_id not in self._answers:
                self._read_messages(deadline, request_id)
        except TimeoutError:
            raise TimeoutError(
                f"no answer to request {request_id} within {timeout:g} s"
            ) from None
        self._pending.discard(request_id)
        self._progress.pop(request_id, None)
        answer = self._answers.pop(request_id)
        if "error" in answer:
            error = answer["error"]
            if not isinstance(error, dict):
                raise ProtocolError(f"malformed error answer to request {request_id}: {answer!r}")
            raise RpcError(error.get("code"), error.get("message", ""), error.get("data"))
        return answer.get("result")

    def abandon(self, request_id) -> None:
        """Stop tracking ``request_id``: its answer, when it comes, is dropped."""
        self._pending.discard(request_id)
        self._progress.pop(request_id, None)
        self._answers.pop(request_id, None)

    def close(self) -> None:
        """Close the connection; the supervisor kills every process the runner started."""
        try:
            self.sock.close()
        finally:
            self._pending.clear()
            self._progress.clear()
            self._answers.clear()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # -- internals -----------------------------------------------------

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def _send_request(self, request_id, method: str, params) -> None:
        message = {"jsonrpc": "2.0", "id": request_id, "method": method}
        if params is not None:
            message["params"] = params
        self._pending.add(request_id)
        try:
            self._send(message)
        except BaseException:
            self.abandon(request_id)
            raise

    def _send(self, message: dict) -> None:
        """Send one message as one line.

        Usually one ``send``.  When the socket is full, what arrives meanwhile
        is read into the buffer while waiting: a runner blocked writing to us
        stops reading from us, and both would wait forever.
        """
        data = json.dumps(message, separators=(",", ":")).encode() + b"\n"
        sock = self.sock
        self._set_timeout(None)
        view = memoryview(data)
        try:
            while view:
                try:
                    view = view[sock.send(view, socket.MSG_DONTWAIT):]
                except BlockingIOError:
                    self._read_while_sending()
        except (BrokenPipeError, ConnectionResetError):
            raise ConnectionClosed(
                "the connection to the runner is closed (the runner exited or the "
                "supervisor stopped); connect again"
            ) from None

    def _read_while_sending(self) -> None:
        import select

        poller = select.poll()
        poller.register(self.sock, select.POLLOUT if self._eof else select.POLLIN | select.POLLOUT)
        for _, events in poller.poll():
            if events & select.POLLIN and not self._eof:
                try:
                    chunk = self.sock.recv(_READ_SIZE, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    return
                if chunk:
                    self._buffer += chunk
                else:
                    self._eof = True

    def _set_timeout(self, timeout) -> None:
        # gettimeout() is free; settimeout() may cost a system call.
        if timeout != self.sock.gettimeout():
            self.sock.settimeout(timeout)

    def _read_messages(self, deadline, waiting_for) -> None:
        """Dispatch every whole line in the buffer; if there is none, read once from the socket."""
        buffer = self._buffer
        end = buffer.find(b"\n", self._scanned)
        if end < 0:
            # Remember how far there is no newline: a long line (an image, a
            # large file) arrives in many reads and is scanned only once.
            self._scanned = len(buffer)
            if self._eof:
                raise ConnectionClosed(
                    f"the runner closed the connection before answering request {waiting_for} "
                    "(it exited, or the supervisor stopped)"
                )
            if deadline is None:
                self._set_timeout(None)
            else:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError()
                self._set_timeout(remaining)
            try:
                chunk = self.sock.recv(_READ_SIZE)
            except ConnectionResetError:
                chunk = b""
            if chunk:
                buffer += chunk
            else:
                self._eof = True
            return
        start = 0
        try:
            while end >= 0:
                line = buffer[start:end]
                start = end + 1
                if line and not line.isspace():
                    self._dispatch(line)
                end = buffer.find(b"\n", start)
        finally:
            # Even when a handler raises (Ctrl-C in on_progress), a line is
            # dispatched at most once.
            del buffer[:start]
            self._scanned = 0 if end >= 0 else len(buffer)

    def _dispatch(self, line: bytearray) -> None:
        try:
            message = json.loads(line)
        except ValueError:
            shown = line[:200].decode("utf-8", "replace")
            raise ProtocolError(f"the runner sent a line that is not JSON: {shown!r}") from None
        if not isinstance(message, dict):
            raise ProtocolError(f"the runner sent a message that is not an object: {message!r}")
        method = message.get("method")
        if method is None:
            request_id = message.get("id")
            if request_id in self._pending:
                self._answers[request_id] = message
            elif request_id is None and "error" in message:
                # An error the runner could not tie to a request (a line it could
                # not parse): it concerns something this session sent.
                error = message["error"] if isinstance(message["error"], dict) else {}
                raise RpcError(error.get("code"), error.get("message", ""), error.get("data"))
            # Otherwise an answer to a request given up on: dropped.
            return
        if "id" in message:
            # A request from the server; corral's runner sends none.
            self._send(
                {
                    "jsonrpc": "2.0",
                    "id": message["id"],
                    "error": {"code": METHOD_NOT_FOUND, "message": f"Method not found: {method}"},
                }
            )
            return
        if method == "notifications/progress":
            params = message.get("params") or {}
            handler = self._progress.get(params.get("progressToken"))
            if handler is not None:
                handler(params)
                return
        if self.on_notification is not None:
            self.on_notification(message)


def _open(socket_path, hello_line: bytes, timeout):
    """Connect and send the hello; return (socket, reply, bytes received after the reply)."""
    path = socket_path or default_socket()
    deadline = None if timeout is None else time.monotonic() + timeout
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        try:
            sock.connect(path)
        except OSError as error:
            raise _unreachable(path, error) from None
        try:
            sock.sendall(hello_line)
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused before reading the hello: the reply says why
        buffer = bytearray()
        while True:
            end = buffer.find(b"\n")
            if end >= 0:
                break
            if len(buffer) > MAX_REPLY_BYTES:
                raise ProtocolError(
                    f"{path} sent more than {MAX_REPLY_BYTES} bytes without a newline: "
                    "is it a corral socket?"
                )
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(
                        f"no reply from the supervisor at {path} within {timeout:g} s"
                    )
                sock.settimeout(remaining)
            try:
                chunk = sock.recv(_READ_SIZE)
            except TimeoutError:
                raise TimeoutError(
                    f"no reply from the supervisor at {path} within {timeout:g} s"
                ) from None
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                raise ConnectionClosed(
                    f"the supervisor at {path} closed the connection without replying to the "
                    "hello; see its log"
                )
            buffer += chunk
        reply = _parse_reply(bytes(buffer[:end]), path)
        sock.settimeout(None)
        return sock, reply, bytes(buffer[end + 1:])
    except BaseException:
        sock.close()
        raise


def _parse_reply(line: bytes, path: str) -> dict:
    try:
        reply = json.loads(line)
    except ValueError:
        raise ProtocolError(
            f"the reply from {path} is not JSON: {line[:200]!r}; is it a corral socket?"
        ) from None
    if not isinstance(reply, dict) or not isinstance(reply.get("ok"), bool):
        raise ProtocolError(f"the reply from {path} is not a corral reply: {line[:200]!r}")
    if not reply["ok"]:
        error = reply.get("error")
        if not isinstance(error, dict):
            error = {}
        raise HelloRefused(
            str(error.get("code", INTERNAL)), str(error.get("message", "no reason given"))
        )
    return reply


def admin_request(socket_path, request: dict, timeout: float | None = 600.0) -> dict:
    """Send one administrative request (``{"admin": "delete", "owner": ...}``); return its result.

    Raises :class:`HelloRefused` (``forbidden`` for a caller that is not
    root, the supervisor's user or in ``admin_group``).
    """
    line = json.dumps({"corral": HELLO_VERSION, **request}).encode() + b"\n"
    sock, reply, _ = _open(socket_path, line, timeout)
    sock.close()
    return reply.get("result", {})


# -- the commands ------------------------------------------------------------


def _connect_for_command(command, socket_path, owner, conversation):
    """Connect for a ``corral`` command; on failure print why and return None."""
    try:
        return Session.connect(socket_path, owner, conversation)
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    except HelloRefused as refusal:
        print(f"corral {command}: {refusal.code}: {refusal.message}", file=sys.stderr)
    except (OSError, ProtocolError) as error:
        print(f"corral {command}: {error}", file=sys.stderr)
    return None


def _write_all(fd: int, data) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def relay_main(socket_path: str, owner: str, conversation: str) -> int:
    """``corral relay``: join stdin and stdout to a conversation's runner, byte for byte.

    This is what an MCP client starts as its stdio server.  Returns 2 when
    the hello is refused or the supervisor cannot be reached (the reason on
    stderr), else 0 once the runner's side of the connection has closed.
    End of file on stdin half-closes the connection; output keeps flowing
    until the other side closes.
    """
    session = _connect_for_command("relay", socket_path, owner, conversation)
    if session is None:
        return 2
    import threading

    sock = session.sock
    stdin_fd, stdout_fd = sys.stdin.fileno(), sys.stdout.fileno()

    def copy_stdin() -> None:
        """Copy stdin to the socket; at its end, half-close the connection."""
        try:
            while True:
                data = os.read(stdin_fd, _READ_SIZE)
                if not data:
                    break
                sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the connection is gone; the main thread sees it close

    threading.Thread(target=copy_stdin, name="corral-relay-stdin", daemon=True).start()
    try:
        if session._buffer:
            _write_all(stdout_fd, session._buffer)
        while True:
            try:
                data = sock.recv(_READ_SIZE)
            except ConnectionResetError:
                break
            if not data:
                break
            _write_all(stdout_fd, data)
    except BrokenPipeError:
        pass  # whoever read our stdout is gone
    except KeyboardInterrupt:
        return 130
    finally:
        sock.close()
    return 0


def _exit_status(structured: dict) -> int:
    """The shell-style exit status a bash result stands for."""
    if structured.get("timedOut"):
        return 124
    if structured.get("cancelled"):
        return 130
    signal_number = structured.get("signal")
    if isinstance(signal_number, int) and signal_number > 0:
        return 128 + signal_number
    code = structured.get("exitCode")
    if isinstance(code, int) and not isinstance(code, bool):
        if code < 0:  # a subprocess-style "killed by signal -code"
            return 128 - code
        return code & 0xFF
    return 1


def _result_text(result: dict) -> str:
    """The text items of a CallToolResult, joined."""
    return "".join(
        item.get("text", "") for item in result.get("content") or () if item.get("type") == "text"
    )


def _bash_output(result: dict) -> str:
    """The command's output in a bash result, without the notes the runner appends.

    The runner shows ``(no output)`` for an empty output, and after a
    non-zero exit, a signal, a timeout, a cancel or a cut adds its notes
    after a blank line, in place of the output's trailing newlines.
    """
    text = _result_text(result)
    structured = result.get("structuredContent") or {}
    noted = (
        structured.get("truncated")
        or structured.get("timedOut")
        or structured.get("cancelled")
        or structured.get("signal")
        or structured.get("exitCode")
    )
    if not noted:
        return "" if text == "(no output)" else text
    cut = text.rfind("\n\n")
    return "" if cut < 0 else text[:cut] + "\n"


class _ExecOutput:
    """Writes a bash call's output to stdout as progress notifications bring it.

    corral's runner streams every byte of a command's output in progress
    notifications when the call carries a progress token; a server that
    streams nothing gets its result's text written at the end instead.
    """

    def __init__(self, fd: int = 1) -> None:
        self.fd = fd
        self.streamed = False

    def on_progress(self, params: dict) -> None:
        """Write the output one progress notification carries."""
        text = params.get("message")
        if isinstance(text, str) and text:
            self.streamed = True
            _write_all(self.fd, text.encode("utf-8", "replace"))

    def finish(self, result: dict) -> None:
        """Write the result's output if nothing was streamed."""
        if not self.streamed:
            _write_all(self.fd, _bash_output(result).encode("utf-8", "replace"))


def exec_main(
    socket_path: str, owner: str, conversation: str, argv: list, timeout: float | None
) -> int:
    """``corral exec``: run ``argv`` in the conversation; exit with its status.

    Output (stdout and stderr together) streams to stdout as it arrives.
    Returns the command's exit code, 124 when it timed out, 128+N when
    signal N killed it, 130 after Ctrl-C (the command is cancelled), and 2
    when the workspace could not be used (the reason on stderr).
    """
    import shlex

    session = _connect_for_command("exec", socket_path, owner, conversation)
    if session is None:
        return 2
    output = _ExecOutput()
    with session:
        arguments = {"command": shlex.join(argv)}
        if timeout is not None:
            arguments["timeout"] = timeout
        request_id = None
        try:
            session.initialize()
            request_id = session.start_call("bash", arguments, output.on_progress)
            result = session.wait(request_id)
        except KeyboardInterrupt:
            if request_id is not None:
                try:
                    session.cancel(request_id, "interrupted (Ctrl-C)")
                    session.wait(request_id, timeout=2.0)
                except (KeyboardInterrupt, Exception):
                    pass
            return 130
        except BrokenPipeError:
            # Whoever read our stdout is gone: stop the command, as SIGPIPE would.
            try:
                session.cancel(request_id, "the output is no longer read")
            except OSError:
                pass
            return 128 + 13
        except RpcError as error:
            print(f"corral exec: {error.message}", file=sys.stderr)
            return 2
        except (OSError, ProtocolError) as error:
            print(f"corral exec: {error}", file=sys.stderr)
            return 2
        structured = result.get("structuredContent") or {}
        if "exitCode" not in structured or structured.get("error"):
            # Not a result of a command that ran (it could not start).
            print(f"corral exec: {_result_text(result)}", file=sys.stderr)
            return 1 if result.get("isError") else 0
        try:
            output.finish(result)
        except BrokenPipeError:
            pass
        return _exit_status(structured)


def call_main(
    socket_path: str, owner: str, conversation: str, tool: str, arguments_json: str
) -> int:
    """``corral call``: call one tool and print its CallToolResult as JSON.

    Returns 0, 1 when the result is an error (``isError``), and 2 when the
    arguments are not a JSON object, the call is invalid, or the workspace
    could not be used (the reason on stderr).
    """
    try:
        arguments = json.loads(arguments_json)
    except ValueError as error:
        print(
            f"corral call: the arguments are not valid JSON ({error}); give an object "
            """like '{"command": "ls"}'""",
            file=sys.stderr,
        )
        return 2
    if not isinstance(arguments, dict):
        print(
            f"corral call: the arguments must be a JSON object, not {type(arguments).__name__}",
            file=sys.stderr,
        )
        return 2
    session = _connect_for_command("call", socket_path, owner, conversation)
    if session is None:
        return 2
    with session:
        try:
            session.initialize()
            result = session.call_tool(tool, arguments)
        except KeyboardInterrupt:
            return 130
        except RpcError as error:
            print(f"corral call: {error.message}", file=sys.stderr)
            return 2
        except (OSError, ProtocolError) as error:
            print(f"corral call: {error}", file=sys.stderr)
            return 2
    sys.stdout.write(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    sys.stdout.flush()
    return 1 if result.get("isError") else 0


def admin_main(command: str, socket_path: str, request: dict) -> int:
    """``corral delete`` and ``corral cleanup``: print the result as JSON; 2 on failure."""
    try:
        result = admin_request(socket_path, request)
    except KeyboardInterrupt:
        return 130
    except HelloRefused as refusal:
        print(f"corral {command}: {refusal.code}: {refusal.message}", file=sys.stderr)
        return 2
    except (OSError, ProtocolError) as error:
        print(f"corral {command}: {error}", file=sys.stderr)
        return 2
    sys.stdout.write(json.dumps(result, indent=2) + "\n")
    return 0


def checkpoint_main(socket_path: str, owner: str, conversation: str) -> int:
    """``corral checkpoint``: attach, make the conversation's files durable, print the result."""
    session = _connect_for_command("checkpoint", socket_path, owner, conversation)
    if session is None:
        return 2
    with session:
        try:
            session.initialize()
            result = session.checkpoint()
        except KeyboardInterrupt:
            return 130
        except RpcError as error:
            print(f"corral checkpoint: {error.message}", file=sys.stderr)
            return 1
        except (OSError, ProtocolError) as error:
            print(f"corral checkpoint: {error}", file=sys.stderr)
            return 2
    sys.stdout.write(json.dumps(result, indent=2) + "\n")
    return 0
