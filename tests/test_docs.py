"""Every code block of the README and the docs runs as written, or says why it is not run.

A page's ``python`` blocks run in order as one script, in a fresh process on the suite's 8
simulated CPU devices (from a scratch directory, so files they write land there). A block that
cannot run here (it needs a cluster, a GPU, minutes, or names defined on another page) is marked
on the line before it with ``<!-- not run: the reason -->``; shell blocks are always marked.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import qsdp_jax as q

REPO = Path(__file__).resolve().parents[1]
FENCE = re.compile(
    r"^(?P<marker><!--\s*not run:(?P<reason>.*?)-->\s*\n)?```(?P<lang>[A-Za-z0-9_+-]*)[^\n]*\n"
    r"(?P<code>.*?)^```\s*$",
    re.M | re.S,
)
CODE_LANGS = {"python", "bash", "sh", "shell", "console"}


def pages() -> list[Path]:
    docs = [p for p in sorted((REPO / "docs").rglob("*.md")) if "_build" not in p.parts and "generated" not in p.parts]
    return [REPO / "README.md", *docs]


def blocks(page: Path) -> list[dict]:
    """The page's code blocks: language, code, and the not-run reason (None when it runs)."""
    out = []
    for m in FENCE.finditer(page.read_text()):
        if m["lang"] not in CODE_LANGS:
            continue  # text, output, directives ({toctree}, {include}, ...)
        reason = m["reason"].strip() if m["marker"] else None
        out.append(
            {
                "lang": m["lang"],
                "code": m["code"],
                "reason": reason,
                "line": page.read_text()[: m.start()].count("\n") + 1,
            }
        )
    return out


def _name(page: Path) -> str:
    return str(page.relative_to(REPO))


# What a page's script must leave behind, checked after it ran (beyond exiting 0).
AFTER = {
    "README.md": "assert int(state.step) == 1 and np.isfinite(float(metrics['loss']))\n"
    "assert state.layout.group('blocks').stacked\n"
    "assert not np.array_equal(np.asarray(model.blocks.fc.kernel[...]),\n"
    "                          np.asarray(Model(nnx.Rngs(0)).blocks.fc.kernel[...]))\n",
    "docs/guides/nnx.md": "assert int(state.step) == 1 and np.isfinite(float(metrics['loss']))\n",
    "docs/guides/param_access.md": "assert full['blocks']['w'].shape == (12, 512, 512)\nassert int(state.step) == 1\n",
}


def test_marked_blocks_say_why_and_shell_blocks_are_marked():
    found = 0
    for page in pages():
        for b in blocks(page):
            found += 1
            where = f"{_name(page)}:{b['line']}"
            if b["reason"] is not None:
                assert b["reason"], f"{where}: a not-run marker needs a reason"
            elif b["lang"] != "python":
                pytest.fail(f"{where}: a {b['lang']} block must be marked <!-- not run: why -->")
    assert found > 10  # the pages were read


RUNNABLE = [p for p in pages() if any(b["lang"] == "python" and b["reason"] is None for b in blocks(p))]


@pytest.mark.parametrize("page", RUNNABLE, ids=_name)
def test_page_code_runs(page, tmp_path):
    code = [b["code"] for b in blocks(page) if b["lang"] == "python" and b["reason"] is None]
    script = tmp_path / "page.py"
    script.write_text("\n".join(code) + "\nimport numpy as np\n" + AFTER.get(_name(page), ""))
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=600,
    )
    assert done.returncode == 0, f"{_name(page)}:\n{done.stderr[-3000:]}"
    if _name(page) == "docs/guides/checkpoints.md":  # the guide's checkpoint is complete and restorable
        with q.Checkpointer(tmp_path / "ckpt") as ckpt:
            assert ckpt.all_steps()
            assert ckpt.load_arrays()  # every checksum verified


def test_results_tables_render_from_the_committed_json(tmp_path, monkeypatch):
    """The docs' results tables come from experiments/results/*.json through the benchmarks' own
    report code; a results file that is missing fails the build naming it."""
    sys.path.insert(0, str(REPO / "docs" / "_ext"))
    import results_tables as rt

    written = rt.render_all(tmp_path)
    assert {p.stem for p in written} == set(rt.TABLES)
    for p in written:
        text = p.read_text()
        assert "Rendered from `experiments/results/" in text and len(text.splitlines()) > 4, p
    monkeypatch.setattr(rt, "RESULTS", tmp_path / "nowhere")
    with pytest.raises(RuntimeError, match=r"cannot read .*nowhere/comm_bytes.json"):
        rt.render_all(tmp_path / "out")
