"""Synthetic convergence run records (the shape runbook.compact_record writes), for tests."""

from experiments.convergence import runbook


def fake_record(corpus, config, seed, val, wire_bytes, settings=None, wall_s=100.0, n_params=1000):
    """A record as the experiment writes it, with the given final validation loss and bytes."""
    settings = settings or runbook.Settings(preset="tiny", steps=10)
    qsdp = dict(runbook.CONFIGS[config].qsdp, seed=seed) if config in runbook.CONFIGS else {}
    return {
        "config": {"qsdp": qsdp, "steps": settings.steps, "seed": seed},
        "train_loss": val - 0.05,
        "val_loss": val,
        "tokens_per_s": 1000.0,
        "wire_bytes_per_step": float(wire_bytes),
        "wire_bytes_by_kind": {},
        "n_params": n_params,
        "n_devices": 8,
        "compile_s": 1.0,
        "wall_s": wall_s,
        "nonfinite_steps": 0,
        "val_curve": [[5, val + 0.4, val + 0.5], [10, val + 0.05, val]],
        "corpus": corpus,
        "config_name": config,
        "seed": seed,
        "settings": settings.as_dict(),
        "git_commit": "abc123",
    }


def write_fake(root, corpus, config, seed, val, wire_bytes, **kw):
    key = runbook.RunKey(corpus, config, seed)
    return runbook.write_record(root, key, fake_record(corpus, config, seed, val, wire_bytes, **kw))
