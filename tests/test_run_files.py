"""experiments.gpt.files.write_atomic: the one atomic writer every result file goes through."""

import os

import pytest

from experiments.gpt.files import write_atomic


def test_writes_text_and_bytes_and_creates_parents(tmp_path):
    target = tmp_path / "a" / "b" / "out.json"
    write_atomic(target, "héllo\n")
    assert target.read_text(encoding="utf-8") == "héllo\n"
    write_atomic(target, b"\x00\x01")
    assert target.read_bytes() == b"\x00\x01"
    assert os.listdir(target.parent) == ["out.json"]  # no temporary file left


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "out.txt"
    target.write_text("old")
    with pytest.raises(TypeError):
        write_atomic(target, 12345)  # neither str nor bytes: fails inside the write
    assert target.read_text() == "old"
    assert os.listdir(tmp_path) == ["out.txt"]
