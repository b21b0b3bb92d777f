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


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o027, 0o640), (0o002, 0o664)])
def test_files_get_the_umasks_mode_not_private(tmp_path, umask, mode):
    """A run's files are read by a team: the mode of any new file under the umask, where
    mkstemp alone left 0o600 whatever the umask. metrics.jsonl is written the same way."""
    from experiments.gpt.run_files import MetricsLog

    old = os.umask(umask)
    try:
        write_atomic(tmp_path / "summary.json", "{}\n")
        log = MetricsLog(tmp_path / "metrics.jsonl")
        log.append({"step": 1, "loss": 1.0})
        log.close()
    finally:
        os.umask(old)
    for name in ("summary.json", "metrics.jsonl"):
        assert (tmp_path / name).stat().st_mode & 0o777 == mode, name
    assert os.umask(old) == old  # the umask is back as it was
