"""The file tools: read, write and edit, faithful to the bytes on disk.

Every failure a user can cause (a missing file, a directory, a binary file,
an edit that does not match, a full disk) comes back as an ``isError``
result whose text says what was wrong and what to do, never as an exception.

The tools only work on regular files and never block on anything else: a
FIFO, a device or a socket is refused without being read or written (see
:func:`_open_regular`).  Memory stays bounded whatever the file: read scans
in chunks and keeps only the lines it shows, and read and edit refuse files
above a size cap (the runner's ``--max-read-bytes`` and ``--max-edit-bytes``).
"""

import errno
import os
import stat

from runner.tools import tool_result

#: read shows at most this many lines and bytes at a time.
READ_MAX_LINES = 2000
READ_MAX_BYTES = 50 * 1024
#: Images larger than this are not sent back (they would not fit a model's input).
IMAGE_MAX_BYTES = 5 * 1024 * 1024
#: How much of a file's start is looked at to tell text from binary.
SNIFF_BYTES = 8192
#: read refuses a text file larger than this (the runner's ``--max-read-bytes``).
DEFAULT_MAX_READ_BYTES = 64 * 1024 * 1024
#: edit refuses a file larger than this (the runner's ``--max-edit-bytes``).
DEFAULT_MAX_EDIT_BYTES = 16 * 1024 * 1024
#: read scans a file in pieces of this size.
SCAN_CHUNK_BYTES = 1024 * 1024

#: Flags for opening a file to read: O_NONBLOCK so that a FIFO opens at once
#: (and a read from it returns at once) instead of waiting for a writer;
#: O_NOCTTY so that a terminal never becomes the runner's controlling terminal.
_READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC

_BOM = b"\xef\xbb\xbf"
_IMAGE_MAGIC = (
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
)


def resolve_path(workspace, path):
    """The absolute path for path: ``~`` is $HOME, relative paths join the workspace."""
    if path.startswith("~"):
        path = os.path.expanduser(path)
    return os.path.join(workspace, path)


def _error(text, path):
    """An isError result about path."""
    return tool_result(text, {"path": path, "error": text}, is_error=True)


def _os_error(error, path, action, workspace):
    """An isError result that turns an OSError from action on path into a sentence."""
    if isinstance(error, FileNotFoundError):
        text = (f"{path} does not exist (relative paths resolve against the workspace "
                f"{workspace}). Check the path, for example with bash `ls`.")
    elif isinstance(error, PermissionError):
        text = f"Permission denied: cannot {action} {path}."
    elif isinstance(error, IsADirectoryError):
        text = f"{path} is a directory; {action} works on files."
    elif isinstance(error, NotADirectoryError):
        text = f"Cannot {action} {path}: a part of the path that should be a directory is a file."
    elif error.errno in (errno.ENOSPC, errno.EDQUOT):
        full = ("the disk is full (no space left on device)" if error.errno == errno.ENOSPC
                else "the disk quota is full (the owner's quota is exceeded)")
        text = (f"Cannot {action} {path}: {full}. Nothing was written: {path} is as it was "
                "before. Free some space (bash `du -ah . | sort -h | tail -20` shows what is "
                "large) and try again.")
    else:
        text = f"Cannot {action} {path}: {error.strerror or error}."
    return _error(text, path)


def _file_kind(mode):
    """Words for the kind of file mode describes."""
    if stat.S_ISDIR(mode):
        return "directory"
    if stat.S_ISFIFO(mode):
        return "FIFO (named pipe)"
    if stat.S_ISSOCK(mode):
        return "Unix socket"
    if stat.S_ISCHR(mode):
        return "character device"
    if stat.S_ISBLK(mode):
        return "block device"
    return "special file"


def _not_regular(mode, path, action):
    """An isError result for action on something that is not a regular file."""
    kind = _file_kind(mode)
    if kind == "directory":
        hint = " Use bash (for example `ls -la`) to list it." if action == "read" else ""
        return _error(f"{path} is a directory; {action} only works on files.{hint}", path)
    return _error(f"{path} is a {kind}, not a regular file; {action} only works on regular files.",
                  path)


def _open_regular(full, path, action):
    """Open full for reading, but only if it is a regular file; never block.

    Returns ``(fd, stat_result)`` with fd in blocking mode, or an isError
    result naming path and what it is instead (a directory, a FIFO, a
    device, a socket).  OSError and ValueError (a NUL in the path) reach
    the caller.

    A stat comes first so that a FIFO or a device is normally refused
    without being opened at all (opening one has effects: it completes the
    open of a writer waiting on the FIFO, a device driver may act).  The
    stat alone would be racy, as the tenant can swap the file for a FIFO
    before the open, so the open itself cannot block (``O_NONBLOCK``; a
    socket fails with ENXIO), the descriptor is checked with fstat, and
    only a regular file is put back into blocking mode.
    """
    info = os.stat(full)
    if not stat.S_ISREG(info.st_mode):
        return _not_regular(info.st_mode, path, action)
    try:
        fd = os.open(full, _READ_FLAGS)
    except OSError as error:
        if error.errno == errno.ENXIO:  # became a socket or a device after the stat
            info = os.stat(full)
            if not stat.S_ISREG(info.st_mode):
                return _not_regular(info.st_mode, path, action)
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            return _not_regular(info.st_mode, path, action)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, info


def _size_text(count):
    """count bytes in words: ``64 MiB``, ``1.5 GiB``, ``900 bytes``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= scale:
            return (f"{count // scale} {unit}" if count % scale == 0
                    else f"{count / scale:.1f} {unit}")
    return f"{count} bytes"


def _size_in_full(count):
    """count bytes in words and, when rounded, exactly: ``10 GiB (10737418240 bytes)``."""
    words = _size_text(count)
    return words if count < 1024 else f"{words} ({count} bytes)"


def _quote(path):
    """path quoted for a shell command line."""
    import shlex

    return shlex.quote(path)


def _read_fully(fd, size):
    """Read up to size bytes from fd, stopping early only at end of file."""
    parts = []
    while size > 0:
        data = os.read(fd, size)
        if not data:
            break
        parts.append(data)
        size -= len(data)
    return b"".join(parts)


def _is_incomplete_utf8_tail(data, error):
    """True when a decode error is only a multi-byte character cut off at the end of data."""
    return error.reason == "unexpected end of data" and error.end == len(data)


# -- read -----------------------------------------------------------------


def read_file(workspace, path, offset=None, limit=None, max_bytes=DEFAULT_MAX_READ_BYTES):
    """The read tool: show lines of a text file, or an image, from path.

    A text file larger than max_bytes is refused; no more than max_bytes
    are ever read, and memory stays bounded by the lines shown.
    """
    try:
        opened = _open_regular(resolve_path(workspace, path), path, "read")
    except OSError as error:
        return _os_error(error, path, "read", workspace)
    except ValueError:
        return _error(f"{path!r} is not a usable path (it contains a NUL byte).", path)
    if isinstance(opened, dict):
        return opened
    fd, info = opened
    try:
        head = _read_fully(fd, SNIFF_BYTES)
        image_type = _image_type(head)
        if image_type:
            return _read_image(fd, head, image_type, path, info.st_size)
        problem = _binary_problem(head, len(head) < SNIFF_BYTES)
        if problem:
            return _binary_error(path, info.st_size, problem)
        if info.st_size > max_bytes:
            return _too_large_to_read(path, info.st_size, max_bytes)
        scanned = _scan_lines(fd, head, offset or 1, READ_MAX_BYTES + 1, max_bytes)
    except OSError as error:
        return _os_error(error, path, "read", workspace)
    finally:
        os.close(fd)
    if scanned is None:  # it grew past the cap, or its size said less (as in /proc)
        return _too_large_to_read(path, None, max_bytes)
    total, region = scanned
    return _show_lines(path, info.st_size, total, region, offset or 1, limit)


def _too_large_to_read(path, size, max_bytes):
    """The isError result for a text file larger than read opens (size None: it grew)."""
    quoted = _quote(path)
    what = (f"is {_size_in_full(size)}, larger than" if size is not None
            else "turned out, while it was read, to hold more than")
    return _error(f"{path} {what} the {_size_text(max_bytes)} read opens. Look at "
                  f"parts of it with bash instead, for example `head -n 200 {quoted}`, "
                  f"`sed -n '1000,1200p' {quoted}`, `tail -n 200 {quoted}` or "
                  f"`grep -n PATTERN {quoted} | head`.", path)


def _image_type(head):
    """The MIME type of a PNG, JPEG, GIF or WebP image starting with head, else None."""
    for magic, mime_type in _IMAGE_MAGIC:
        if head.startswith(magic):
            return mime_type
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "image/webp"
    return None


def _read_image(fd, head, mime_type, path, size):
    """A result carrying the image in fd (whose first bytes are head) as MCP image content."""
    import base64

    data = b""
    if size <= IMAGE_MAX_BYTES:  # else refuse without reading it
        data = head + _read_fully(fd, IMAGE_MAX_BYTES + 1 - len(head))
    if size > IMAGE_MAX_BYTES or len(data) > IMAGE_MAX_BYTES:
        return _error(f"{path} is an image ({mime_type}) larger than {IMAGE_MAX_BYTES} bytes, "
                      "too large to return. Make a smaller copy with bash first.", path)
    text = f"Read image {path} ({mime_type}, {len(data)} bytes)."
    return tool_result(text, {"path": path, "mimeType": mime_type, "bytes": len(data)},
                       content=[{"type": "text", "text": text},
                                {"type": "image", "mimeType": mime_type,
                                 "data": base64.b64encode(data).decode("ascii")}])


def _binary_problem(head, is_whole_file):
    """Why head (a file's first bytes) is not text, or None when it looks like UTF-8 text."""
    if b"\0" in head:
        return "it contains NUL bytes"
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as error:
        if is_whole_file or not _is_incomplete_utf8_tail(head, error):
            return "it is not valid UTF-8 text"
    return None


def _binary_error(path, size, problem):
    """The isError result for a file read cannot show as text."""
    quoted = _quote(path)
    return _error(f"{path} is a binary file ({size} bytes): {problem}, so read cannot show it. "
                  f"Inspect it with bash instead, for example `file {quoted}` or "
                  f"`xxd {quoted} | head -50`.", path)


def _scan_lines(fd, head, offset, cap, max_bytes):
    """Read a file to its end from fd (head already read); count its lines.

    Returns ``(total_lines, region)``: region is at most cap bytes of the
    file starting at line offset.  The file is read in pieces and only the
    region is kept, so memory stays bounded however big the file or its
    lines; the rest is only counted, for the total.  Returns None, having
    read at most max_bytes + 1 bytes (or head, if longer), when the file
    holds more than max_bytes: it grew after its size was checked, or it is
    a file like those in /proc whose size says 0.
    """
    to_skip = offset - 1
    region = bytearray()
    newlines = 0
    last = b""
    # Pieces are read into one reused buffer: a fresh 1 MiB object per read
    # costs a page fault per page and made scanning several times slower.
    buffer = bytearray(SCAN_CHUNK_BYTES)
    view = memoryview(buffer)
    chunk, length = head, len(head)
    seen = length
    while length:
        if seen > max_bytes:
            return None
        begin = 0
        count = chunk.count(b"\n", 0, length)
        if to_skip:
            if count < to_skip:
                to_skip -= count
                begin = None
            else:
                for _ in range(to_skip):
                    begin = chunk.index(b"\n", begin, length) + 1
                to_skip = 0
        if begin is not None and len(region) < cap:
            region += chunk[begin:min(length, begin + cap - len(region))]
        newlines += count
        last = chunk[length - 1:length]
        chunk = buffer
        length = os.readv(fd, [view[:min(SCAN_CHUNK_BYTES, max_bytes + 1 - seen)]])
        seen += length
    total = newlines + (1 if last and last != b"\n" else 0)
    return total, bytes(region)


def _show_lines(path, size, total, region, offset, limit):
    """The read result for the lines of region, which starts at line offset of total."""
    if offset > max(total, 1):
        return _error(f"offset {offset} is beyond the end of the file ({total} lines).", path)
    wanted = min(limit or READ_MAX_LINES, READ_MAX_LINES)
    reaches_end = len(region) <= READ_MAX_BYTES  # the region was not capped
    shown = 0
    end = 0
    while shown < wanted and end < len(region):
        newline = region.find(b"\n", end)
        if newline < 0 and not reaches_end:
            break  # a line cut off by the cap is never shown
        line_end = newline + 1 if newline >= 0 else len(region)
        if line_end > READ_MAX_BYTES:
            break
        end = line_end
        shown += 1
    if shown == 0 and total:
        following = offset + 1 if offset < total else None
        text = (f"[Line {offset} of {path} is longer than {READ_MAX_BYTES} bytes, the most read "
                f"shows at once. Use bash: sed -n '{offset}p' {_quote(path)} | "
                f"head -c {READ_MAX_BYTES}"
                + (f"; or use offset={following} to read on after it]" if following else "]"))
        return tool_result(text, {"path": path, "startLine": offset, "endLine": offset - 1,
                                  "totalLines": total, "truncated": True,
                                  "nextOffset": following})
    try:
        content = region[:end].decode("utf-8")
    except UnicodeDecodeError:
        return _binary_error(path, size, "it is not valid UTF-8 text")
    last_line = offset + shown - 1
    more = last_line < total
    if more:
        separator = "\n" if content.endswith("\n") else "\n\n"
        content += (f"{separator}[Showing lines {offset}-{last_line} of {total}. "
                    f"Use offset={last_line + 1} to continue.]")
    elif not total:
        content = "(empty file)"
    return tool_result(content, {"path": path, "startLine": offset, "endLine": last_line,
                                 "totalLines": total, "truncated": more,
                                 "nextOffset": last_line + 1 if more else None})


# -- write ----------------------------------------------------------------


def write_file(workspace, path, content):
    """The write tool: replace (or create) path with content, atomically.

    An existing target that is not a regular file (a FIFO, a device, a
    socket, a directory) is refused, not replaced: the file is never opened,
    so nothing can block.  (A tenant who swaps the target for a FIFO between
    the check and the final rename gets the FIFO replaced by the new file:
    the rename cannot be made conditional, and nothing blocks either way.)
    A write that fails, a full disk included, leaves the old file as it was
    and removes its temporary file and any parent directory it created.
    """
    try:
        data = content.encode("utf-8")
    except UnicodeEncodeError as error:
        return _error(f"content holds an unpaired surrogate at index {error.start}, which UTF-8 "
                      f"cannot encode; nothing was written to {path}.", path)
    if path.endswith("/"):
        return _error(f"{path} names a directory (it ends with /); give the path of a file.", path)
    created = []
    try:
        # Write through a symbolic link to its target, as editors do: replacing
        # the link itself would silently cut the file loose from its link.
        target = os.path.realpath(resolve_path(workspace, path))
        try:
            info = os.stat(target)
        except FileNotFoundError:
            info = None
        if info is not None:
            if not stat.S_ISREG(info.st_mode):
                return _not_regular(info.st_mode, path, "write")
            if not os.access(target, os.W_OK):
                return _error(f"Permission denied: {path} is read-only.", path)
        created = _make_parents(os.path.dirname(target))
        atomic_write(target, data, like=info)
    except OSError as error:
        _remove_directories(created)
        return _os_error(error, path, "write", workspace)
    except ValueError:
        return _error(f"{path!r} is not a usable path (it contains a NUL byte).", path)
    return tool_result(f"Wrote {len(data)} bytes to {path}", {"path": path, "bytes": len(data)})


def _make_parents(directory):
    """Create directory and its missing parents; return those created, outermost first."""
    missing = []
    while not os.path.isdir(directory):
        missing.append(directory)
        parent = os.path.dirname(directory)
        if parent == directory:
            break
        directory = parent
    created = []
    try:
        for directory in reversed(missing):
            try:
                os.mkdir(directory)
            except FileExistsError:
                if not os.path.isdir(directory):  # a file where a directory should be
                    raise NotADirectoryError(errno.ENOTDIR, "Not a directory", directory) from None
                continue  # made meanwhile by someone else: not ours to remove
            created.append(directory)
    except OSError:
        _remove_directories(created)
        raise
    return created


def _remove_directories(directories):
    """Remove the (empty) directories a failed write created, innermost first."""
    for directory in reversed(directories):
        try:
            os.rmdir(directory)
        except OSError:  # no longer empty: something else wrote there meanwhile
            pass


def atomic_write(target, data, like=None):
    """Replace target with data so that a crash leaves the old or the new file, never a mix.

    The data goes to a new file in the same directory, is synced to disk and
    renamed over target; then the directory is synced.  like, the stat result
    of the file being replaced, gives the new file's mode and, where allowed,
    its owner; without it the file gets mode 0o644 less the umask.
    """
    directory, name = os.path.split(target)
    temporary = os.path.join(directory, f".{name[:200]}.{os.urandom(4).hex()}.corral-tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o644)
    try:
        try:
            if like is not None:
                if (like.st_uid, like.st_gid) != (os.geteuid(), os.getegid()):
                    try:
                        os.fchown(fd, like.st_uid, like.st_gid)
                    except PermissionError:  # only root may give a file away
                        pass
                os.fchmod(fd, stat.S_IMODE(like.st_mode))
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temporary, target)
    except BaseException:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise
    try:
        directory_fd = os.open(directory or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(directory_fd)
    except OSError:  # some file systems cannot sync a directory; the rename stands
        pass
    finally:
        os.close(directory_fd)


# -- edit -----------------------------------------------------------------


def edit_file(workspace, path, edits, max_bytes=DEFAULT_MAX_EDIT_BYTES):
    """The edit tool: apply exact-text replacements to path in one atomic write.

    A file larger than max_bytes is refused; no more than max_bytes + 1
    bytes of it are ever read.
    """
    try:
        target = os.path.realpath(resolve_path(workspace, path))
        opened = _open_regular(target, path, "edit")
        if isinstance(opened, dict):
            return opened
        fd, info = opened
        try:
            raw = b"" if info.st_size > max_bytes else _read_fully(fd, max_bytes + 1)
        finally:
            os.close(fd)
    except OSError as error:
        return _os_error(error, path, "edit", workspace)
    except ValueError:
        return _error(f"{path!r} is not a usable path (it contains a NUL byte).", path)
    if info.st_size > max_bytes:
        return _too_large_to_edit(path, info.st_size, max_bytes)
    if len(raw) > max_bytes:
        return _too_large_to_edit(path, None, max_bytes)
    bom = raw.startswith(_BOM)
    try:
        text = raw[len(_BOM):].decode("utf-8") if bom else raw.decode("utf-8")
    except UnicodeDecodeError:
        return _error(f"{path} is not valid UTF-8 text, so edit cannot change it safely. "
                      "Use bash to change it.", path)
    # A file whose every line ends in CRLF is matched with LF endings and
    # written back with CRLF.  A file that mixes endings is matched as it is.
    crlf = "\r\n" in text and text.count("\n") == text.count("\r\n")
    if crlf:
        text = text.replace("\r\n", "\n")
    planned = _plan_edits(text, edits, crlf, path)
    if isinstance(planned, dict):
        return planned
    new_text, first_change = planned
    if new_text == text:
        return _error(f"The edits would not change {path} (each newText equals its oldText); "
                      "nothing was written.", path)
    output = new_text.replace("\n", "\r\n") if crlf else new_text
    try:
        data = (_BOM if bom else b"") + output.encode("utf-8")
    except UnicodeEncodeError:
        return _error(f"A newText holds an unpaired surrogate, which UTF-8 cannot encode; "
                      f"{path} was not changed.", path)
    try:
        now = os.stat(target)
        if (now.st_ino, now.st_size, now.st_mtime_ns) != (info.st_ino, info.st_size,
                                                          info.st_mtime_ns):
            return _error(f"{path} changed while it was being edited; it was left as the other "
                          "writer made it. Read it again and retry.", path)
        atomic_write(target, data, like=info)
    except OSError as error:
        return _os_error(error, path, "edit", workspace)
    diff = _unified_diff(text, new_text, path)
    count = len(edits)
    first_line = new_text.count("\n", 0, first_change) + 1
    summary = (f"Edited {path}: {count} edit{'s' if count != 1 else ''} applied, "
               f"first change at line {first_line}.")
    return tool_result(f"{summary}\n\n{diff}",
                       {"path": path, "diff": diff, "firstChangedLine": first_line,
                        "edits": count})


def _too_large_to_edit(path, size, max_bytes):
    """The isError result for a file larger than edit works on (size None: it grew)."""
    what = (f"is {_size_in_full(size)}, larger than" if size is not None
            else "turned out, while it was read, to hold more than")
    return _error(f"{path} {what} the {_size_text(max_bytes)} edit works on; it was "
                  f"not changed. Change it with bash instead, for example "
                  f"`sed -i 's/OLD/NEW/' {_quote(path)}`.", path)


def _plan_edits(text, edits, crlf, path):
    """Locate every edit in text and build the new text.

    Returns ``(new_text, first_changed_offset)`` or an isError result naming
    the first edit that cannot be applied.
    """
    spans = []
    for number, edit in enumerate(edits, 1):
        old, new = edit["oldText"], edit["newText"]
        if crlf:
            old, new = old.replace("\r\n", "\n"), new.replace("\r\n", "\n")
        if not old:
            return _error(f"edit {number}: oldText is empty; give the exact text to replace. "
                          f"Nothing was changed.", path)
        start = text.find(old)
        if start < 0:
            return _error(f"edit {number}: oldText not found in {path}. It must match the file "
                          "exactly, including whitespace and indentation; read the file again "
                          "and copy the text. Nothing was changed.", path)
        occurrences = _count_occurrences(text, old, start)
        if occurrences > 1:
            return _error(f"edit {number}: oldText occurs {occurrences} times in {path}; add "
                          "surrounding context to make it unique. Nothing was changed.", path)
        spans.append((start, start + len(old), new, number))
    spans.sort()
    for before, after in zip(spans, spans[1:]):
        if after[0] < before[1]:
            first, second = sorted((before[3], after[3]))
            return _error(f"edits {first} and {second} overlap in {path}; merge them into one "
                          "edit. Nothing was changed.", path)
    pieces = []
    position = 0
    for start, end, new, _ in spans:
        pieces.append(text[position:start])
        pieces.append(new)
        position = end
    pieces.append(text[position:])
    first_start, _, first_new, _ = spans[0]
    first_old = text[first_start:spans[0][1]]
    common = len(os.path.commonprefix([first_old, first_new]))
    return "".join(pieces), first_start + common


def _count_occurrences(text, needle, first):
    """How many times needle occurs in text (overlaps included), given its first index."""
    count = 0
    index = first
    while index >= 0:
        count += 1
        index = text.find(needle, index + 1)
    return count


def _unified_diff(old, new, path):
    """A unified diff of old and new text with 3 lines of context."""
    import difflib

    return "".join(difflib.unified_diff(_diff_lines(old), _diff_lines(new),
                                        f"a/{path}", f"b/{path}", n=3))


def _diff_lines(text):
    """text split after each LF (and only LF), marking a missing final newline as diff does."""
    if not text:
        return []
    lines = [line + "\n" for line in text.split("\n")]
    if text.endswith("\n"):
        lines.pop()
    else:
        lines[-1] += "\\ No newline at end of file\n"
    return lines
