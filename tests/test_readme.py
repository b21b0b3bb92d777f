"""The README's usage example runs as written."""

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

import qsdp_jax as q


def _blocks() -> list[str]:
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    usage = text[text.index("## Usage"):]
    return re.findall(r"```python\n(.*?)```", usage, re.S)


def test_readme_first_example_trains_an_nnx_module():
    """The first usage example is a Flax NNX user's: an nnx.Module trained through qsdp_jax.nnx."""
    env: dict = {}
    exec(compile(_blocks()[0], "README.md", "exec"), env)
    assert np.isfinite(float(env["metrics"]["loss"]))
    assert int(env["state"].step) == 1
    assert env["state"].layout.group("blocks").stacked
    trained = env["model"].blocks.fc.kernel[...]
    assert trained.shape == (4, 128, 128)
    assert not np.array_equal(np.asarray(trained), np.asarray(env["Model"](env["nnx"].Rngs(0)).blocks.fc.kernel[...]))


def test_readme_usage_example_runs():
    env: dict = {}
    exec(compile(_blocks()[1], "README.md", "exec"), env)
    assert env["full"]["blocks"]["w"].shape == (12, 512, 512)
    assert np.isfinite(float(env["metrics"]["loss"]))
    assert int(env["state"].step) == 1


def test_readme_checkpoint_section_keeps_its_checkpoint(tmp_path):
    """The NNX example then the checkpoint section, verbatim, as a script: the checkpoint is
    there after the script ends, and restores."""
    script = tmp_path / "script.py"
    script.write_text(_blocks()[0] + "\n" + _blocks()[4])
    repo = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(repo)}, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    with q.Checkpointer(tmp_path / "ckpt") as ckpt:
        assert ckpt.all_steps() == [1]
        assert ckpt.metadata()["extra"] == {"data_position": 1000}
        assert ckpt.load_arrays()  # every checksum verified
