"""The runner's JSON-RPC 2.0 server: MCP's stdio transport on stdin and stdout.

One message per line in both directions.  The main thread reads and answers
``initialize``, ``ping`` and ``tools/list`` itself; every ``tools/call`` runs
in a thread of its own so that several can be in flight, and all writes go
through one lock so each message leaves as one whole line.

Only ``json``, ``os`` and ``sys`` are imported here, with the built-in
``_thread`` and ``_signal`` instead of ``threading`` and ``signal`` (whose
imports cost about a millisecond, some 6% of start-up): the runner starts
once per conversation and must answer its first message quickly.  The tools
live in :mod:`runner.tools` and are imported on first use.
"""

import _signal
import _thread
import json
import os
import sys

from runner import __version__

#: Protocol versions this server speaks, newest first.
PROTOCOL_VERSIONS = ("2025-11-25", "2025-06-18", "2025-03-26", "2024-11-05")

#: A request line longer than this is answered with an error and discarded.
MAX_LINE_BYTES = 16 * 1024 * 1024

PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603

_READ_SIZE = 256 * 1024

USAGE = """\
usage: runner --workspace DIR [--bash-timeout SECONDS] [--bash-max-timeout SECONDS]
              [--max-output-lines N] [--max-output-bytes N]
              [--max-read-bytes N] [--max-edit-bytes N] [--subreaper] [--setsid]
              [--oom-events FILE] [--memory-limit N] [--no-userns]
              [--max-spill-bytes N] [--events-fd FD --answers-fd FD [--change-events]]

  --max-read-bytes N  read refuses text files larger than N bytes (default 67108864, 64 MiB)
  --max-edit-bytes N  edit refuses files larger than N bytes (default 16777216, 16 MiB)
  --oom-events FILE   the conversation cgroup's file with an "oom_kill N" line
                      (memory.events or memory.oom_control): bash says when the
                      out-of-memory killer struck during a command
  --memory-limit N    the conversation's memory limit in bytes, for that message
  --no-userns         commands cannot create user namespaces (a seccomp filter)
  --max-spill-bytes N bash saves at most N bytes of a long output to its file
                      (default 268435456, 256 MiB)
  --events-fd FD      the side channel to the supervisor: the runner writes a line
                      there when a tool call that may have changed files ends, and
                      forwards corral/checkpoint requests
  --answers-fd FD     where the supervisor answers checkpoints
  --change-events     also write a line on the events fd after each bash, write or
                      edit call (the supervisor syncs the workspace soon after)
"""

#: The side channel's messages (one JSON line each; see docs/protocol.md).
CHANGED_EVENT = b'{"event":"changed"}\n'
#: Tools whose calls may change files.
CHANGING_TOOLS = frozenset({"bash", "write", "edit"})
#: JSON-RPC error code of a checkpoint that could not be made durable.
CHECKPOINT_FAILED = -32001
#: Checkpoints one runner may have waiting at once.
MAX_PENDING_CHECKPOINTS = 64


class UsageError(Exception):
    """The command line could not be understood."""


class Options:
    """The runner's settings, from its command line."""

    # The size caps equal runner.files.DEFAULT_MAX_READ_BYTES and
    # DEFAULT_MAX_EDIT_BYTES, spelled out so that start-up need not import the tools.
    def __init__(self, workspace, bash_timeout=120.0, bash_max_timeout=3600.0,
                 max_output_lines=2000, max_output_bytes=51200,
                 max_read_bytes=64 * 1024 * 1024, max_edit_bytes=16 * 1024 * 1024,
                 subreaper=False, setsid=False, oom_events=None, memory_limit=None,
                 no_userns=False, max_spill_bytes=256 * 1024 * 1024,
                 events_fd=None, answers_fd=None, change_events=False):
        self.workspace = workspace
        self.bash_timeout = bash_timeout
        self.bash_max_timeout = bash_max_timeout
        self.max_output_lines = max_output_lines
        self.max_output_bytes = max_output_bytes
        #: read refuses a text file larger than this many bytes.
        self.max_read_bytes = max_read_bytes
        #: edit refuses a file larger than this many bytes.
        self.max_edit_bytes = max_edit_bytes
        self.subreaper = subreaper
        self.setsid = setsid
        #: A cgroup file whose "oom_kill N" line counts out-of-memory kills.
        self.oom_events = oom_events
        #: The conversation's memory limit in bytes, when one is known.
        self.memory_limit = memory_limit
        #: Refuse new user namespaces to everything the tools start (seccomp).
        self.no_userns = no_userns
        #: bash saves at most this many bytes of a long output to its file.
        self.max_spill_bytes = max_spill_bytes
        #: The side channel: events to the supervisor, its answers back (or None).
        self.events_fd = events_fd
        self.answers_fd = answers_fd
        #: Tell the supervisor after each call that may have changed files.
        self.change_events = change_events


# option -> (attribute, type); every one takes a value that must be positive.
_VALUE_OPTIONS = {
    "--workspace": ("workspace", str),
    "--bash-timeout": ("bash_timeout", float),
    "--bash-max-timeout": ("bash_max_timeout", float),
    "--max-output-lines": ("max_output_lines", int),
    "--max-output-bytes": ("max_output_bytes", int),
    "--max-read-bytes": ("max_read_bytes", int),
    "--max-edit-bytes": ("max_edit_bytes", int),
    "--oom-events": ("oom_events", str),
    "--memory-limit": ("memory_limit", int),
    "--max-spill-bytes": ("max_spill_bytes", int),
    "--events-fd": ("events_fd", int),
    "--answers-fd": ("answers_fd", int),
}
_FLAG_OPTIONS = {"--subreaper": "subreaper", "--setsid": "setsid", "--no-userns": "no_userns",
                 "--change-events": "change_events"}


def parse_options(argv):
    """Turn the command line into :class:`Options`; raise :class:`UsageError` if it is wrong.

    Accepts ``--name value`` and ``--name=value``.  A hand parser, because
    importing argparse would cost about as much as the rest of start-up.
    """
    values = {}
    arguments = iter(argv)
    for argument in arguments:
        name, equals, value = argument.partition("=")
        if name in _FLAG_OPTIONS and not equals:
            values[_FLAG_OPTIONS[name]] = True
            continue
        if name not in _VALUE_OPTIONS:
            raise UsageError(f"unknown argument {argument!r}")
        if not equals:
            value = next(arguments, None)
            if value is None:
                raise UsageError(f"{name} needs a value")
        attribute, kind = _VALUE_OPTIONS[name]
        try:
            converted = kind(value)
        except ValueError:
            raise UsageError(f"{name} must be a {kind.__name__}, not {value!r}") from None
        if kind is not str and not 0 < converted < float("inf"):
            raise UsageError(f"{name} must be a positive number, not {value!r}")
        if kind is str and not converted:
            raise UsageError(f"{name} must not be empty")
        values[attribute] = converted
    if "workspace" not in values:
        raise UsageError("--workspace DIR is required")
    if ("events_fd" in values) != ("answers_fd" in values):
        raise UsageError("--events-fd and --answers-fd go together")
    if values.get("change_events") and "events_fd" not in values:
        raise UsageError("--change-events needs --events-fd")
    values["workspace"] = os.path.abspath(values["workspace"])
    return Options(**values)


class RequestError(Exception):
    """A request that gets a JSON-RPC error answer instead of a result."""

    def __init__(self, code, message):
        super().__init__(message)
        self.code = code
        self.message = message


def _brief(value, limit=80):
    """repr(value), shortened so that an error never echoes a huge input back."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _id_key(request_id):
    """A dictionary key for a request id that keeps 1 and "1" apart."""
    return (type(request_id) is str, request_id)


class Server:
    """Reads requests from one file descriptor and answers on another."""

    def __init__(self, options, in_fd=0, out_fd=1):
        self.options = options
        self.in_fd = in_fd
        self.out_fd = out_fd
        self.closing = False
        self._write_lock = _thread.allocate_lock()
        self._calls = {}
        self._calls_lock = _thread.allocate_lock()
        # Held while any call is in flight (answer not yet sent), so end of
        # input can wait for the answers a half-closed client still reads.
        self._in_flight = 0
        self._idle = _thread.allocate_lock()
        self._requests = {
            "initialize": self._initialize,
            "ping": self._ping,
            "tools/list": self._list_tools,
            "tools/call": self._call_tool,
            "corral/checkpoint": self._checkpoint,
        }
        # Checkpoints forwarded to the supervisor: token -> request id.
        self._checkpoints = {}
        self._checkpoint_tokens = 0
        # The supervisor closed the answers pipe: no checkpoint can be answered.
        self._answers_closed = False

    # -- output ---------------------------------------------------------

    def send(self, message):
        """Write one message as one line; on a closed stdout, shut down and exit."""
        data = (json.dumps(message, separators=(",", ":")) + "\n").encode()
        with self._write_lock:
            if self.closing:
                return
            view = memoryview(data)
            try:
                while view:
                    view = view[os.write(self.out_fd, view):]
            except BrokenPipeError:
                # Nobody is listening any more: nothing to report, nothing to keep.
                self.shutdown()
                os._exit(0)

    def send_error(self, request_id, code, message):
        """Answer request_id (None when it is unknown) with a JSON-RPC error."""
        self.send({"jsonrpc": "2.0", "id": request_id,
                   "error": {"code": code, "message": message}})

    # -- input ----------------------------------------------------------

    def serve(self):
        """Handle input lines until end of file.

        Lines are split by hand on raw reads so that an over-long line can be
        answered and skipped without ever being held in memory whole.
        """
        pending = bytearray()
        discarding = False
        while True:
            chunk = os.read(self.in_fd, _READ_SIZE)
            if not chunk:
                break
            start = 0
            while True:
                end = chunk.find(b"\n", start)
                stop = len(chunk) if end < 0 else end
                if not discarding and len(pending) + stop - start > MAX_LINE_BYTES:
                    pending.clear()
                    discarding = True
                    self.send_error(None, INVALID_REQUEST,
                                    f"Invalid Request: the line is longer than {MAX_LINE_BYTES} "
                                    "bytes and was discarded.")
                if end < 0:
                    if not discarding:
                        pending += chunk[start:]
                    break
                if discarding:
                    discarding = False
                elif pending:
                    pending += chunk[start:end]
                    self.handle_line(pending)
                    pending.clear()
                else:
                    self.handle_line(chunk[start:end])
                start = end + 1
        if pending and not discarding:
            self.handle_line(pending)

    def handle_line(self, line):
        """Parse one line and handle the message in it; blank lines are ignored."""
        if not line.strip():
            return
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as error:
            self.send_error(None, PARSE_ERROR,
                            f"Parse error: the line is not valid UTF-8 "
                            f"({error.reason} at byte {error.start}).")
            return
        try:
            message = json.loads(text)
        except (ValueError, RecursionError) as error:
            self.send_error(None, PARSE_ERROR,
                            f"Parse error: the line is not valid JSON ({error}).")
            return
        try:
            self.handle_message(message)
        except Exception as error:  # never let one message take the runner down
            self._log_exception()
            request_id = message.get("id") if isinstance(message, dict) else None
            if not isinstance(request_id, (str, int)) or isinstance(request_id, bool):
                request_id = None
            self.send_error(request_id, INTERNAL_ERROR, f"Internal error: {error}")

    def handle_message(self, message):
        """Check that message is a JSON-RPC 2.0 request or notification and dispatch it."""
        if isinstance(message, list):
            self.send_error(None, INVALID_REQUEST,
                            "Invalid Request: batches (JSON arrays) are not supported; "
                            "send one message per line.")
            return
        if not isinstance(message, dict):
            self.send_error(None, INVALID_REQUEST,
                            "Invalid Request: a message must be a JSON object.")
            return
        has_id = "id" in message
        request_id = message.get("id")
        id_ok = isinstance(request_id, (str, int)) and not isinstance(request_id, bool)
        answer_id = request_id if id_ok else None
        if message.get("jsonrpc") != "2.0":
            self.send_error(answer_id, INVALID_REQUEST, 'Invalid Request: "jsonrpc" must be "2.0".')
            return
        method = message.get("method")
        if method is None and ("result" in message or "error" in message):
            # A response. This server sends no requests, so there is nothing to
            # match it to, and a response must never be answered.
            return
        if not isinstance(method, str):
            self.send_error(answer_id, INVALID_REQUEST,
                            'Invalid Request: "method" must be a string.')
            return
        if has_id and not id_ok:
            self.send_error(None, INVALID_REQUEST,
                            'Invalid Request: "id" must be a string or an integer.')
            return
        params = message.get("params")
        if params is None:
            params = {}
        if not has_id:
            if isinstance(params, dict):
                self._handle_notification(method, params)
            return
        handler = self._requests.get(method)
        if handler is None:
            self.send_error(request_id, METHOD_NOT_FOUND, f"Method not found: {_brief(method)}.")
            return
        if not isinstance(params, dict):
            code = INVALID_PARAMS if isinstance(params, list) else INVALID_REQUEST
            self.send_error(request_id, code,
                            f'Invalid params: "params" of {method} must be an object.')
            return
        try:
            result = handler(request_id, params)
        except RequestError as error:
            self.send_error(request_id, error.code, error.message)
            return
        if result is not None:
            self.send({"jsonrpc": "2.0", "id": request_id, "result": result})

    def _handle_notification(self, method, params):
        """Act on a notification; unknown ones are ignored, as JSON-RPC requires."""
        if method == "notifications/cancelled":
            request_id = params.get("requestId")
            if isinstance(request_id, (str, int)) and not isinstance(request_id, bool):
                with self._calls_lock:
                    call = self._calls.get(_id_key(request_id))
                if call is not None:
                    reason = params.get("reason")
                    call.cancel(reason if isinstance(reason, str) else None)

    # -- requests -------------------------------------------------------

    def _initialize(self, request_id, params):
        """Negotiate the protocol version and describe this server."""
        requested = params.get("protocolVersion")
        if requested is not None and not isinstance(requested, str):
            raise RequestError(INVALID_PARAMS,
                               'Invalid params: "protocolVersion" must be a string.')
        version = requested if requested in PROTOCOL_VERSIONS else PROTOCOL_VERSIONS[0]
        return {
            "protocolVersion": version,
            "capabilities": {"tools": {"listChanged": False}},
            "serverInfo": {"name": "corral", "version": __version__},
            "instructions": (
                f"Tools run in the conversation workspace {self.options.workspace}, which is "
                "also the working directory. bash runs a shell command (stdout and stderr "
                "together); read, write and edit work on files. Relative paths resolve "
                "against the workspace."
            ),
        }

    def _ping(self, request_id, params):
        """Answer a liveness check."""
        return {}

    def _list_tools(self, request_id, params):
        """List the four tools with their input schemas."""
        from runner import tools

        return {"tools": tools.tool_definitions(self.options)}

    def _call_tool(self, request_id, params):
        """Check a tools/call and start it in a thread of its own; it answers when done."""
        from runner import tools

        name = params.get("name")
        arguments = params.get("arguments")
        try:
            tools.check_arguments(name, {} if arguments is None else arguments)
        except tools.InvalidArguments as error:
            raise RequestError(INVALID_PARAMS, str(error)) from None
        meta = params.get("_meta")
        token = meta.get("progressToken") if isinstance(meta, dict) else None
        progress = None
        if isinstance(token, (str, int)) and not isinstance(token, bool):
            progress = self._progress_sender(token)
        call = tools.Call(self.options, progress)
        key = _id_key(request_id)
        with self._calls_lock:
            if key in self._calls:
                raise RequestError(INVALID_REQUEST,
                                   f"Invalid Request: id {_brief(request_id)} is already used "
                                   "by a call in flight.")
            self._calls[key] = call
            if self._in_flight == 0:
                self._idle.acquire()
            self._in_flight += 1
        try:
            _thread.start_new_thread(self._run_call, (request_id, key, call, name, arguments or {}))
        except RuntimeError as error:  # out of threads: the process limit counts them too
            with self._calls_lock:
                del self._calls[key]
            self._call_finished()
            raise RequestError(INTERNAL_ERROR, f"Internal error: cannot start the call ({error}); "
                                               "try again when fewer processes run.") from None
        return None

    def _run_call(self, request_id, key, call, name, arguments):
        """Run one tool call (in its own thread) and send its answer."""
        from runner import tools

        try:
            result = tools.run(name, arguments, call)
        except Exception as error:
            self._log_exception()
            message = {"jsonrpc": "2.0", "id": request_id,
                       "error": {"code": INTERNAL_ERROR, "message": f"Internal error: {error}"}}
        else:
            message = {"jsonrpc": "2.0", "id": request_id, "result": result}
        finally:
            # Forget the id before answering: a client may reuse it at once.
            with self._calls_lock:
                del self._calls[key]
        # Before the answer: a checkpoint the client sends on reading it then
        # finds the notice already there, and one sync covers both.
        if name in CHANGING_TOOLS:
            self.notify_changed()
        try:
            self.send(message)
        finally:
            self._call_finished()

    def _call_finished(self):
        with self._calls_lock:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.release()

    def wait_for_calls(self):
        """Block until every call in flight has sent its answer."""
        with self._idle:
            pass

    # -- the side channel to the supervisor -------------------------------

    def notify_changed(self):
        """Tell the supervisor that files may have changed (it syncs them soon).

        Never blocks: the events pipe is non-blocking and a full pipe means
        the supervisor already has a notice to act on.
        """
        if self.options.change_events:
            try:
                os.write(self.options.events_fd, CHANGED_EVENT)
            except OSError:
                pass

    def _checkpoint(self, request_id, params):
        """Forward a checkpoint to the supervisor; the answer comes when the files are durable."""
        if self.options.events_fd is None:
            raise RequestError(METHOD_NOT_FOUND,
                               "Method not found: corral/checkpoint needs the runner to be "
                               "started by a corral supervisor.")
        with self._calls_lock:
            if self._answers_closed:
                raise RequestError(CHECKPOINT_FAILED, "Checkpoint failed: the supervisor "
                                                      "closed the side channel.")
            if len(self._checkpoints) >= MAX_PENDING_CHECKPOINTS:
                raise RequestError(INVALID_REQUEST,
                                   f"Invalid Request: {MAX_PENDING_CHECKPOINTS} checkpoints "
                                   "are already waiting; wait for their answers.")
            self._checkpoint_tokens += 1
            token = self._checkpoint_tokens
            self._checkpoints[token] = request_id
            if self._in_flight == 0:
                self._idle.acquire()
            self._in_flight += 1
        line = (json.dumps({"event": "checkpoint", "token": token}) + "\n").encode()
        try:
            os.write(self.options.events_fd, line)
        except OSError as error:
            self._answer_checkpoint(token, {"ok": False, "code": "unavailable",
                                            "message": f"the supervisor cannot be told ({error})"})
        return None

    def read_answers(self):
        """Read the supervisor's checkpoint answers (a thread); at end of file, fail what waits."""
        pending = b""
        while True:
            try:
                chunk = os.read(self.options.answers_fd, 65536)
            except OSError:
                chunk = b""
            if not chunk:
                break
            *lines, pending = (pending + chunk).split(b"\n")
            pending = pending[-65536:]
            for line in lines:
                try:
                    answer = json.loads(line)
                    token = answer["checkpoint"]
                except (ValueError, KeyError, TypeError):
                    continue
                if type(token) is int:  # the pipe is the supervisor's, but check anyway
                    self._answer_checkpoint(token, answer)
        with self._calls_lock:
            self._answers_closed = True
            tokens = list(self._checkpoints)
        for token in tokens:
            self._answer_checkpoint(token, {"ok": False, "code": "unavailable",
                                            "message": "the supervisor closed the side channel"})

    def _answer_checkpoint(self, token, answer):
        """Send the client the answer to checkpoint ``token`` (once)."""
        with self._calls_lock:
            request_id = self._checkpoints.pop(token, None)
        if request_id is None:
            return
        try:
            if answer.get("ok") is True:
                result = answer.get("result")
                self.send({"jsonrpc": "2.0", "id": request_id,
                           "result": {"durable": True,
                                      **(result if isinstance(result, dict) else {})}})
            else:
                code = answer.get("code")
                message = answer.get("message")
                self.send({"jsonrpc": "2.0", "id": request_id,
                           "error": {"code": CHECKPOINT_FAILED,
                                     "message": "Checkpoint failed: " + (
                                         message if isinstance(message, str)
                                         else "the changes are not durable"),
                                     "data": {"code": code if isinstance(code, str)
                                              else "internal"}}})
        finally:
            self._call_finished()

    def _progress_sender(self, token):
        """A function that sends a progress notification for token."""

        def send_progress(progress, text):
            self.send({"jsonrpc": "2.0", "method": "notifications/progress",
                       "params": {"progressToken": token, "progress": progress, "message": text}})

        return send_progress

    # -- shutting down --------------------------------------------------

    def shutdown(self):
        """Stop answering and kill every process the tools started.

        Safe to call more than once and from any thread.
        """
        self.closing = True
        bash = sys.modules.get("runner.bash")
        if bash is not None:  # no bash call, no processes to kill
            bash.kill_all()

    @staticmethod
    def _log_exception():
        """Describe the exception being handled on stderr."""
        import traceback

        traceback.print_exc(file=sys.stderr)


def main(argv):
    """Run the runner with command-line arguments argv; return the exit status."""
    try:
        options = parse_options(argv)
    except UsageError as error:
        sys.stderr.write(f"corral runner: {error}\n{USAGE}")
        return 2
    try:
        os.chdir(options.workspace)
    except OSError as error:
        sys.stderr.write(f"corral runner: cannot enter the workspace {options.workspace}: "
                         f"{error.strerror}\n")
        return 2
    os.umask(0o022)
    if options.setsid:
        try:
            os.setsid()
        except PermissionError:  # already a process group leader
            pass
    for fd in (0, 1):
        os.set_blocking(fd, True)
    for fd in (options.events_fd, options.answers_fd):
        if fd is not None:
            # The tools' commands must not inherit the side channel.
            try:
                os.set_inheritable(fd, False)
            except OSError as error:
                sys.stderr.write(f"corral runner: the side channel fd {fd} is not open: "
                                 f"{error.strerror}\n")
                return 2
    if options.events_fd is not None:
        os.set_blocking(options.events_fd, False)
        os.set_blocking(options.answers_fd, True)
    server = Server(options)
    if options.answers_fd is not None:
        _thread.start_new_thread(server.read_answers, ())
    # Terminating signals are blocked in every thread and taken by one thread
    # with sigwait: a Python handler could miss a signal that arrives just
    # before the main thread blocks in read().  Commands get a clean signal
    # mask when they are spawned.
    signals = {_signal.SIGTERM, _signal.SIGHUP, _signal.SIGINT}
    _signal.pthread_sigmask(_signal.SIG_BLOCK, signals)
    _thread.start_new_thread(_exit_on_signal, (server, signals))
    server.serve()
    # End of input is a half-close: answer the calls already made, then stop.
    server.wait_for_calls()
    server.shutdown()
    return 0


def _exit_on_signal(server, signals):
    """Wait for SIGTERM, SIGHUP or SIGINT; then kill what the tools started and exit 0."""
    _signal.sigwait(signals)
    try:
        server.shutdown()
    finally:
        os._exit(0)
