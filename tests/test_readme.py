"""The README's usage example runs as written."""

import re
from pathlib import Path

import numpy as np


def test_readme_usage_example_runs():
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = re.search(r"## Usage\s+```python\n(.*?)```", text, re.S).group(1)
    env: dict = {}
    exec(compile(block, "README.md", "exec"), env)
    assert env["full"]["blocks"]["w"].shape == (12, 512, 512)
    assert np.isfinite(float(env["metrics"]["loss"]))
    assert int(env["state"].step) == 1
