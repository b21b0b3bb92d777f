"""experiments.gpt.devices: the real devices unless simulated ones are asked for (fresh processes:
the device count is fixed once jax starts)."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROBE = """
import json, os, sys
from experiments.gpt import devices
getattr(devices, sys.argv[1])(int(sys.argv[2]))
import jax
print(json.dumps({"n": jax.device_count(), "platform": jax.devices()[0].platform,
                  "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS"),
                  "desc": devices.describe_devices(jax.devices())}))
"""


def _probe(func: str, n: int, **env) -> dict:
    base = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    r = subprocess.run(
        [sys.executable, "-c", PROBE, func, str(n)],
        cwd=REPO,
        text=True,
        capture_output=True,
        env={**base, "PYTHONPATH": str(REPO), **env},
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_available_devices_force_no_platform():
    # this machine has only a CPU: it gets the simulated devices, and no platform is forced
    out = _probe("use_available_devices", 3)
    assert out == {"n": 3, "platform": "cpu", "JAX_PLATFORMS": None, "desc": "3 cpu devices (simulated, 1 process)"}
    # a device count the user already set wins
    out = _probe("use_available_devices", 3, XLA_FLAGS="--xla_force_host_platform_device_count=5")
    assert out["n"] == 5 and out["JAX_PLATFORMS"] is None


def test_simulated_devices_are_cpu():
    out = _probe("simulate_cpu_devices", 2)
    assert (out["n"], out["platform"], out["JAX_PLATFORMS"]) == (2, "cpu", "cpu")
