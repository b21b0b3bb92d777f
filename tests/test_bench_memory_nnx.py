"""experiments.bench.memory_nnx: the list-of-blocks NNX GPT against the scanned stack."""

import json

from experiments.bench import memory_nnx as bm


def test_list_of_blocks_peaks_near_the_stack_and_below_holding_every_block(tmp_path):
    out = tmp_path / "memory_nnx.json"
    argv = ["--preset", "tiny", "--layers", "4", "--schemes", "fp32", "--devices", "8", "--out", str(out)]
    assert bm.main(argv) == 0
    rec = json.loads(out.read_text())
    peak = {r["layout"]: r["peak_bytes"] for r in rec["rows"]}
    assert set(peak) == {"scan", "list", "list-held"}
    assert peak["list"] <= 1.1 * peak["scan"]  # reshard after forward: about one block held
    assert peak["list-held"] > 1.5 * peak["list"]  # every block's weights held to the backward
    assert "vs scan" in rec["table"] and "list-held" in rec["table"]
