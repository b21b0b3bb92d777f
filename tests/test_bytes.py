"""Bytes on the wire of a real model's compiled step: QSDP against fp32 FSDP."""

import jax.numpy as jnp
import optax
import pytest

import qsdp_jax as q
from experiments.gpt.model import GPT, GPTConfig
from qsdp_jax import comm, optim


@pytest.fixture(scope="module")
def wire_bytes():
    mesh = q.make_mesh()
    model = GPT(GPTConfig.from_preset("tiny"))
    params = model.init_params(0)
    batch = {"inputs": jnp.zeros((8, 64), jnp.int32), "targets": jnp.zeros((8, 64), jnp.int32)}
    out = {}
    for cfg in map(q.QSDPConfig.from_name, ("fp32", "bf16", "qsdp-W8G8", "qsdp-W4G4")):
        opt = optim.qsdp(optax.adam(1e-3), cfg)
        state = q.init_train_state(params, opt, mesh, cfg, stacked=model.stacked_groups)
        step = q.make_train_step(model.loss, opt, mesh, cfg)
        out[cfg.name] = comm.comm_report(step, state, batch)
    return out


def test_qsdp_cuts_bytes(wire_bytes):
    total = {k: r.total_bytes for k, r in wire_bytes.items()}
    print({k: round(v) for k, v in total.items()})
    assert total["fp32"] / total["qsdp-W8G8"] >= 3.9
    assert total["fp32"] / total["qsdp-W4G4"] >= 7.5
    assert 1.9 <= total["fp32"] / total["bf16"] <= 2.0


def test_quantized_collectives_carry_bytes_not_floats(wire_bytes):
    for name in ("qsdp-W8G8", "qsdp-W4G4"):
        by = wire_bytes[name].by_kind_dtype()
        assert by[("all-gather", "u8")] > 0 and by[("all-to-all", "u8")] > 0
        assert not any(k in ("all-gather", "all-to-all", "reduce-scatter") and d != "u8" for k, d in by)
