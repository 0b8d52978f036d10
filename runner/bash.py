"""The bash tool: run a command in its own process group, stream and cap its output.

Each command runs as ``bash -c COMMAND`` in a new session (so its process
group is its own), with stdin from /dev/null and stdout and stderr on one
pipe.  Its environment carries a marker, ``CORRAL_BASH_CALL=<runner>.<call>``,
which lets a timeout, a cancellation or the runner's exit find processes
that left the process group (``setsid``) and the process tree (double fork).

Processes are killed by walking /proc, since /proc/PID/task/*/children is
not built into every kernel.  Every bash this module starts is tracked in
``_jobs`` until it is reaped; spawning, reaping and killing hold ``_lock``,
so a pid is never signalled after it could have been reused.
"""

import os
import select
import signal
import threading
import time

from runner.tools import tool_result

#: Environment variable that marks the processes of one bash call.
MARKER_VARIABLE = "CORRAL_BASH_CALL"
#: After bash exits, how long to keep reading output its background children write.
DRAIN_SECONDS = 0.05
#: Progress notifications are sent at most this often, ...
PROGRESS_INTERVAL = 0.1
#: ... unless this much output is waiting: then at once. Every byte is sent;
#: a client that reads slowly slows the command down, nothing is dropped.
PROGRESS_FLUSH_BYTES = 256 * 1024
#: Without pidfds, how often to look whether bash has exited.
POLL_SECONDS = 0.05

_READ_SIZE = 64 * 1024
_PR_SET_CHILD_SUBREAPER = 36

# Commands run with a raised oom_score_adj, so that when a conversation
# runs out of memory the OOM killer picks a command's process, not the
# runner (often the largest process of a conversation), which then lives to
# report it as a tool error. Raising one's own score needs no privilege
# (lowering the runner's would need CAP_SYS_RESOURCE), and a bash builtin
# costs no exec. On a host-wide shortage tenants' commands also go first.
COMMAND_OOM_SCORE_ADJ = 500
_OOM_RESET = f"echo {COMMAND_OOM_SCORE_ADJ} 2>/dev/null >/proc/self/oom_score_adj; "

_lock = threading.Lock()
_jobs = {}
# The runner never changes its environment, so it is decoded from os.environ once.
_environment = dict(os.environ)
_runner_token = os.urandom(6).hex()
_state = {"calls": 0, "subreaper": False}


class _Job:
    """One running ``bash -c``: its pid (which is also its process group) and marker."""

    def __init__(self, pid, marker):
        self.pid = pid
        self.marker = marker
        self.status = None
        self.killed_by = None

    def kill(self, cause):
        """SIGKILL the whole tree of this job, recording cause ("timeout" or "cancel")."""
        with _lock:
            if self.status is not None:
                return  # already reaped: the pid may belong to someone else now
            if self.killed_by is None:
                self.killed_by = cause
            needle = f"\0{MARKER_VARIABLE}={self.marker}\0".encode()

            def targets(table):
                marked = _marked(table, needle)
                return _descendants(table, [self.pid]) | marked | _descendants(table, marked)

            _signal_group(self.pid)
            _kill_until_gone(targets)

    def poll(self):
        """Reap bash if it has exited; return True once it has."""
        with _lock:
            if self.status is None:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid == 0:
                    return False
                self.status = status
                del _jobs[self.pid]
        return True


def run_bash(command, timeout, call):
    """The bash tool: run command for at most timeout seconds; return a CallToolResult."""
    options = call.options
    started = time.monotonic()
    read_fd, write_fd = os.pipe()
    try:
        job = _spawn(command, write_fd, options)
    except (OSError, ValueError) as error:
        os.close(read_fd)
        reason = error.strerror if isinstance(error, OSError) else "the command contains a NUL byte"
        text = f"Could not start bash: {reason}."
        return tool_result(text, _structured(None, None, False, False, None, started, text),
                           is_error=True)
    finally:
        os.close(write_fd)
    output = _Output(options.max_output_lines, options.max_output_bytes,
                     os.path.join(options.workspace, ".corral", "output"), call.progress,
                     options.max_spill_bytes)
    oom_before = _oom_kills(options)
    call.set_cancel_hook(lambda: job.kill("cancel"))
    _watchdog.watch(job, started + timeout)
    try:
        pipe_open = _collect(job, read_fd, output, started + timeout)
    finally:
        call.set_cancel_hook(None)
        _watchdog.forget(job)
    if pipe_open:
        # Background processes still hold the pipe. Keep emptying it so that
        # they neither block nor die of SIGPIPE when they write.
        try:
            threading.Thread(target=_discard_until_eof, args=(read_fd,), daemon=True).start()
        except RuntimeError:  # out of threads: closing is the only way left
            os.close(read_fd)
    else:
        os.close(read_fd)
    _reap_orphans()
    output.finish()
    oom_killed = oom_before is not None and (_oom_kills(options) or 0) > oom_before
    return _result(job, output, timeout, call.cancel_reason, started, oom_killed, options)


class _Watchdog:
    """One thread that kills jobs at their deadlines.

    The reading loop checks the deadline too, but it can be stuck for as
    long as a progress notification waits for a client that does not read;
    the timeout must hold regardless. The thread is woken only when a new
    deadline comes before the one it already waits for, so back-to-back
    calls cost no thread switch.
    """

    def __init__(self):
        self._condition = threading.Condition()
        self._deadlines = {}
        self._thread = None
        self._wake_at = None  # when the thread wakes next; None: only when notified

    def watch(self, job, deadline):
        """Kill ``job`` with cause "timeout" at ``deadline`` (time.monotonic) unless forgotten."""
        with self._condition:
            self._deadlines[job] = deadline
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True)
                self._thread.start()
            elif self._wake_at is None or deadline < self._wake_at:
                self._condition.notify()

    def forget(self, job):
        """``job`` is done: no kill."""
        with self._condition:
            self._deadlines.pop(job, None)

    def _run(self):
        with self._condition:
            while True:
                now = time.monotonic()
                due = [job for job, deadline in self._deadlines.items() if deadline <= now]
                for job in due:
                    del self._deadlines[job]
                if due:
                    self._condition.release()
                    try:
                        for job in due:
                            job.kill("timeout")
                    finally:
                        self._condition.acquire()
                    continue
                self._wake_at = min(self._deadlines.values(), default=None)
                self._condition.wait(None if self._wake_at is None else self._wake_at - now)


_watchdog = _Watchdog()


def _spawn(command, write_fd, options):
    """Start ``bash -c command`` writing to write_fd and track it as a job."""
    with _lock:
        if options.subreaper and not _state["subreaper"]:
            _become_subreaper()
            _state["subreaper"] = True
        if options.no_userns and not _state.get("no_userns"):
            _deny_user_namespaces()
            _state["no_userns"] = True
        _state["calls"] += 1
        marker = f"{_runner_token}.{_state['calls']}"
        environment = _environment.copy()
        environment[MARKER_VARIABLE] = marker
        pid = os.posix_spawn(
            _bash_path(), ["bash", "-c", _OOM_RESET + command], environment,
            file_actions=[(os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
                          (os.POSIX_SPAWN_DUP2, write_fd, 1),
                          (os.POSIX_SPAWN_DUP2, write_fd, 2)],
            setsid=True,
            setsigmask=(),
            # Python ignores these; a shell expects their default actions.
            setsigdef=(signal.SIGPIPE, signal.SIGXFSZ),
        )
        job = _jobs[pid] = _Job(pid, marker)
    return job


def _bash_path():
    """bash's absolute path on the runner's PATH, found once (a PATH search per call costs failed execs)."""
    path = _state.get("bash")
    if path is None:
        for directory in _environment.get("PATH", os.defpath).split(os.pathsep):
            candidate = os.path.join(directory or ".", "bash")
            if os.access(candidate, os.X_OK) and not os.path.isdir(candidate):
                path = candidate
                break
        else:
            raise OSError(2, "bash was not found on the runner's PATH")
        _state["bash"] = path
    return path


# seccomp: per architecture, (AUDIT_ARCH, seccomp, clone, unshare, clone3) numbers.
_SECCOMP_ARCHES = {
    "x86_64": (0xC000003E, 317, 56, 272, 435),
    "aarch64": (0xC00000B7, 277, 220, 97, 435),
}
_CLONE_NEWUSER = 0x10000000


def _deny_user_namespaces():
    """Install a seccomp filter, on every thread, that refuses new user namespaces.

    ``clone`` and ``unshare`` with CLONE_NEWUSER fail with EPERM; ``clone3``
    (whose flags a filter cannot see) fails with ENOSYS, so libc falls back
    to ``clone``. A user namespace would give the tenant a full capability
    set over new namespaces, the start of many kernel exploits; bwrap denies
    them too (--disable-userns), setpriv has no such option. Needs
    no_new_privs, which the runner sets (isolation strategies set it anyway).
    """
    import ctypes
    import errno
    import platform
    import struct

    numbers = _SECCOMP_ARCHES.get(platform.machine())
    if numbers is None:
        os.write(2, b"corral runner: no seccomp filter for this architecture; "
                    b"user namespaces are not denied\n")
        return
    arch, seccomp, clone, unshare, clone3 = numbers
    allow, deny_eperm = 0x7FFF0000, 0x00050000 | errno.EPERM
    deny_enosys = 0x00050000 | errno.ENOSYS
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    program = [
        (ld, 0, 0, 4),                      # A = seccomp_data.arch
        (jeq, 1, 0, arch),                  # native arch: go on
        (ret, 0, 0, deny_eperm),            # any other ABI: refuse everything it asks
        (ld, 0, 0, 0),                      # A = seccomp_data.nr
        (jge, 0, 1, 0x40000000),            # x32 numbers on x86_64: refuse
        (ret, 0, 0, deny_eperm),
        (jeq, 0, 1, clone3),
        (ret, 0, 0, deny_enosys),
        (jeq, 1, 0, clone),
        (jeq, 0, 3, unshare),
        (ld, 0, 0, 16),                     # A = low 32 bits of args[0]: the flags
        (jset, 0, 1, _CLONE_NEWUSER),
        (ret, 0, 0, deny_eperm),
        (ret, 0, 0, allow),
    ]
    code = b"".join(struct.pack("HBBI", *instruction) for instruction in program)
    buffer = ctypes.create_string_buffer(code)
    fprog = struct.pack("HxxxxxxP", len(program), ctypes.addressof(buffer))
    fprog_buffer = ctypes.create_string_buffer(fprog)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(38, ctypes.c_ulong(1), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))
    # seccomp(SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC, &prog): all threads.
    if libc.syscall(ctypes.c_long(seccomp), ctypes.c_ulong(1), ctypes.c_ulong(1),
                    ctypes.c_void_p(ctypes.addressof(fprog_buffer))) != 0:
        error = ctypes.get_errno()
        os.write(2, f"corral runner: cannot install the seccomp filter: "
                    f"{os.strerror(error)}\n".encode())


def _become_subreaper():
    """Make orphaned descendants reparent to the runner, so that they can be found and killed."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, ctypes.c_ulong(1), ctypes.c_ulong(0),
                  ctypes.c_ulong(0), ctypes.c_ulong(0)) != 0:
        error = ctypes.get_errno()
        os.write(2, f"corral runner: cannot become a child subreaper: "
                    f"{os.strerror(error)}\n".encode())


def _collect(job, read_fd, output, deadline):
    """Read the job's output until bash exits, killing it at deadline.

    Once bash has exited, output that is immediately available is still
    read for up to DRAIN_SECONDS.  Returns True if the pipe is still open
    (held by background processes) when it gives up.
    """
    try:
        pidfd = os.pidfd_open(job.pid)
    except OSError:
        pidfd = None
    poller = select.poll()
    poller.register(read_fd, select.POLLIN)
    if pidfd is not None:
        poller.register(pidfd, select.POLLIN)
    pipe_open = True
    try:
        while not job.poll():
            now = time.monotonic()
            if now >= deadline and job.killed_by is None:
                job.kill("timeout")
                continue
            waits = [deadline - now if job.killed_by is None else POLL_SECONDS]
            if pidfd is None:
                waits.append(POLL_SECONDS)
            progress_wait = output.progress_wait(now)
            if progress_wait is not None:
                waits.append(progress_wait)
            for fd, _ in poller.poll(max(0.0, min(waits)) * 1000 + 1):
                if fd == read_fd and pipe_open:
                    pipe_open = _read_into(read_fd, output)
                    if not pipe_open:
                        poller.unregister(read_fd)
            output.send_progress(time.monotonic())
        if pidfd is not None:
            poller.unregister(pidfd)
        drain_until = time.monotonic() + DRAIN_SECONDS
        while pipe_open:
            wait = drain_until - time.monotonic()
            if wait <= 0 or not poller.poll(wait * 1000):
                break
            pipe_open = _read_into(read_fd, output)
    finally:
        if pidfd is not None:
            os.close(pidfd)
    return pipe_open


def _read_into(read_fd, output):
    """Move one read's worth of output into output; return False at end of file."""
    data = os.read(read_fd, _READ_SIZE)
    if data:
        output.add(data)
    return bool(data)


def _discard_until_eof(fd):
    """Read and drop what background processes write to a finished call's pipe."""
    try:
        while os.read(fd, _READ_SIZE):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)


def _oom_kills(options):
    """The conversation cgroup's count of out-of-memory kills, or None when unknown."""
    if not options.oom_events:
        return None
    try:
        with open(options.oom_events, "rb") as f:
            for line in f.read().splitlines():
                name, _, value = line.partition(b" ")
                if name == b"oom_kill":
                    return int(value)
    except (OSError, ValueError):
        pass
    return None


def _memory_limit_text(limit):
    if not limit:
        return "its memory limit"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if limit >= size:
            return f"its memory limit of {limit / size:g} {unit}"
    return f"its memory limit of {limit} bytes"


def _result(job, output, timeout, cancel_reason, started, oom_killed=False, options=None):
    """The CallToolResult for a finished job."""
    text, shown_lines = output.text()
    notes = []
    if output.truncated:
        total_lines = output.line_count()
        if output.spill_path and not output.spill_error:
            where = f"full output: {output.spill_path}"
        else:
            where = f"the full output could not be saved: {output.spill_error}"
        notes.append(f"[output truncated: showing last {shown_lines} lines of {total_lines}; "
                     f"{where}]")
    exit_code = signal_number = None
    if os.WIFSIGNALED(job.status):
        signal_number = os.WTERMSIG(job.status)
    else:
        exit_code = os.WEXITSTATUS(job.status)
    if job.killed_by == "cancel":
        notes.append("Command was cancelled" + (f": {cancel_reason}" if cancel_reason else "."))
    elif job.killed_by == "timeout":
        notes.append(f"Command timed out after {timeout:g} s")
    elif signal_number is not None:
        name = _signal_name(signal_number)
        notes.append(f"Command was killed by signal {signal_number} ({name})")
    elif exit_code:
        notes.append(f"Command exited with code {exit_code}")
    if oom_killed:
        notes.append(
            "The out-of-memory killer killed a process of this command: the conversation "
            f"reached {_memory_limit_text(options.memory_limit)}. Use less memory "
            "(smaller inputs, fewer parallel jobs), or ask the operator to raise memory_limit."
        )
    if notes:
        text = (text.rstrip("\n") + "\n\n" if text else "") + "\n".join(notes)
    elif not text:
        text = "(no output)"
    structured = _structured(exit_code, signal_number, job.killed_by == "timeout",
                             job.killed_by == "cancel", output, started, None)
    structured["oomKilled"] = oom_killed
    is_error = (bool(exit_code) or signal_number is not None or job.killed_by is not None
                or oom_killed)
    return tool_result(text, structured, is_error=is_error)


def _structured(exit_code, signal_number, timed_out, cancelled, output, started, error):
    """The structuredContent of a bash result."""
    structured = {
        "exitCode": exit_code,
        "signal": signal_number,
        "timedOut": timed_out,
        "cancelled": cancelled,
        "truncated": bool(output and output.truncated),
        "fullOutputPath": output.spill_path if output else None,
        "durationMs": round((time.monotonic() - started) * 1000),
    }
    if error:
        structured["error"] = error
    return structured


def _signal_name(number):
    """The name of signal number, such as SIGSEGV."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


class _Output:
    """A command's output: a rolling tail, the full text in a file once it outgrows the limits.

    The tail keeps the last max_bytes + 1 bytes (the extra byte tells
    whether the kept part starts at a line boundary).  While the output is
    within the limits the tail is all of it, so when it first exceeds them
    the whole output so far can be written to the spill file.
    """

    def __init__(self, max_lines, max_bytes, spill_directory, progress,
                 max_spill_bytes=256 * 1024 * 1024):
        self.max_lines = max_lines
        self.max_bytes = max_bytes
        self.max_spill_bytes = max_spill_bytes
        self._spilled = 0
        self.spill_directory = spill_directory
        self.progress = progress
        self.tail = bytearray()
        self.total_bytes = 0
        self.newlines = 0
        self.truncated = False
        self.spill_path = None
        self.spill_error = None
        self._spill_fd = None
        self._pending = bytearray()
        self._next_progress = 0.0
        self._decoder = None

    def add(self, data):
        """Take in a chunk of output."""
        self.total_bytes += len(data)
        self.newlines += data.count(b"\n")
        self.tail += data
        if self._spill_fd is not None:
            self._write_spill(data)
        elif not self.truncated and (self.total_bytes > self.max_bytes
                                     or self.line_count() > self.max_lines):
            self.truncated = True
            self._start_spill()
        if len(self.tail) > 2 * (self.max_bytes + 1):
            del self.tail[:-(self.max_bytes + 1)]
        if self.progress is not None:
            self._pending += data

    def line_count(self):
        """Lines of output so far; a final line without a newline counts."""
        return self.newlines + (1 if self.tail and self.tail[-1] != 0x0A else 0)

    def _start_spill(self):
        """Save everything so far (all of it is in the tail) to a new file, then keep appending."""
        name = f"bash-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{os.urandom(3).hex()}.log"
        path = os.path.join(self.spill_directory, name)
        try:
            os.makedirs(self.spill_directory, exist_ok=True)
            self._spill_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                                     0o644)
        except OSError as error:
            self.spill_error = error.strerror
            return
        self.spill_path = path
        self._write_spill(bytes(self.tail))

    def _write_spill(self, data):
        """Append data to the spill file; on failure or past the cap, note why and stop writing."""
        room = self.max_spill_bytes - self._spilled
        if len(data) > room:
            data = data[:max(0, room)]
            self.spill_error = (f"the file {self.spill_path} holds only the first "
                                f"{self.max_spill_bytes} bytes (--max-spill-bytes)")
        self._spilled += len(data)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._spill_fd, view):]
        except OSError as error:
            self.spill_error = f"{error.strerror} (the file {self.spill_path} is incomplete)"
        if self.spill_error:
            os.close(self._spill_fd)
            self._spill_fd = None

    def progress_wait(self, now):
        """Seconds until unsent output is due in a progress notification, or None."""
        if not self._pending:
            return None
        if len(self._pending) >= PROGRESS_FLUSH_BYTES:
            return 0.0
        return max(0.0, self._next_progress - now)

    def send_progress(self, now, force=False):
        """Send unsent output as a progress notification if one is due (or if force)."""
        if not self._pending:
            return
        if now < self._next_progress and not force and len(self._pending) < PROGRESS_FLUSH_BYTES:
            return
        if self._decoder is None:
            import codecs

            self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        text = self._decoder.decode(bytes(self._pending), final=force)
        self._pending.clear()
        self._next_progress = now + PROGRESS_INTERVAL
        if text:
            self.progress(self.total_bytes, text)

    def finish(self):
        """Send the last progress notification and close the spill file."""
        self.send_progress(time.monotonic(), force=True)
        if self._spill_fd is not None:
            os.close(self._spill_fd)
            self._spill_fd = None

    def text(self):
        """The output to show, as text, and how many lines it holds.

        The last max_bytes bytes, less a partial first line when that leaves
        something, then at most the last max_lines lines.
        """
        data = bytes(self.tail[-self.max_bytes:])
        if len(self.tail) > self.max_bytes and self.tail[-self.max_bytes - 1] != 0x0A:
            newline = data.find(b"\n")
            if 0 <= newline < len(data) - 1:
                data = data[newline + 1:]
            else:  # one huge line: cut it, but not inside a character
                data = bytes(_strip_continuation_bytes(bytearray(data)))
        if not data:
            return "", 0
        lines = data.split(b"\n")
        ends_with_newline = not lines[-1]
        count = len(lines) - ends_with_newline
        if count > self.max_lines:
            data = b"\n".join(lines[-(self.max_lines + ends_with_newline):])
            count = self.max_lines
        return data.decode("utf-8", "replace"), count


def _strip_continuation_bytes(data):
    """Drop UTF-8 continuation bytes from the start of data (a bytearray); return it."""
    start = 0
    while start < min(3, len(data)) and 0x80 <= data[start] < 0xC0:
        start += 1
    del data[:start]
    return data


def _reap_orphans():
    """Reap exited children that are not tracked jobs (orphans adopted as subreaper)."""
    with _lock:
        while True:
            try:
                info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                return
            if info is None or info.si_pid == 0 or info.si_pid in _jobs:
                return
            os.waitpid(info.si_pid, 0)


def kill_all():
    """Kill every process any bash call started, wherever it went (used when the runner exits)."""
    needle = f"\0{MARKER_VARIABLE}={_runner_token}.".encode()
    me = os.getpid()

    def targets(table):
        marked = _marked(table, needle)
        return _descendants(table, [me]) | marked | _descendants(table, marked)

    with _lock:
        for pid in _jobs:
            _signal_group(pid)
        _kill_until_gone(targets)


def _signal_group(pgid):
    """SIGKILL process group pgid, if it still exists."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass


def _kill_until_gone(find_targets, rounds=50):
    """SIGKILL what find_targets(process_table) returns, until it returns only the dead.

    Repeated because a process may fork between one look at /proc and the kill.
    """
    me = os.getpid()
    for _ in range(rounds):
        table = _process_table()
        alive = [pid for pid in find_targets(table)
                 if pid != me and table.get(pid, (0, "Z"))[1] not in "ZX"]
        if not alive:
            return
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.001)


def _process_table():
    """Every visible process, as pid -> (parent pid, state letter), read from /proc.

    Empty when /proc belongs to another pid namespace than the runner's: its
    pids would name other processes here.
    """
    table = {}
    try:
        if os.readlink("/proc/self") != str(os.getpid()):
            return table
        names = os.listdir("/proc")
    except OSError:
        return table
    for name in names:
        if not name.isdigit():
            continue
        try:
            fd = os.open(f"/proc/{name}/stat", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            data = os.read(fd, 1024)
        except OSError:
            continue
        finally:
            os.close(fd)
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
        fields = data[data.rfind(b")") + 2:].split()
        if len(fields) >= 2:
            table[int(name)] = (int(fields[1]), fields[0].decode("ascii", "replace"))
    return table


def _descendants(table, roots):
    """The pids below roots in table (roots themselves excluded)."""
    children = {}
    for pid, (parent, _) in table.items():
        children.setdefault(parent, []).append(pid)
    found = set()
    stack = list(roots)
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


def _marked(table, needle):
    """The pids in table whose environment contains needle (NUL-delimited VAR=value)."""
    marked = set()
    for pid in table:
        try:
            fd = os.open(f"/proc/{pid}/environ", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            environment = b"\0" + _read_all(fd)
        except OSError:
            continue
        finally:
            os.close(fd)
        if needle in environment:
            marked.add(pid)
    return marked


def _read_all(fd):
    """Everything readable from fd."""
    parts = []
    while True:
        data = os.read(fd, 65536)
        if not data:
            return b"".join(parts)
        parts.append(data)
