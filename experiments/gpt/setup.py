"""Setting up a ``python -m experiments.gpt.train`` run before it trains: the devices (and
``jax.distributed``), the mesh sizes and the configs, checked before anything is written.

Imports nothing that uses jax at the top: :func:`setup_devices` sets ``XLA_FLAGS`` first.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

from experiments.gpt.cluster_args import mesh_sizes, start_distributed
from experiments.gpt.devices import simulate_cpu_devices, use_available_devices
from experiments.gpt.args import CLIError, check_out_dir, default_out, qsdp_kwargs


def select_devices(n: int | None):
    """The first ``n`` devices JAX found (all of them when ``n`` is None)."""
    import jax

    devs = jax.devices()
    if n is None:
        return devs
    if len(devs) < n:
        if devs[0].platform == "cpu":
            raise CLIError(
                f"--devices {n}, but jax was already set up with {len(devs)} device(s) in this "
                f"process (cpu); the count of simulated devices can only be chosen before jax "
                f"starts (XLA_FLAGS=--xla_force_host_platform_device_count={n}); use --devices "
                f"{len(devs)} or run in a fresh process"
            )
        raise CLIError(
            f"--devices {n}, but jax found only {len(devs)} {devs[0].platform} "
            f"device(s): use --devices {len(devs)} or leave it out"
        )
    if n < len(devs) and jax.process_count() > 1:
        raise CLIError(
            f"--devices {n} with {jax.process_count()} processes: every process's "
            f"devices take part, leave --devices out (there are {len(devs)})"
        )
    return devs[:n]


def setup_devices(args: argparse.Namespace):
    """Devices for the run: the real ones or simulated CPU devices (set before jax starts), after
    starting ``jax.distributed`` when there are several processes."""
    if args.simulate_devices is not None:
        if args.devices is not None and args.devices > args.simulate_devices:
            raise CLIError(f"--devices {args.devices} is more than --simulate-devices {args.simulate_devices}")
        simulate_cpu_devices(args.simulate_devices)
    else:
        use_available_devices(args.devices or 8)
    try:
        start_distributed(args)
    except ValueError as e:
        raise CLIError(str(e)) from None
    from qsdp_jax import distributed

    if args.devices is None and distributed.num_processes() > 1:
        return select_devices(None)  # --simulate-devices N: N per process, all of them take part
    return select_devices(args.devices or args.simulate_devices)


def build_run_config(args: argparse.Namespace, mesh: tuple = ()):
    """(QSDPConfig, RunConfig) from the flags (``mesh``: the sizes, see ``RunConfig.mesh``);
    CLIError on any invalid value or combination."""
    import qsdp_jax as q
    from experiments.gpt.trainer import RunConfig  # imports jax: after setup_devices

    kw = qsdp_kwargs(args)
    overrides = tuple(
        (k, v)
        for k, v in (("d_model", args.d_model), ("n_layers", args.n_layers), ("n_heads", args.n_heads))
        if v is not None
    )
    warmup = args.warmup  # None: RunConfig picks min(30, steps // 10)
    eval_every = args.eval_every if args.eval_every is not None else max(1, args.steps // 5)
    try:
        cfg = q.QSDPConfig(**kw)
        run = RunConfig(
            qsdp=cfg,
            preset=args.preset,
            model_overrides=overrides,
            steps=args.steps,
            batch_size=args.batch,
            seq_len=args.seq_len,
            lr=args.lr,
            warmup=warmup,
            schedule=args.schedule,
            mu_dtype=args.mu_dtype,
            moments_dtype=args.moments_dtype,
            seed=args.seed,
            eval_every=eval_every,
            eval_batches=args.eval_batches,
            data_path=None if args.data is None else str(args.data),
            mesh=mesh,
        )
    except (ValueError, TypeError) as e:
        raise CLIError(str(e)) from None
    return cfg, run


def fp32_wire_bytes(trainer) -> float:
    """Wire bytes per step of the fp32 FSDP step for the same model, mesh and batch (compiled
    from abstract state, nothing allocated)."""
    import jax

    import qsdp_jax as q
    from experiments.gpt.trainer import make_optimizer  # imports jax: after setup_devices
    from qsdp_jax import comm

    run = dataclasses.replace(
        trainer.run,
        qsdp=q.QSDPConfig.fp32(
            bucket_size=trainer.run.qsdp.bucket_size,
            min_shard_size=trainer.run.qsdp.min_shard_size,
            seed=trainer.run.qsdp.seed,
            axis_name=trainer.run.qsdp.axis_name,
        ),
    )
    opt = make_optimizer(run)
    params = jax.eval_shape(lambda: trainer.model.init_params(run.seed))
    state = q.abstract_train_state(params, opt, trainer.mesh, run.qsdp, stacked=trainer.model.stacked_groups)
    step = q.make_train_step(trainer.model.loss, opt, trainer.mesh, run.qsdp)
    return comm.comm_report(step, state, trainer.batch(0)).total_bytes


def _is_main_process_hint() -> bool:
    """Before jax starts: whether this looks like process 0 (from QSDP_PROCESS_ID / SLURM_PROCID),
    so that only it checks the output directory."""
    for var in ("QSDP_PROCESS_ID", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "TPU_WORKER_ID"):
        if os.environ.get(var, "0").strip() not in ("", "0"):
            return False
    return True


def _one_process_hint(args: argparse.Namespace) -> bool:
    """Before jax starts: whether this looks like a single-process run (then a bad output
    directory is refused before the slow jax import; with several, all processes refuse it
    together, see :func:`prepare_run`)."""
    if args.num_processes is not None:
        return args.num_processes == 1
    for var in ("QSDP_NUM_PROCESSES", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        if os.environ.get(var, "1").strip() not in ("", "1"):
            return False
    return True


# Flags that may differ between the processes of one run: everything else must be the same.
PROCESS_LOCAL = ("process_id", "process_logs", "devices", "simulate_devices", "coordinator", "quiet", "argv")


def run_settings(args: argparse.Namespace) -> dict:
    """The settings every process of a run must share: the parsed flags less
    :data:`PROCESS_LOCAL`, the data file's SHA-256 (the same path may hold another text on
    another host) and the jax / qsdp_jax versions."""
    import hashlib

    import jax

    import qsdp_jax

    settings = {"--" + k.replace("_", "-"): v for k, v in sorted(vars(args).items()) if k not in PROCESS_LOCAL}
    if args.data is not None:
        settings["data_sha256"] = hashlib.sha256(Path(args.data).read_bytes()).hexdigest()
    settings["versions"] = {"jax": jax.__version__, "qsdp_jax": qsdp_jax.__version__}
    return settings


def check_same_settings(args: argparse.Namespace) -> None:
    """CLIError on every process when the processes' settings differ (or one of them does not
    get to the check within the connect bound); a no-op with one process."""
    from qsdp_jax import distributed

    try:
        distributed.check_agreement(run_settings(args), what="trainer settings")
    except (distributed.SettingsMismatch, distributed.AgreementTimeout) as e:
        raise CLIError(str(e)) from None


def _configure(args: argparse.Namespace, devices):
    """The mesh sizes and the configs (the same on every process): ``(cfg, run)``."""
    from qsdp_jax import distributed

    if args.batch % len(devices):
        raise CLIError(
            f"--batch {args.batch} does not divide over {len(devices)} devices: use a multiple of {len(devices)}"
        )
    qsdp_kwargs(args)  # flag combinations first, then the mesh's sizes
    try:
        mesh = mesh_sizes(args.mesh, len(devices), distributed.num_processes())
    except ValueError as e:
        raise CLIError(str(e)) from None
    return build_run_config(args, mesh)


def _together(what: str, check, *call_args, main_only: bool = False):
    """``check(*call_args)`` on every process (on process 0 alone with ``main_only``); a
    CLIError on any process is raised on every process, naming the process (with several)."""
    from qsdp_jax import distributed

    result, error = None, None
    try:
        if not main_only or distributed.is_main_process():
            result = check(*call_args)
    except CLIError as e:
        error = str(e)
    error = distributed.agree_on_error(error, what=what)
    if error is not None:
        raise CLIError(error)
    return result


def prepare_run(args: argparse.Namespace):
    """Check the flags, start the devices (and ``jax.distributed``), check that every process
    runs with the same settings, size the mesh: returns ``(devices, is_main, cfg, run, out)``.
    CLIError before anything is written (on every process, when one of them finds an error)."""
    if args.data is not None and not Path(args.data).is_file():
        raise CLIError(f"--data {args.data}: no such file")
    for n in (args.devices, args.simulate_devices):
        if n is not None and args.batch % n:
            raise CLIError(f"--batch {args.batch} does not divide over {n} devices: use a multiple of {n}")
    if args.out is not None and _is_main_process_hint() and _one_process_hint(args):
        check_out_dir(Path(args.out), args.overwrite, args.resume)  # before the (slow) jax import
    devices = setup_devices(args)
    from qsdp_jax import distributed

    # a process that dies, freezes or exits early from here on ends the others (--peer-timeout);
    # train_loop finishes the monitor at the run's end
    finish_peers()  # an earlier run in this process that stopped before training (its error)
    PEERS["monitor"] = distributed.watch_peers(args.peer_timeout)
    try:
        check_same_settings(args)
        main = distributed.is_main_process()
        cfg, run = _together("trainer setup", _configure, args, devices)
        # process 0's default directory (its timestamp) on every process: checkpoints go there
        out = Path(
            args.out
            if args.out is not None
            else distributed.from_process_0(str(default_out(args.preset, cfg.name)), what="output directory")
        )
        _together("output directory check", check_out_dir, out, args.overwrite, args.resume, main_only=True)
    except CLIError:
        finish_peers()  # every process stops with this error: none is lost
        raise
    return devices, main, cfg, run, out


PEERS: dict = {"monitor": None}


def finish_peers() -> None:
    """This process is done with the run's collectives: its exit no longer ends the others."""
    monitor, PEERS["monitor"] = PEERS["monitor"], None
    if monitor is not None:
        monitor.finish()
