"""The file tools against hostile files: FIFOs, devices, sockets, huge files, a full disk.

Everything here uses real files and real runner processes: a FIFO nobody
writes to, /dev/zero, a bound Unix socket, sparse files of many GiB, and a
real 1 MiB tmpfs filled to the last byte (as root).
"""

import errno
import os
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from runner import files
from runner.files import edit_file, read_file, write_file
from runner.server import Options, UsageError, parse_options
from runner_harness import RunnerProcess

IS_ROOT = os.geteuid() == 0
#: The runner's peak resident memory must stay below this whatever the file.
PEAK_MEMORY_KIB = 100 * 1024
MIB = 1024 * 1024
GIB = 1024 * MIB


def text_of(result):
    """The text of a result's first content item."""
    return result["content"][0]["text"]


def run_with_deadline(function, *arguments, seconds=10, **keywords):
    """Call function in a thread; fail if it has not returned within seconds."""
    outcome = []
    thread = threading.Thread(target=lambda: outcome.append(function(*arguments, **keywords)),
                              daemon=True)
    thread.start()
    thread.join(seconds)
    assert outcome, f"{function.__name__} blocked for {seconds} s"
    return outcome[0]


def make_fifo(directory):
    """A FIFO nobody has open; returns (its path, the words for its type)."""
    path = os.path.join(directory, "pipe")
    os.mkfifo(path)
    return path, "FIFO"


def make_socket(directory):
    """A Unix socket file (bound, then closed: the file stays); returns (path, type words)."""
    path = os.path.join(directory, "sock")
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(path)
    return path, "Unix socket"


def dev_zero(directory):
    """/dev/zero, a character device that never ends."""
    return "/dev/zero", "character device"


def dev_null(directory):
    """/dev/null, a character device that is always empty."""
    return "/dev/null", "character device"


def own_char_device(directory):
    """A character device node of our own (the null device) in directory; needs root."""
    path = os.path.join(directory, "chr")
    os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    return path, "character device"


def own_block_device(directory):
    """A block device node of our own (a loop device number) in directory; needs root."""
    path = os.path.join(directory, "blk")
    os.mknod(path, stat.S_IFBLK | 0o600, os.makedev(7, 250))
    return path, "block device"


#: Non-regular files that read and edit must refuse at once (never written to).
READ_TARGETS = [make_fifo, make_socket, dev_zero, dev_null,
                pytest.param(own_char_device, marks=pytest.mark.root),
                pytest.param(own_block_device, marks=pytest.mark.root)]
#: Non-regular files write must refuse and leave in place: our own nodes, never /dev's.
WRITE_TARGETS = [make_fifo, make_socket,
                 pytest.param(own_char_device, marks=pytest.mark.root),
                 pytest.param(own_block_device, marks=pytest.mark.root)]


def node_identity(path):
    """The type, inode and device of path, to prove it was left in place."""
    info = os.lstat(path)
    return stat.S_IFMT(info.st_mode), info.st_ino, info.st_dev, info.st_rdev


# -- non-regular files --------------------------------------------------------


@pytest.mark.parametrize("make", READ_TARGETS)
def test_read_refuses_non_regular_files_at_once(tmp_path, make):
    """read refuses a FIFO, a socket or a device at once, naming the path and its type."""
    path, kind = make(str(tmp_path))
    started = time.monotonic()
    result = run_with_deadline(read_file, str(tmp_path), path)
    assert result["isError"] is True
    assert text_of(result).startswith(f"{path} is a {kind}")
    assert "not a regular file" in text_of(result)
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("make", READ_TARGETS)
def test_edit_refuses_non_regular_files_at_once(tmp_path, make):
    """edit refuses a FIFO, a socket or a device at once and leaves it as it was."""
    path, kind = make(str(tmp_path))
    before = node_identity(path)
    result = run_with_deadline(edit_file, str(tmp_path), path,
                               [{"oldText": "a", "newText": "b"}])
    assert result["isError"] is True
    assert text_of(result).startswith(f"{path} is a {kind}")
    assert node_identity(path) == before


@pytest.mark.parametrize("make", WRITE_TARGETS)
def test_write_refuses_non_regular_files_and_keeps_them(tmp_path, make):
    """write refuses to replace a FIFO, a socket or a device node, which stays in place."""
    path, kind = make(str(tmp_path))
    before = node_identity(path)
    result = run_with_deadline(write_file, str(tmp_path), path, "new content")
    assert result["isError"] is True
    assert text_of(result).startswith(f"{path} is a {kind}")
    assert node_identity(path) == before
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(path)]


def test_write_through_a_symlink_to_a_fifo_is_refused(tmp_path):
    """A symbolic link to a FIFO is refused too, and neither the link nor the FIFO changes."""
    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "link").symlink_to("pipe")
    result = run_with_deadline(write_file, str(tmp_path), "link", "x")
    assert result["isError"] is True
    assert "FIFO" in text_of(result)
    assert (tmp_path / "link").is_symlink() and stat.S_ISFIFO(os.stat(tmp_path / "pipe").st_mode)


#: Run by a separate process: swap a regular file and a FIFO at argv[1], forever.
SWAPPER = """
import os, sys
target, spare = sys.argv[1], sys.argv[2]
while True:
    os.mkfifo(spare)
    os.rename(spare, target)
    with open(spare, "w") as file:
        file.write("old text\\n")
    os.rename(spare, target)
"""


def test_a_file_swapped_for_a_fifo_never_blocks_read_or_edit(tmp_path):
    """A process swapping a regular file and a FIFO under read and edit never blocks them."""
    target = tmp_path / "target"
    target.write_text("old text\n")
    swapper = subprocess.Popen([sys.executable, "-I", "-c", SWAPPER, str(target),
                                str(tmp_path / "spare")])
    outcomes = set()

    def hammer():
        # At least 20000 rounds, and until both a FIFO and a regular file were met.
        rounds = 0
        while rounds < 20000 or not {"FIFO", "ok"} <= outcomes:
            rounds += 1
            for result in (read_file(str(tmp_path), "target"),
                           edit_file(str(tmp_path), "target",
                                     [{"oldText": "old", "newText": "new"}])):
                text = text_of(result)
                outcomes.add("FIFO" if "FIFO" in text else "ok" if not result["isError"]
                             else "changed" if "changed while" in text
                             else "edited already" if "oldText not found" in text else text)
        return True

    try:
        run_with_deadline(hammer, seconds=30)
    finally:
        swapper.kill()
        swapper.wait()
    assert outcomes <= {"FIFO", "ok", "changed", "edited already"}, outcomes


def test_the_runner_answers_at_once_for_fifos_devices_and_sockets(runner):
    """Through a real runner, read, write and edit of special files answer and ping still works."""
    path_fifo, _ = make_fifo(str(runner.workspace))
    path_socket, _ = make_socket(str(runner.workspace))
    for path in ("pipe", "sock", "/dev/zero", "/dev/null"):
        read = runner.call_tool("read", {"path": path}, timeout=5)
        assert read["isError"] is True and "not a regular file" in text_of(read)
        edited = runner.call_tool("edit", {"path": path,
                                           "edits": [{"oldText": "a", "newText": "b"}]},
                                  timeout=5)
        assert edited["isError"] is True and "not a regular file" in text_of(edited)
    for path in ("pipe", "sock"):
        written = runner.call_tool("write", {"path": path, "content": "x"}, timeout=5)
        assert written["isError"] is True and "not a regular file" in text_of(written)
    assert stat.S_ISFIFO(os.stat(path_fifo).st_mode)
    assert stat.S_ISSOCK(os.stat(path_socket).st_mode)
    assert runner.call("ping")["result"] == {}


# -- size caps ----------------------------------------------------------------


def start_initialized(start_runner, *options):
    """A runner started with options, past initialize."""
    process = start_runner(*options)
    answer = process.call("initialize", {"protocolVersion": "2025-11-25", "capabilities": {},
                                         "clientInfo": {"name": "tests", "version": "0"}})
    assert "result" in answer, answer
    return process


def sparse_text_file(path, size, tail=b""):
    """A file of size bytes: 2000 text lines, a hole of NUL bytes, then tail at the very end."""
    with open(path, "wb") as file:
        file.write(b"".join(b"line %d\n" % number for number in range(1, 2001)))
        file.truncate(size - len(tail))
        file.seek(0, os.SEEK_END)
        file.write(tail)


def test_read_refuses_a_sparse_10_gib_file_at_once(start_runner):
    """A 10 GiB text file is refused at once by the default 64 MiB cap, which suggests bash."""
    runner = start_initialized(start_runner)
    sparse_text_file(runner.workspace / "huge.log", 10 * GIB, tail=b"the end\n")
    started = time.monotonic()
    result = runner.call_tool("read", {"path": "huge.log", "offset": 10 ** 9}, timeout=10)
    assert time.monotonic() - started < 5
    assert result["isError"] is True
    text = text_of(result)
    assert text.startswith(f"huge.log is 10 GiB ({10 * GIB} bytes), larger than the 64 MiB "
                           "read opens")
    assert "head -n" in text and "sed -n" in text and "tail -n" in text
    assert runner.peak_memory_kib() < PEAK_MEMORY_KIB


def test_read_serves_the_end_of_a_large_sparse_file_in_bounded_memory(start_runner):
    """With a raised cap, the last lines of a 256 MiB file are shown without holding the file."""
    runner = start_initialized(start_runner, "--max-read-bytes", str(GIB))
    sparse_text_file(runner.workspace / "big.log", 256 * MIB, tail=b"\nlast but one\nlast\n")
    result = runner.call_tool("read", {"path": "big.log", "offset": 2002}, timeout=60)
    assert result["isError"] is False, result
    assert text_of(result) == "last but one\nlast\n"
    assert result["structuredContent"]["totalLines"] == 2003
    assert runner.peak_memory_kib() < PEAK_MEMORY_KIB


def test_read_a_100_mib_line_gives_the_line_too_long_note(start_runner):
    """A 100 MiB file without a newline reads as the documented note, in bounded memory."""
    runner = start_initialized(start_runner, "--max-read-bytes", str(200 * MIB))
    with open(runner.workspace / "one-line.txt", "wb") as file:
        piece = b"x" * MIB
        for _ in range(100):
            file.write(piece)
    result = runner.call_tool("read", {"path": "one-line.txt"}, timeout=60)
    assert result["isError"] is False
    assert text_of(result) == (
        "[Line 1 of one-line.txt is longer than 51200 bytes, the most read shows at once. "
        "Use bash: sed -n '1p' one-line.txt | head -c 51200]")
    assert result["structuredContent"]["totalLines"] == 1
    assert runner.peak_memory_kib() < PEAK_MEMORY_KIB


def test_read_cap_is_inclusive(tmp_path):
    """A text file of exactly max_bytes is read; one byte more is refused."""
    (tmp_path / "fits.txt").write_bytes(b"abcdefghi\n" * 100)
    assert read_file(str(tmp_path), "fits.txt", max_bytes=1000)["isError"] is False
    (tmp_path / "over.txt").write_bytes(b"abcdefghi\n" * 100 + b"!")
    result = read_file(str(tmp_path), "over.txt", max_bytes=1000)
    assert result["isError"] is True
    assert text_of(result).startswith("over.txt is 1001 bytes, larger than the 1000 bytes "
                                      "read opens")


def test_read_stops_at_the_cap_when_the_size_says_less(tmp_path):
    """A file whose size says 0 (as in /proc) is read only up to the cap, then refused."""
    maps = "/proc/self/maps"
    assert os.stat(maps).st_size == 0
    assert read_file(str(tmp_path), maps)["isError"] is False
    result = read_file(str(tmp_path), maps, max_bytes=100)
    assert result["isError"] is True
    assert "turned out, while it was read, to hold more than the 100 bytes read opens" in \
        text_of(result)


def test_read_refuses_an_image_over_5_mib_without_reading_it(tmp_path):
    """The 5 MiB image cap still holds, and a huge image is refused at once."""
    png_header = b"\x89PNG\r\n\x1a\n" + b"\0" * 100
    with open(tmp_path / "big.png", "wb") as file:
        file.write(png_header)
        file.truncate(10 * GIB)
    result = run_with_deadline(read_file, str(tmp_path), "big.png", seconds=5)
    assert result["isError"] is True
    assert "is an image (image/png) larger than 5242880 bytes" in text_of(result)


def test_edit_refuses_a_file_over_the_cap(start_runner):
    """edit refuses a file over --max-edit-bytes, leaves it untouched, and edits one at the cap."""
    runner = start_initialized(start_runner, "--max-edit-bytes", "1000")
    target = runner.workspace / "f.txt"
    target.write_bytes(b"a" * 1000 + b"\nzz\n")
    before = target.read_bytes()
    result = runner.call_tool("edit", {"path": "f.txt",
                                       "edits": [{"oldText": "zz", "newText": "yy"}]})
    assert result["isError"] is True
    assert text_of(result).startswith("f.txt is 1004 bytes, larger than the 1000 bytes edit "
                                      "works on; it was not changed.")
    assert "sed -i" in text_of(result)
    assert target.read_bytes() == before
    target.write_bytes(b"a" * 996 + b"\nzz\n")
    result = runner.call_tool("edit", {"path": "f.txt",
                                       "edits": [{"oldText": "zz", "newText": "yy"}]})
    assert result["isError"] is False
    assert target.read_bytes() == b"a" * 996 + b"\nyy\n"


def test_edit_refuses_a_sparse_10_gib_file_at_once(tmp_path):
    """A 10 GiB file is refused by the default 16 MiB edit cap without being read."""
    with open(tmp_path / "huge.txt", "wb") as file:
        file.write(b"text\n")
        file.truncate(10 * GIB)
    result = run_with_deadline(edit_file, str(tmp_path), "huge.txt",
                               [{"oldText": "text", "newText": "t"}], seconds=5)
    assert result["isError"] is True
    assert text_of(result).startswith(f"huge.txt is 10 GiB ({10 * GIB} bytes), larger than "
                                      "the 16 MiB edit works on")


def test_size_options_are_parsed_with_their_defaults():
    """--max-read-bytes and --max-edit-bytes are read, and default to the files module's caps."""
    options = parse_options(["--workspace", "/w", "--max-read-bytes", "1000",
                             "--max-edit-bytes=2000"])
    assert (options.max_read_bytes, options.max_edit_bytes) == (1000, 2000)
    defaults = Options("/w")
    assert defaults.max_read_bytes == files.DEFAULT_MAX_READ_BYTES == 64 * MIB
    assert defaults.max_edit_bytes == files.DEFAULT_MAX_EDIT_BYTES == 16 * MIB
    for bad in (["--max-read-bytes", "0"], ["--max-edit-bytes", "-5"],
                ["--max-read-bytes", "64M"], ["--max-edit-bytes"]):
        with pytest.raises(UsageError):
            parse_options(["--workspace", "/w", *bad])


def test_tool_descriptions_state_the_caps(start_runner):
    """tools/list tells the model the read and edit caps the runner was started with."""
    runner = start_initialized(start_runner, "--max-read-bytes", str(2 * MIB),
                               "--max-edit-bytes", "4096")
    tools = {tool["name"]: tool for tool in runner.call("tools/list")["result"]["tools"]}
    assert "text files over 2 MiB" in tools["read"]["description"]
    assert "Files over 4 KiB are refused" in tools["edit"]["description"]


# -- a full disk --------------------------------------------------------------


@pytest.fixture
def small_disk():
    """A real 1 MiB tmpfs mounted on a fresh directory; unmounted (and removed) afterwards."""
    mount_point = tempfile.mkdtemp(prefix="corral-full-disk-")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0755", "tmpfs", mount_point],
                   check=True)
    try:
        yield mount_point
    finally:
        if subprocess.run(["umount", mount_point]).returncode != 0:
            subprocess.run(["umount", "-l", mount_point], check=True)
        os.rmdir(mount_point)


def fill(directory):
    """Fill the file system holding directory to its last byte, with one filler file."""
    with open(os.path.join(directory, "filler"), "wb", buffering=0) as file:
        piece = b"\xff" * 4096
        while True:
            try:
                file.write(piece)
            except OSError as error:
                assert error.errno == errno.ENOSPC, error
                break
        try:  # the last partial page, byte by byte
            while file.write(b"\xff"):
                pass
        except OSError as error:
            assert error.errno == errno.ENOSPC, error


def tree(directory):
    """Every path under directory with the bytes of each file, to compare before and after."""
    found = {}
    for parent, directories, names in os.walk(directory):
        for name in directories:
            found[os.path.relpath(os.path.join(parent, name), directory)] = None
        for name in names:
            with open(os.path.join(parent, name), "rb") as file:
                found[os.path.relpath(os.path.join(parent, name), directory)] = file.read()
    return found


@pytest.fixture
def runner_on_full_disk(small_disk):
    """A runner whose workspace is on a full 1 MiB tmpfs holding notes.txt; stopped afterwards."""
    workspace = os.path.join(small_disk, "workspace")
    os.mkdir(workspace)
    with open(os.path.join(workspace, "notes.txt"), "wb") as file:
        file.write(b"title\r\n" + b"a line of notes\r\n" * 100)
    fill(small_disk)
    runner = RunnerProcess(workspace)
    try:
        yield runner
    finally:
        runner.stop()


@pytest.mark.root
def test_write_on_a_full_disk_keeps_the_file_and_says_so(runner_on_full_disk):
    """On a full disk write fails with a sentence, and leaves the file and no temporary behind."""
    runner = runner_on_full_disk
    before = tree(runner.workspace)
    result = runner.call_tool("write", {"path": "notes.txt", "content": "replaced\n" * 1000})
    assert result["isError"] is True
    assert text_of(result).startswith("Cannot write notes.txt: the disk is full (no space left "
                                      "on device). Nothing was written: notes.txt is as it was "
                                      "before.")
    assert result["structuredContent"]["path"] == "notes.txt"
    assert tree(runner.workspace) == before
    # A new file in new directories: the directories it made are removed again.
    result = runner.call_tool("write", {"path": "new/deeper/file.txt", "content": "x" * 5000})
    assert result["isError"] is True and "the disk is full" in text_of(result)
    assert tree(runner.workspace) == before
    # Once there is room again, the same runner writes.
    os.unlink(os.path.join(os.path.dirname(runner.workspace), "filler"))
    result = runner.call_tool("write", {"path": "notes.txt", "content": "replaced\n"})
    assert result["isError"] is False
    assert (runner.workspace / "notes.txt").read_bytes() == b"replaced\n"


@pytest.mark.root
def test_edit_on_a_full_disk_keeps_the_file_and_says_so(runner_on_full_disk):
    """On a full disk edit fails with a sentence, and leaves the file and no temporary behind."""
    runner = runner_on_full_disk
    target = runner.workspace / "notes.txt"
    before = tree(runner.workspace)
    inode = target.stat().st_ino
    result = runner.call_tool("edit", {"path": "notes.txt", "edits": [
        {"oldText": "title\na line", "newText": "TITLE\nA LINE"}]})
    assert result["isError"] is True
    assert text_of(result).startswith("Cannot edit notes.txt: the disk is full (no space left "
                                      "on device). Nothing was written")
    assert tree(runner.workspace) == before
    assert target.stat().st_ino == inode
    assert runner.call("ping")["result"] == {}


def test_quota_exceeded_is_reported_as_a_full_quota(tmp_path):
    """EDQUOT reads as a full disk quota, naming the path (the kernel here has no tmpfs quotas)."""
    result = files._os_error(OSError(errno.EDQUOT, os.strerror(errno.EDQUOT)), "a.txt", "write",
                             str(tmp_path))
    assert text_of(result).startswith("Cannot write a.txt: the disk quota is full")
    assert "Nothing was written: a.txt is as it was before." in text_of(result)
