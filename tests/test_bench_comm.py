"""experiments.shelf.wire_bytes (and experiments.bench.comm's table): structure, ratios and
HLO-vs-formula agreement on the tiny preset."""

import json

import pytest

from experiments.bench import comm as bench_comm
from experiments.shelf import wire_bytes


@pytest.fixture(scope="module")
def tiny():
    return wire_bytes.measure("tiny", ("fp32", "bf16", "qsdp-W8G8"), n_devices=8, batch_size=16)


def test_structure(tiny):
    assert tiny["preset"] == "tiny" and tiny["n_devices"] == 8 and tiny["bucket_size"] == 1024
    assert tiny["n_params"] > 0 and tiny["batch"] == [16, 64]
    assert list(tiny["schemes"]) == ["fp32", "bf16", "qsdp-W8G8"]
    for r in tiny["schemes"].values():
        assert set(wire_bytes.KINDS) <= set(r["by_kind"])
        assert r["total_bytes"] == pytest.approx(sum(r["by_kind"].values()))
        assert r["total_bytes"] == pytest.approx(sum(r["by_kind_dtype"].values()))
        assert not r["warnings"]
    json.dumps(tiny)  # machine-readable
    text = bench_comm.table([tiny])
    assert "qsdp-W8G8" in text and "uint16" in text


def test_ratios(tiny):
    s = tiny["schemes"]
    assert s["fp32"]["ratio_vs_fp32"] == 1.0
    assert s["qsdp-W8G8"]["ratio_vs_fp32"] >= 3.9
    assert 1.9 <= s["bf16"]["ratio_vs_fp32"] <= 2.0
    assert s["qsdp-W8G8"]["ratio_vs_bf16"] >= 1.95
    # bf16 travels as u16 (deliberate bitcast), quantized payloads as u8
    assert {k.split("/")[1] for k in s["bf16"]["by_kind_dtype"] if not k.startswith("all-reduce")} == {"u16"}
    assert {k.split("/")[1] for k in s["qsdp-W8G8"]["by_kind_dtype"] if not k.startswith("all-reduce")} == {"u8"}


def test_hlo_matches_formula(tiny):
    for name, r in tiny["schemes"].items():
        assert abs(r["formula_rel_diff"]) < 0.01, (name, r["hlo_gather_scatter_bytes"], r["formula_bytes"])


def test_formula_by_hand():
    """One sharded group of 8192 elements, 2 gathers + 1 scatter, on 8 devices."""
    from types import SimpleNamespace

    grp = SimpleNamespace(name="blocks", is_sharded=True, flat_size=8192, stacked=False, n_layers=0)
    layout = SimpleNamespace(groups=(grp,))
    cfg = wire_bytes.scheme_config("qsdp-W4G8", 1024)
    f = wire_bytes.formula_bytes(layout, cfg, 8, {"blocks": 2}, {"blocks": 1})
    # gather: 8192 * 0.5 B + 8 buckets * 8 B = 4160 B payload, x2, x7/8
    assert f["gather"] == pytest.approx(2 * 4160 * 7 / 8)
    # scatter: 8192 * 1 B + 64 B = 8256 B, x7/8
    assert f["scatter"] == pytest.approx(8256 * 7 / 8)
    fp = wire_bytes.formula_bytes(layout, wire_bytes.scheme_config("fp32"), 8, {"blocks": 2}, {"blocks": 1})
    assert fp["total"] == pytest.approx(3 * 8192 * 4 * 7 / 8)


def test_scheme_names():
    assert wire_bytes.scheme_config("W2G4").name == "qsdp-W2G4"
    assert wire_bytes.scheme_config("bf16").name == "bf16"
    with pytest.raises(ValueError):
        wire_bytes.scheme_config("int8")


def test_schemes_with_one_name_are_refused_before_compiling():
    """Records are keyed by config name, which does not carry the bucket size: two such configs
    in one call would silently share one record."""
    import qsdp_jax as q

    cfgs = [q.QSDPConfig.qsdp(4, 4, bucket_size=b) for b in (128, 256)]
    with pytest.raises(ValueError, match=r"\['qsdp-sr-W4G4'\] are named twice"):
        wire_bytes.measure("tiny", cfgs, n_devices=8)


def test_take_suffix_reads_the_embeddings_as_rows():
    """``+take``: the GPT with ``embed_lookup="take"``; at the tiny preset its tables are smaller
    than the devices' ids, so they are gathered alone, unquantized (bytes outside the formula)."""
    assert wire_bytes.scheme_config("qsdp-W8G8+take").name == "qsdp-W8G8"
    with pytest.raises(ValueError, match=r"do not depend on \['codes'\]; only \+take counts here"):
        wire_bytes.scheme_config("qsdp-W8G8+codes")
    with pytest.raises(ValueError, match=r"unknown suffix 'rows'"):
        wire_bytes.scheme_config("qsdp-W8G8+rows")
    r = wire_bytes.measure("tiny", ["qsdp-W8G8", "qsdp-W8G8+take"], n_devices=8, batch_size=8)["schemes"]
    assert "all-gather/f32" in r["qsdp-W8G8+take"]["by_kind_dtype"]
    assert "all-gather/f32" not in r["qsdp-W8G8"]["by_kind_dtype"]
