"""A multi-process training run with checkpoints and a step watchdog, to kill and resume.

    python -m experiments.shelf.failure_workload --process-id I --num-processes 2 --port P --out DIR

Each process (2 simulated CPU devices, gloo collectives) trains a small layer-stacked MLP with
QSDP W8G8 through ``qsdp_jax.make_train_step``, resumes from the latest complete checkpoint in
``DIR/checkpoints`` if there is one, saves every ``--every`` steps, and runs a
:class:`qsdp_jax.watchdog.StepWatchdog` with ``--bound`` seconds: when another process dies or
freezes, it tries to save, says what happened and exits with status 75 within the bound (plus
``--save-timeout``). ``jax.distributed``'s heartbeat timeout is set above that, so JAX's own
abort (no Python exception) does not come first. Prints ``STEP n loss`` per step and, at the
end, ``DONE`` and a JSON line of the losses.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from experiments.shelf.multiproc import _pin_gloo_to_loopback

D, L, IN, BATCH = 64, 2, 16, 16


def init_params(seed: int = 0):
    import jax

    k = jax.random.split(jax.random.PRNGKey(seed), 3)
    return {
        "embed": {"w": jax.random.normal(k[0], (IN, D)) * 0.3},
        "blocks": {"w": jax.random.normal(k[1], (L, D, D)) / D**0.5},
        "head": {"w": jax.random.normal(k[2], (D, 4)) / D**0.5},
    }


def loss_fn(p, batch):
    import jax.numpy as jnp

    x = batch["x"] @ p.gather("embed")["w"]
    x, _ = p.scan("blocks", lambda c, lp, _: (c + jnp.tanh(c @ lp["w"]), None), x)
    return jnp.mean((x @ p.gather("head")["w"] - batch["y"]) ** 2)


def batch_at(step: int, mesh):
    """The global batch of ``step`` (the data position is the step), as global arrays."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    r = np.random.default_rng(1000 + step)
    host = {"x": r.normal(size=(BATCH, IN)).astype(np.float32), "y": r.normal(size=(BATCH, 4)).astype(np.float32)}
    sharding = NamedSharding(mesh, P(mesh.axis_names[0]))
    return {k: jax.make_array_from_callback(v.shape, sharding, v.__getitem__) for k, v in host.items()}


def train(out: Path, steps: int, every: int, bound: float, save_timeout: float, what: str) -> list[float]:
    import jax
    import optax

    import qsdp_jax as q
    from qsdp_jax import optim
    from qsdp_jax.watchdog import StepWatchdog, save_or_explain

    config = q.QSDPConfig.qsdp(8, 8, bucket_size=64, min_shard_size=256)
    mesh = q.make_mesh()
    opt = optim.qsdp(optax.adam(1e-2), config)
    state = q.init_train_state(init_params(), opt, mesh, config, stacked=("blocks",))
    step_fn = q.make_train_step(loss_fn, opt, mesh, config)
    ckpt = q.Checkpointer(out / "checkpoints", keep=2, async_save=False)
    if ckpt.latest_step() is not None:
        state, _ = ckpt.restore(state, config, mesh)
        print(f"RESUMED {int(state.step)}", flush=True)
    current = {"state": state}

    def try_save() -> str:
        return save_or_explain(lambda: ckpt.save(current["state"], config, mesh), current["state"], ckpt.latest_step)

    losses = []
    with StepWatchdog(bound, on_timeout=try_save, save_timeout_s=save_timeout, what=what) as dog:
        for i in range(int(state.step), steps):
            try:
                state, metrics = step_fn(state, batch_at(i, mesh))
                loss = float(metrics["loss"])  # waits for the step
            except jax.errors.JaxRuntimeError as e:
                dog.fail(e)  # a peer is gone: message, save attempt, exit 75
            current["state"] = state
            dog.beat(i + 1)
            losses.append(loss)
            print(f"STEP {i + 1} {loss!r}", flush=True)
            if (i + 1) % every == 0 or i + 1 == steps:
                ckpt.save(state, config, mesh)
    ckpt.close()
    return losses


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.shelf.failure_workload")
    p.add_argument("--process-id", type=int, required=True)
    p.add_argument("--num-processes", type=int, default=2)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--bound", type=float, default=60.0, help="watchdog bound in seconds (default 60)")
    p.add_argument("--save-timeout", type=float, default=5.0)
    a = p.parse_args(argv)
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax  # after XLA_FLAGS

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    _pin_gloo_to_loopback()
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{a.port}",
        coordinator_bind_address=f"127.0.0.1:{a.port}",
        num_processes=a.num_processes,
        process_id=a.process_id,
        initialization_timeout=120,
        heartbeat_timeout_seconds=int(a.bound + a.save_timeout + 30),
    )
    what = f"process {a.process_id} of {a.num_processes}"
    losses = train(a.out, a.steps, a.every, a.bound, a.save_timeout, what)
    print("DONE " + json.dumps(losses), flush=True)
    sys.stdout.flush()
    os._exit(0)  # skip jax's shutdown barrier: the other process may already be gone


if __name__ == "__main__":
    raise SystemExit(main())
