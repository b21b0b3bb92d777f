"""Child process for tests/test_distributed.py: start jax.distributed through
qsdp_jax.distributed from QSDP_* environment variables, check it, write what it saw as JSON to
``<dir>/result_<process id>.json`` (not stdout: gloo's C++ logging writes there too, and once
landed inside the line)."""

import json
import os
import sys

from experiments.shelf.multiproc import _pin_gloo_to_loopback
from qsdp_jax import distributed

_pin_gloo_to_loopback()  # gloo on 127.0.0.1 whatever the hostname resolves to
info = distributed.initialize()  # from QSDP_COORDINATOR / _NUM_PROCESSES / _PROCESS_ID
again = distributed.initialize()  # idempotent: same object, nothing restarted
host = distributed._HOST["host"]  # process 0's coordination-service helper
log_path = distributed.enable_process_log(sys.argv[1])
distributed.main_print("hello from the main process")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

# a real cross-process collective: every process contributes its id + 1
summed = multihost_utils.process_allgather(jnp.asarray([jax.process_index() + 1.0]))
seen = {
    "source": info.source,
    "num_processes": info.num_processes,
    "process_id": info.process_id,
    "same": again is info,
    "process_count": jax.process_count(),
    "device_count": jax.device_count(),
    "local_device_count": jax.local_device_count(),
    "gathered": np.asarray(summed).ravel().tolist(),
    "is_main": distributed.is_main_process(),
    "log_path": str(log_path),
}
distributed.shutdown()  # stops the helper at once: every process is past jax's shutdown
seen["helper_exit"] = None if host is None else host.proc.returncode
result = os.path.join(sys.argv[1], f"result_{info.process_id}.json")
with open(result + ".tmp", "w") as f:
    json.dump(seen, f)
os.replace(result + ".tmp", result)  # whole or absent
