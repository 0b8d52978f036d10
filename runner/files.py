"""The file tools: read, write and edit, faithful to the bytes on disk.

Every failure a user can cause (a missing file, a directory, a binary file,
an edit that does not match) comes back as an ``isError`` result whose text
says what was wrong and what to do, never as an exception.
"""

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
    else:
        text = f"Cannot {action} {path}: {error.strerror or error}."
    return _error(text, path)


def _file_kind(mode):
    """A word for the kind of file mode describes."""
    if stat.S_ISDIR(mode):
        return "directory"
    if stat.S_ISFIFO(mode):
        return "FIFO (named pipe)"
    if stat.S_ISSOCK(mode):
        return "socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "device"
    return "special file"


def _not_regular(mode, path, action):
    """An isError result for action on something that is not a regular file."""
    kind = _file_kind(mode)
    if kind == "directory":
        hint = " Use bash (for example `ls -la`) to list it." if action == "read" else ""
        return _error(f"{path} is a directory; {action} only works on files.{hint}", path)
    return _error(f"{path} is a {kind}, not a regular file; {action} only works on regular files.",
                  path)


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


def read_file(workspace, path, offset=None, limit=None):
    """The read tool: show lines of a text file, or an image, from path."""
    try:
        full = resolve_path(workspace, path)
        info = os.stat(full)
        if not stat.S_ISREG(info.st_mode):
            return _not_regular(info.st_mode, path, "read")
        # O_NONBLOCK: should the path turn into a FIFO after the stat, open still returns.
        fd = os.open(full, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as error:
        return _os_error(error, path, "read", workspace)
    except ValueError:
        return _error(f"{path!r} is not a usable path (it contains a NUL byte).", path)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return _not_regular(info.st_mode, path, "read")
        head = _read_fully(fd, SNIFF_BYTES)
        image_type = _image_type(head)
        if image_type:
            return _read_image(fd, head, image_type, path)
        problem = _binary_problem(head, len(head) < SNIFF_BYTES)
        if problem:
            return _binary_error(path, info.st_size, problem)
        total, region = _scan_lines(fd, head, offset or 1, READ_MAX_BYTES + 1)
    except OSError as error:
        return _os_error(error, path, "read", workspace)
    finally:
        os.close(fd)
    return _show_lines(path, info.st_size, total, region, offset or 1, limit)


def _image_type(head):
    """The MIME type of a PNG, JPEG, GIF or WebP image starting with head, else None."""
    for magic, mime_type in _IMAGE_MAGIC:
        if head.startswith(magic):
            return mime_type
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "image/webp"
    return None


def _read_image(fd, head, mime_type, path):
    """A result carrying the image in fd (whose first bytes are head) as MCP image content."""
    import base64

    data = head + _read_fully(fd, IMAGE_MAX_BYTES + 1 - len(head))
    if len(data) > IMAGE_MAX_BYTES:
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


def _scan_lines(fd, head, offset, cap):
    """Read a file to its end from fd (head already read); count its lines.

    Returns ``(total_lines, region)``: region is at most cap bytes of the
    file starting at line offset, so memory stays bounded however big the file.
    """
    to_skip = offset - 1
    region = bytearray()
    newlines = 0
    last = b""
    chunk = head
    while chunk:
        begin = 0
        if to_skip:
            count = chunk.count(b"\n")
            if count < to_skip:
                to_skip -= count
                begin = None
            else:
                for _ in range(to_skip):
                    begin = chunk.index(b"\n", begin) + 1
                to_skip = 0
        if begin is not None and len(region) < cap:
            region += chunk[begin:begin + cap - len(region)]
        newlines += chunk.count(b"\n")
        last = chunk[-1:]
        chunk = os.read(fd, 1 << 20)
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
        text = (f"[Line {offset} of {path} is longer than {READ_MAX_BYTES} bytes, the most read "
                f"shows at once. Use bash: sed -n '{offset}p' {_quote(path)} | "
                f"head -c {READ_MAX_BYTES}]")
        return tool_result(text, {"path": path, "startLine": offset, "endLine": offset - 1,
                                  "totalLines": total, "truncated": True, "nextOffset": None})
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
    """The write tool: replace (or create) path with content, atomically."""
    try:
        data = content.encode("utf-8")
    except UnicodeEncodeError as error:
        return _error(f"content holds an unpaired surrogate at index {error.start}, which UTF-8 "
                      f"cannot encode; nothing was written to {path}.", path)
    if path.endswith("/"):
        return _error(f"{path} names a directory (it ends with /); give the path of a file.", path)
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
        os.makedirs(os.path.dirname(target), exist_ok=True)
        atomic_write(target, data, like=info)
    except OSError as error:
        return _os_error(error, path, "write", workspace)
    except ValueError:
        return _error(f"{path!r} is not a usable path (it contains a NUL byte).", path)
    return tool_result(f"Wrote {len(data)} bytes to {path}", {"path": path, "bytes": len(data)})


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


def edit_file(workspace, path, edits):
    """The edit tool: apply exact-text replacements to path in one atomic write."""
    try:
        target = os.path.realpath(resolve_path(workspace, path))
        info = os.stat(target)
        if not stat.S_ISREG(info.st_mode):
            return _not_regular(info.st_mode, path, "edit")
        with open(target, "rb") as file:
            raw = file.read()
    except OSError as error:
        return _os_error(error, path, "edit", workspace)
    except ValueError:
        return _error(f"{path!r} is not a usable path (it contains a NUL byte).", path)
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
