"""experiments.bench.memory: the compiled step's peak memory per device, next to the ideal."""

import json

import pytest

from experiments.bench import memory as bm
from experiments.shelf.schemes import split_scheme


def test_tiny_fp32_memory_shrinks_with_devices_and_sits_above_the_ideal(tmp_path):
    out = tmp_path / "memory.json"
    assert bm.main(["--models", "tiny", "--schemes", "fp32", "--devices", "2", "8", "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    two, eight = rec["rows"]
    assert (two["n_devices"], eight["n_devices"]) == (2, 8)
    # the sharded state is 1/N of the sharded part plus the replicated small leaves
    assert eight["state_bytes"] < two["state_bytes"] / 3
    assert eight["peak_bytes"] < two["peak_bytes"]
    for r in (two, eight):
        assert r["state_bytes"] < r["ideal_1_layer_bytes"] < r["ideal_2_layers_bytes"]
        assert r["peak_bytes"] >= r["ideal_1_layer_bytes"]  # nobody beats holding one layer
        assert r["peak_bytes"] == (r["argument_bytes"] + r["output_bytes"] - r["alias_bytes"] + r["temp_bytes"])
    # tiny: 2 layers of 196608 padded elements + the embedding's 40960, in fp32
    assert two["largest_unit_bytes"] == 196608 * 4
    assert "peak/ideal2" in rec["table"] and "tiny" in rec["table"]


def test_bf16_moments_save_two_bytes_of_state_per_parameter_each(tmp_path):
    out = tmp_path / "memory.json"
    schemes = ["fp32", "fp32+mu-bf16", "fp32+moments-bf16"]
    argv = ["--models", "tiny", "--schemes", *schemes, "--devices", "8", "--out", str(out)]
    assert bm.main(argv) == 0
    full, mu, both = json.loads(out.read_text())["rows"]
    for compact, want in ((mu, 2), (both, 4)):
        saved = (full["state_bytes"] - compact["state_bytes"]) * 8 / full["n_params"]
        assert want - 0.1 < saved < want + 0.5  # the replicated small leaves save on every device
    with pytest.raises(ValueError, match=r"\+moments-bf16 already holds the first moment"):
        split_scheme("fp32+mu-bf16+moments-bf16")
    assert "B/param" in json.loads(out.read_text())["table"]
    with pytest.raises(ValueError, match=r"unknown suffix 'nu-int8'"):
        split_scheme("fp32+nu-int8")
    with pytest.raises(ValueError, match=r"\+codes needs a qsdp scheme"):
        split_scheme("fp32+codes")


def test_code_held_weights_row(tmp_path):
    """+codes: the sharded weights cost 1 byte a parameter at 8 bits instead of 4."""
    out = tmp_path / "m.json"
    argv = ["--models", "tiny", "--schemes", "qsdp-W8G8", "qsdp-W8G8+codes", "--devices", "8", "--out", str(out)]
    assert bm.main(argv) == 0
    held, coded = json.loads(out.read_text())["rows"]
    saved = (held["state_bytes"] - coded["state_bytes"]) * 8 / held["n_params"]
    assert 2.5 < saved < 3.0  # 3 bytes a sharded parameter, less the replicated small leaves
    assert coded["peak_bytes"] < held["peak_bytes"]


def test_take_row_reads_the_embeddings_as_rows(tmp_path):
    """+take: the GPT built with embed_lookup="take"; the plain GSPMD step is the same program."""
    from experiments.shelf.schemes import embed_lookup

    assert embed_lookup("qsdp-W8G8+codes+take") == "take" and embed_lookup("qsdp-W8G8+codes") == "gather"
    out = tmp_path / "m.json"
    argv = ["--models", "tiny", "--schemes", "gspmd", "gspmd+take", "fp32+take", "--devices", "8", "--out", str(out)]
    assert bm.main(argv) == 0
    gspmd, gspmd_take, fp32_take = json.loads(out.read_text())["rows"]
    assert gspmd_take["peak_bytes"] == gspmd["peak_bytes"]
    assert fp32_take["scheme"] == "fp32+take" and "+take" in json.loads(out.read_text())["table"]
