"""The read, write and edit tools, called directly and through a runner."""

import base64
import os
import stat
import threading

import pytest

from runner import files
from runner.files import READ_MAX_BYTES, edit_file, read_file, write_file

PNG = (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x01\x00\x00\x00\x01\x08\x06\x00\x00\x00"
       b"\x1f\x15\xc4\x89\x00\x00\x00\rIDATx\x9cc\xf8\x0f\x00\x00\x01\x01\x00\x05\x18\xd8N\x00"
       b"\x00\x00\x00IEND\xaeB`\x82")


def text_of(result):
    """The text of a result's first content item."""
    return result["content"][0]["text"]


def run_with_deadline(function, *arguments, seconds=10):
    """Call function in a thread; fail if it has not returned within seconds."""
    outcome = []
    thread = threading.Thread(target=lambda: outcome.append(function(*arguments)), daemon=True)
    thread.start()
    thread.join(seconds)
    assert outcome, f"{function.__name__} blocked for {seconds} s"
    return outcome[0]


# -- read -----------------------------------------------------------------


def test_read_returns_the_whole_small_file(tmp_path):
    """A short file comes back whole, with its line count."""
    (tmp_path / "a.txt").write_text("one\ntwo\n")
    result = read_file(str(tmp_path), "a.txt")
    assert result["isError"] is False
    assert text_of(result) == "one\ntwo\n"
    assert result["structuredContent"] == {"path": "a.txt", "startLine": 1, "endLine": 2,
                                           "totalLines": 2, "truncated": False,
                                           "nextOffset": None}


def test_read_offset_and_limit_with_a_continue_note(tmp_path):
    """offset and limit pick lines, and a note says which offset continues."""
    (tmp_path / "a.txt").write_text("".join(f"line {n}\n" for n in range(1, 11)))
    result = read_file(str(tmp_path), "a.txt", offset=3, limit=4)
    assert text_of(result) == ("line 3\nline 4\nline 5\nline 6\n\n"
                               "[Showing lines 3-6 of 10. Use offset=7 to continue.]")
    assert result["structuredContent"]["nextOffset"] == 7
    rest = read_file(str(tmp_path), "a.txt", offset=7)
    assert text_of(rest) == "line 7\nline 8\nline 9\nline 10\n"
    assert rest["structuredContent"]["truncated"] is False


def test_read_stops_at_2000_lines(tmp_path):
    """A long file shows 2000 lines, even when a larger limit is asked for."""
    (tmp_path / "long.txt").write_text("".join(f"{n}\n" for n in range(1, 5001)))
    result = read_file(str(tmp_path), "long.txt", limit=3000)
    body, note = text_of(result).split("\n\n")
    assert body.split("\n") == [str(n) for n in range(1, 2001)]
    assert note == "[Showing lines 1-2000 of 5000. Use offset=2001 to continue.]"


def test_read_stops_at_50_kib_on_a_line_boundary(tmp_path):
    """Past 50 KiB read stops before the line that would cross the limit."""
    line = "x" * 99 + "\n"
    (tmp_path / "wide.txt").write_text(line * 1000)
    result = read_file(str(tmp_path), "wide.txt")
    body = text_of(result).split("\n\n")[0] + "\n"
    assert body == line * (READ_MAX_BYTES // 100)
    assert result["structuredContent"]["endLine"] == READ_MAX_BYTES // 100


def test_read_last_line_without_newline(tmp_path):
    """A final line without a newline counts and is shown as it is."""
    (tmp_path / "a.txt").write_text("a\nb")
    result = read_file(str(tmp_path), "a.txt")
    assert text_of(result) == "a\nb"
    assert result["structuredContent"]["totalLines"] == 2


def test_read_offset_past_the_end_is_an_error(tmp_path):
    """An offset beyond the last line is an error that gives the length."""
    (tmp_path / "a.txt").write_text("".join(f"{n}\n" for n in range(12)))
    result = read_file(str(tmp_path), "a.txt", offset=50)
    assert result["isError"] is True
    assert text_of(result) == "offset 50 is beyond the end of the file (12 lines)."


def test_read_a_first_line_over_50_kib_suggests_sed(tmp_path):
    """A line longer than 50 KiB is not cut; the answer says how to see it with bash."""
    (tmp_path / "big.txt").write_text("short\n" + "y" * 60000 + "\nend\n")
    result = read_file(str(tmp_path), "big.txt", offset=2)
    text = text_of(result)
    assert "yyy" not in text
    assert "sed -n '2p' big.txt | head -c 51200" in text
    assert result["structuredContent"]["nextOffset"] == 3
    after = read_file(str(tmp_path), "big.txt", offset=3)
    assert text_of(after).startswith("end")


def test_read_empty_file(tmp_path):
    """An empty file reads as empty, with no error."""
    (tmp_path / "empty").write_bytes(b"")
    result = read_file(str(tmp_path), "empty")
    assert result["isError"] is False
    assert result["structuredContent"]["totalLines"] == 0
    assert text_of(result) == "(empty file)"


def test_read_image_returns_image_content(tmp_path):
    """A PNG comes back as MCP image content carrying the file's bytes."""
    (tmp_path / "dot.png").write_bytes(PNG)
    result = read_file(str(tmp_path), "dot.png")
    assert result["isError"] is False
    image = result["content"][1]
    assert image["type"] == "image" and image["mimeType"] == "image/png"
    assert base64.b64decode(image["data"]) == PNG
    assert result["content"][0]["type"] == "text"


@pytest.mark.parametrize("data, mime_type", [
    (b"\xff\xd8\xff\xe0" + b"\0" * 20, "image/jpeg"),
    (b"GIF89a" + b"\0" * 20, "image/gif"),
    (b"RIFF\x10\0\0\0WEBPVP8 " + b"\0" * 20, "image/webp"),
])
def test_read_recognises_image_types_by_magic_bytes(tmp_path, data, mime_type):
    """JPEG, GIF and WebP are recognised by their first bytes, whatever the name."""
    (tmp_path / "picture.dat").write_bytes(data)
    assert read_file(str(tmp_path), "picture.dat")["content"][1]["mimeType"] == mime_type


def test_read_binary_file_is_an_error(tmp_path):
    """A file with NUL bytes is refused as binary, with its size."""
    (tmp_path / "blob").write_bytes(b"abc\0def")
    result = read_file(str(tmp_path), "blob")
    assert result["isError"] is True
    assert text_of(result).startswith("blob is a binary file (7 bytes)")


def test_read_invalid_utf8_is_an_error(tmp_path):
    """A file that is not UTF-8 is refused as binary."""
    (tmp_path / "latin1.txt").write_bytes("café\n".encode("latin-1"))
    result = read_file(str(tmp_path), "latin1.txt")
    assert result["isError"] is True
    assert "binary file" in text_of(result) and "UTF-8" in text_of(result)


def test_read_keeps_a_multibyte_character_across_the_sniff_boundary(tmp_path):
    """UTF-8 text whose 8 KiB sniff window cuts a character is still text."""
    content = "a" * (files.SNIFF_BYTES - 1) + "é\n"
    (tmp_path / "a.txt").write_text(content)
    assert text_of(read_file(str(tmp_path), "a.txt")) == content


def test_read_directory_is_an_error(tmp_path):
    """A directory is refused with a hint to list it."""
    (tmp_path / "sub").mkdir()
    result = read_file(str(tmp_path), "sub")
    assert result["isError"] is True
    assert "is a directory" in text_of(result)


def test_read_fifo_does_not_block(tmp_path):
    """A FIFO with no writer is refused at once instead of blocking."""
    os.mkfifo(tmp_path / "pipe")
    result = run_with_deadline(read_file, str(tmp_path), "pipe")
    assert result["isError"] is True
    assert "FIFO" in text_of(result)


def test_read_missing_file_is_an_error(tmp_path):
    """A missing file is an error that names the workspace."""
    result = read_file(str(tmp_path), "nope.txt")
    assert result["isError"] is True
    assert "nope.txt does not exist" in text_of(result)
    assert str(tmp_path) in text_of(result)


def test_read_resolves_home_and_absolute_paths(tmp_path, monkeypatch):
    """~ expands to $HOME and absolute paths ignore the workspace."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "notes").write_text("home\n")
    monkeypatch.setenv("HOME", str(home))
    assert text_of(read_file("/nonexistent", "~/notes")) == "home\n"
    assert text_of(read_file("/nonexistent", str(home / "notes"))) == "home\n"


def test_read_path_with_nul_is_an_error(tmp_path):
    """A path holding a NUL byte is an error, not a crash."""
    assert read_file(str(tmp_path), "a\0b")["isError"] is True


# -- write ----------------------------------------------------------------


def test_write_creates_parent_directories(tmp_path):
    """write creates missing parent directories and reports the byte count."""
    result = write_file(str(tmp_path), "deep/er/file.txt", "hello")
    assert result["isError"] is False
    assert text_of(result) == "Wrote 5 bytes to deep/er/file.txt"
    assert (tmp_path / "deep/er/file.txt").read_bytes() == b"hello"


def test_write_is_byte_faithful(tmp_path):
    """CRLF, lone CR, non-ASCII and a missing final newline are written exactly."""
    content = "line1\r\nline2\rcafé ☃ 𝄞\n\ttab"
    result = write_file(str(tmp_path), "f.txt", content)
    assert (tmp_path / "f.txt").read_bytes() == content.encode("utf-8")
    assert result["structuredContent"]["bytes"] == len(content.encode("utf-8"))


def test_write_keeps_the_mode_of_an_existing_file(tmp_path):
    """Replacing a file keeps its permission bits."""
    target = tmp_path / "script.sh"
    target.write_text("old")
    target.chmod(0o750)
    write_file(str(tmp_path), "script.sh", "new")
    assert stat.S_IMODE(target.stat().st_mode) == 0o750
    assert target.read_text() == "new"


def test_write_new_file_mode_follows_the_umask(tmp_path):
    """A new file gets 0o644 less the umask."""
    old = os.umask(0o027)
    try:
        write_file(str(tmp_path), "new.txt", "x")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "new.txt").stat().st_mode) == 0o640


def test_write_is_atomic_for_readers(tmp_path):
    """A reader never sees a partly written file or a temporary file under the target name."""
    old, new = "A" * 300000, "B" * 300000
    target = tmp_path / "big.txt"
    target.write_text(old)
    seen = set()
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            seen.add(target.read_text())

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for index in range(20):
            write_file(str(tmp_path), "big.txt", new if index % 2 == 0 else old)
    finally:
        stop.set()
        watcher.join()
    assert seen <= {old, new}
    assert os.listdir(tmp_path) == ["big.txt"]


def test_write_failure_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    """If the final rename fails, the target is unchanged and the temporary file is removed."""
    target = tmp_path / "keep.txt"
    target.write_text("original")

    def broken_replace(source, destination):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files.os, "replace", broken_replace)
    result = write_file(str(tmp_path), "keep.txt", "new")
    assert result["isError"] is True
    assert "the disk is full" in text_of(result)
    assert target.read_text() == "original"
    assert os.listdir(tmp_path) == ["keep.txt"]


def test_write_follows_a_symlink_to_its_target(tmp_path):
    """Writing to a symlink replaces the file it points to and keeps the link."""
    (tmp_path / "real.txt").write_text("old")
    (tmp_path / "link.txt").symlink_to("real.txt")
    write_file(str(tmp_path), "link.txt", "new")
    assert (tmp_path / "link.txt").is_symlink()
    assert (tmp_path / "real.txt").read_text() == "new"


def test_write_refuses_a_directory(tmp_path):
    """A directory target is refused."""
    (tmp_path / "d").mkdir()
    result = write_file(str(tmp_path), "d", "x")
    assert result["isError"] is True
    assert "is a directory" in text_of(result)


def test_write_refuses_a_fifo_without_blocking(tmp_path):
    """A FIFO target is refused at once."""
    os.mkfifo(tmp_path / "pipe")
    result = run_with_deadline(write_file, str(tmp_path), "pipe", "x")
    assert result["isError"] is True
    assert "FIFO" in text_of(result)


def test_write_refuses_a_file_under_a_file(tmp_path):
    """A parent path that is a file is an error, not a crash."""
    (tmp_path / "plain").write_text("x")
    result = write_file(str(tmp_path), "plain/child.txt", "y")
    assert result["isError"] is True


def test_write_refuses_a_read_only_file(tmp_path, monkeypatch):
    """A file the runner may not write is not replaced, though its directory is writable."""
    target = tmp_path / "ro.txt"
    target.write_text("keep")
    target.chmod(0o444)
    if os.geteuid() == 0:  # root may write anything: make access() answer as for a user
        monkeypatch.setattr(files.os, "access", lambda path, mode: False)
    result = write_file(str(tmp_path), "ro.txt", "x")
    assert result["isError"] is True
    assert target.read_text() == "keep"


def test_write_refuses_unpaired_surrogates(tmp_path):
    """Content that UTF-8 cannot encode is refused and nothing is written."""
    result = write_file(str(tmp_path), "s.txt", "a\ud800b")
    assert result["isError"] is True
    assert not (tmp_path / "s.txt").exists()


# -- edit -----------------------------------------------------------------


def snapshot(path):
    """The bytes, inode and modification time of path."""
    info = path.stat()
    return path.read_bytes(), info.st_ino, info.st_mtime_ns


def test_edit_applies_several_edits_to_the_original(tmp_path):
    """All edits match the original text, not text changed by earlier edits."""
    target = tmp_path / "code.py"
    target.write_text("alpha\nbeta\ngamma\n")
    result = edit_file(str(tmp_path), "code.py", [
        {"oldText": "gamma", "newText": "GAMMA"},
        {"oldText": "alpha", "newText": "beta"},
        {"oldText": "beta\n", "newText": "BETA\n"},
    ])
    assert result["isError"] is False
    assert target.read_text() == "beta\nBETA\nGAMMA\n"


def test_edit_result_shows_a_unified_diff(tmp_path):
    """The result carries a unified diff and the first changed line."""
    target = tmp_path / "f.txt"
    target.write_text("".join(f"line {n}\n" for n in range(1, 11)))
    result = edit_file(str(tmp_path), "f.txt", [{"oldText": "line 6\n", "newText": "six\n"}])
    diff = result["structuredContent"]["diff"]
    assert diff.startswith("--- a/f.txt\n+++ b/f.txt\n@@ -3,7 +3,7 @@\n")
    assert "-line 6\n+six\n" in diff
    assert " line 3\n" in diff and " line 9\n" in diff and "line 2" not in diff
    assert result["structuredContent"]["firstChangedLine"] == 6
    assert diff in text_of(result)


def test_edit_first_changed_line_skips_an_unchanged_prefix(tmp_path):
    """firstChangedLine points at the first line that really differs."""
    (tmp_path / "f.txt").write_text("a\nb\nc\nd\n")
    result = edit_file(str(tmp_path), "f.txt", [{"oldText": "a\nb\nc", "newText": "a\nb\nC"}])
    assert result["structuredContent"]["firstChangedLine"] == 3


@pytest.mark.parametrize("edits, message", [
    ([{"oldText": "one", "newText": "1"}, {"oldText": "zzz", "newText": "z"}],
     "edit 2: oldText not found in f.txt"),
    ([{"oldText": "word", "newText": "w"}],
     "edit 1: oldText occurs 3 times in f.txt; add surrounding context"),
    ([{"oldText": "one word", "newText": "x"}, {"oldText": "two", "newText": "y"},
      {"oldText": "word\ntwo", "newText": "z"}], "edits 1 and 3 overlap"),
    ([{"oldText": "one", "newText": "1"}, {"oldText": "", "newText": "x"}],
     "edit 2: oldText is empty"),
    ([{"oldText": "one", "newText": "one"}], "would not change f.txt"),
])
def test_failed_edits_change_nothing(tmp_path, edits, message):
    """A failing edit names the edit and the reason and leaves the file untouched."""
    target = tmp_path / "f.txt"
    target.write_text("one word\ntwo word\nthree word\n")
    before = snapshot(target)
    result = edit_file(str(tmp_path), "f.txt", edits)
    assert result["isError"] is True
    assert message in text_of(result)
    assert snapshot(target) == before
    assert os.listdir(tmp_path) == ["f.txt"]


def test_edit_counts_overlapping_occurrences(tmp_path):
    """An oldText that matches twice with overlap is ambiguous."""
    (tmp_path / "f.txt").write_text("aaa")
    result = edit_file(str(tmp_path), "f.txt", [{"oldText": "aa", "newText": "b"}])
    assert "occurs 2 times" in text_of(result)


def test_edit_preserves_crlf_line_endings(tmp_path):
    """In a CRLF file, LF in oldText matches CRLF and new lines are written with CRLF."""
    target = tmp_path / "win.txt"
    target.write_bytes(b"first\r\nsecond\r\nthird\r\n")
    result = edit_file(str(tmp_path), "win.txt",
                       [{"oldText": "first\nsecond", "newText": "1st\n2nd\nextra"}])
    assert result["isError"] is False
    assert target.read_bytes() == b"1st\r\n2nd\r\nextra\r\nthird\r\n"


def test_edit_accepts_crlf_in_old_text_for_a_crlf_file(tmp_path):
    """CRLF in oldText and newText is treated as LF in a CRLF file."""
    target = tmp_path / "win.txt"
    target.write_bytes(b"a\r\nb\r\n")
    edit_file(str(tmp_path), "win.txt", [{"oldText": "a\r\nb", "newText": "x\r\ny"}])
    assert target.read_bytes() == b"x\r\ny\r\n"


def test_edit_leaves_mixed_line_endings_alone(tmp_path):
    """A file mixing LF and CRLF keeps every ending it had outside the edit."""
    target = tmp_path / "mixed.txt"
    target.write_bytes(b"a\r\nb\nc\r\n")
    edit_file(str(tmp_path), "mixed.txt", [{"oldText": "b", "newText": "B"}])
    assert target.read_bytes() == b"a\r\nB\nc\r\n"


def test_edit_preserves_a_bom(tmp_path):
    """A UTF-8 byte order mark stays at the start of the file."""
    target = tmp_path / "bom.txt"
    target.write_bytes(b"\xef\xbb\xbfhello\r\nworld\r\n")
    edit_file(str(tmp_path), "bom.txt", [{"oldText": "hello", "newText": "bonjour"}])
    assert target.read_bytes() == b"\xef\xbb\xbfbonjour\r\nworld\r\n"


def test_edit_keeps_the_file_mode(tmp_path):
    """An edited file keeps its permission bits."""
    target = tmp_path / "run.sh"
    target.write_text("echo a\n")
    target.chmod(0o700)
    edit_file(str(tmp_path), "run.sh", [{"oldText": "a", "newText": "b"}])
    assert stat.S_IMODE(target.stat().st_mode) == 0o700


def test_edit_refuses_invalid_utf8(tmp_path):
    """A file that is not UTF-8 is not edited."""
    target = tmp_path / "latin1.txt"
    target.write_bytes(b"caf\xe9\n")
    result = edit_file(str(tmp_path), "latin1.txt", [{"oldText": "caf", "newText": "x"}])
    assert result["isError"] is True
    assert "not valid UTF-8" in text_of(result)
    assert target.read_bytes() == b"caf\xe9\n"


def test_edit_missing_file_is_an_error(tmp_path):
    """Editing a missing file is an error result."""
    result = edit_file(str(tmp_path), "nope", [{"oldText": "a", "newText": "b"}])
    assert result["isError"] is True
    assert "does not exist" in text_of(result)


def test_edit_diff_marks_a_missing_final_newline(tmp_path):
    """A last line without a newline is marked in the diff the way diff does."""
    (tmp_path / "f.txt").write_text("a\nb")
    result = edit_file(str(tmp_path), "f.txt", [{"oldText": "b", "newText": "c"}])
    diff = result["structuredContent"]["diff"]
    assert "-b\n\\ No newline at end of file\n+c\n\\ No newline at end of file\n" in diff


# -- through the runner ----------------------------------------------------


def test_file_tools_through_the_runner(runner):
    """write, edit and read work over JSON-RPC with workspace-relative paths."""
    written = runner.call_tool("write", {"path": "notes/a.txt", "content": "hello\r\nworld\n"})
    assert written["isError"] is False
    edited = runner.call_tool("edit", {"path": "notes/a.txt",
                                       "edits": [{"oldText": "world", "newText": "there"}]})
    assert edited["isError"] is False
    assert (runner.workspace / "notes/a.txt").read_bytes() == b"hello\r\nthere\n"
    read = runner.call_tool("read", {"path": "notes/a.txt"})
    assert read["content"][0]["text"] == "hello\r\nthere\n"


def test_image_through_the_runner(runner):
    """An image read over JSON-RPC arrives as base64 image content."""
    (runner.workspace / "dot.png").write_bytes(PNG)
    result = runner.call_tool("read", {"path": "dot.png"})
    assert base64.b64decode(result["content"][1]["data"]) == PNG


def test_file_errors_through_the_runner_are_tool_errors(runner):
    """A missing file is an isError result, not a JSON-RPC error."""
    result = runner.call_tool("read", {"path": "missing.txt"})
    assert result["isError"] is True
