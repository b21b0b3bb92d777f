"""The suite's own arrangements: the scheduling list names files that exist (a renamed file
would silently drop out of it and run last again), and the suite's O0 compile is switched back
to XLA's defaults for the tests marked ``optimized``, and only for them."""

from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from tests.conftest import SLOWEST_FIRST, SUITE_O0

SEEN: dict[str, str] = {}


def test_every_file_scheduled_first_exists():
    here = Path(__file__).parent
    missing = [name for name in SLOWEST_FIRST if not (here / name).is_file()]
    assert not missing, f"tests/conftest.py SLOWEST_FIRST names files that do not exist: {missing}"
    assert len(set(SLOWEST_FIRST)) == len(SLOWEST_FIRST)


def _compiled_text():
    return jax.jit(lambda x: jnp.sin(x) * 2.0 + 1.0).lower(jnp.ones(8)).compile().as_text()


@pytest.mark.optimized
def test_a_marked_test_compiles_with_the_defaults():
    assert jax.config.values["jax_disable_most_optimizations"] is False
    SEEN["optimized"] = _compiled_text()  # for the next test, which runs after this one


def test_an_unmarked_test_compiles_at_the_suites_level():
    assert jax.config.values["jax_disable_most_optimizations"] is SUITE_O0
    if SUITE_O0:  # the cache was cleared on the switch: not the optimized executable again
        assert _compiled_text() != SEEN["optimized"]
