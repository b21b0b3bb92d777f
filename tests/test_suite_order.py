"""The suite's scheduling list names files that exist (a renamed file would silently drop out
of it and run last again)."""

from pathlib import Path

from tests.conftest import SLOWEST_FIRST


def test_every_file_scheduled_first_exists():
    here = Path(__file__).parent
    missing = [name for name in SLOWEST_FIRST if not (here / name).is_file()]
    assert not missing, f"tests/conftest.py SLOWEST_FIRST names files that do not exist: {missing}"
    assert len(set(SLOWEST_FIRST)) == len(SLOWEST_FIRST)
