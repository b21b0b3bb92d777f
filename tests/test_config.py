"""QSDPConfig: every invalid field raises a ValueError naming field, value and rule."""

import pytest

from qsdp_jax import QSDPConfig


def test_defaults_are_qsdp_w8g8():
    c = QSDPConfig()
    assert (c.weight_bits, c.grad_bits, c.weight_mode, c.grad_rounding) == (8, 8, "qsdp", "stochastic")
    assert c.name == "qsdp-sr-W8G8"  # names state the weight rounding; stochastic is the default


def test_presets_and_names():
    assert QSDPConfig.fp32().name == "fp32"
    assert QSDPConfig.bf16().name == "bf16"
    assert QSDPConfig.qsdp(4, 4).name == "qsdp-sr-W4G4"
    assert QSDPConfig.qsdp(4, 4, weight_rounding="shift").name == "qsdp-W4G4"
    assert QSDPConfig(weight_mode="comm", weight_bits=4, grad_bits=None).name == "comm-W4GF32"
    assert not QSDPConfig.fp32().quantizes_weights and not QSDPConfig.fp32().quantizes_grads


def test_frozen():
    with pytest.raises(Exception):
        QSDPConfig().weight_bits = 4


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("weight_bits", 0, "1..8"),
        ("weight_bits", 9, "1..8"),
        ("weight_bits", 4.0, "1..8"),
        ("weight_bits", True, "1..8"),
        ("grad_bits", -1, "1..8"),
        ("grad_bits", "8", "1..8"),
        ("bucket_size", 4, ">= 8"),
        ("bucket_size", 100, "multiple of 8"),
        ("bucket_size", 64.0, "integer"),
        ("weight_mode", "zero++", "'qsdp', 'comm', 'full'"),
        ("grad_rounding", "floor", "'stochastic', 'nearest'"),
        ("weight_rounding", "nearest", "'shift', 'stochastic'"),
        ("min_shard_size", -1, ">= 0"),
        ("seed", -3, ">= 0"),
        ("seed", 2**32, "2**32"),
        ("fp_comm_dtype", "float16", "'float32', 'bfloat16'"),
        ("axis_name", "", "non-empty"),
    ],
)
def test_invalid_field(field, value, words):
    with pytest.raises(ValueError) as e:
        QSDPConfig(**{field: value})
    msg = str(e.value)
    assert f"QSDPConfig.{field}={value!r}" in msg
    assert words in msg


def test_mode_bits_consistency():
    with pytest.raises(ValueError, match=r"weight_bits=8.*weight_mode='full'"):
        QSDPConfig(weight_mode="full", weight_bits=8)
    with pytest.raises(ValueError, match=r"weight_bits=None.*weight_mode='qsdp'"):
        QSDPConfig(weight_mode="qsdp", weight_bits=None)
    with pytest.raises(ValueError, match=r"weight_bits=None.*weight_mode='comm'"):
        QSDPConfig(weight_mode="comm", weight_bits=None)
    with pytest.raises(ValueError, match=r"weight_bits=1.*spare level"):
        QSDPConfig(weight_mode="qsdp", weight_bits=1, weight_rounding="shift")
    # 1-bit weights are allowed when only the all-gather is quantized, or with stochastic rounding.
    assert QSDPConfig(weight_mode="comm", weight_bits=1).weight_bits == 1
    c = QSDPConfig(weight_bits=1)
    assert c.name == "qsdp-sr-W1G8"


def test_default_weight_rounding_is_stochastic():
    """The safe default (issue 13): stochastic rounding onto the grid; the paper's shift ruins
    4-bit training and is an explicit choice."""
    assert QSDPConfig().weight_rounding == "stochastic"
    assert QSDPConfig.qsdp(4, 4).name == "qsdp-sr-W4G4"
    assert QSDPConfig.from_name("qsdp-W4G4").weight_rounding == "shift"
    assert QSDPConfig.from_name("qsdp-sr-W4G4") == QSDPConfig.qsdp(4, 4)


@pytest.mark.parametrize(
    "config",
    [
        QSDPConfig.fp32(),
        QSDPConfig.bf16(),
        QSDPConfig.qsdp(8, 8),
        QSDPConfig.qsdp(2, 4),
        QSDPConfig(weight_mode="comm", weight_bits=4, grad_bits=None),
        QSDPConfig(weight_bits=4, grad_bits=4, weight_rounding="stochastic"),
        QSDPConfig(weight_mode="full", weight_bits=None, grad_bits=8, fp_comm_dtype="bfloat16"),
    ],
    ids=lambda c: c.name,
)
def test_from_name_inverts_name(config):
    assert QSDPConfig.from_name(config.name) == config


def test_from_name_errors_and_shorthand():
    assert QSDPConfig.from_name("W4G8", bucket_size=256) == QSDPConfig.qsdp(
        4, 8, bucket_size=256, weight_rounding="shift"
    )
    for bad in ("int8", "qsdp-W9G8", "qsdp-W8", "zero-W8G8"):
        with pytest.raises(ValueError, match="unknown config name"):
            QSDPConfig.from_name(bad)
    with pytest.raises(ValueError, match="mixes"):
        QSDPConfig.from_name("full-WF32GBF16")
