"""What keeps a checkpoint directory safe: integrity checks, one writer, and no save lost at exit.

* **Integrity.** :func:`checksums` records a CRC-32 of every array's bytes in the checkpoint's
  JSON record when it is saved; :func:`verify` recomputes them after a restore reads the arrays
  back, so a flipped bit or overwritten bytes in an array file is found (as is an array file that
  no longer decodes, or metadata that does not parse), and raised as :class:`CheckpointDamaged`
  naming the step directory and the leaf.
* **One writer per directory.** :class:`WriterLock` holds an exclusive ``flock`` on
  ``<directory>/.qsdp-writer.lock`` from a Checkpointer's first save until it is closed (or its
  process ends, however it ends: the kernel drops the lock, so a killed run leaves nothing
  stale). A second writer fails at once naming the holder (host, pid, since when). Locks on
  network file systems are only as good as the file system's ``flock``.
* **No save lost at exit.** Orbax writes in background threads that Python's interpreter
  shutdown stops before ``atexit`` handlers run; a script that ends right after ``save()`` used
  to exit 0 with only a temporary directory left. :func:`finish_at_exit` registers the
  Checkpointer with a hook that runs before those threads are stopped and waits for its pending
  saves; a save that fails there ends the process with status 1 and a message, never status 0.
"""

from __future__ import annotations

import fcntl
import os
import socket
import sys
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

LOCK_NAME = ".qsdp-writer.lock"


class CheckpointDamaged(OSError):
    """A checkpoint's files are unreadable or do not hold what was saved (the message names the
    step directory and what is wrong)."""


class CheckpointLocked(RuntimeError):
    """Another writer holds the checkpoint directory (the message names it)."""


# ----------------------------------------------------------------------------------------------
# Integrity
# ----------------------------------------------------------------------------------------------
def crc32(x: np.ndarray) -> int:
    """CRC-32 of an array's bytes in C order (any dtype, 0-d included)."""
    # .data: the bytes as a memoryview, no copy (numpy's stubs give ndarray the buffer protocol
    # only for Python >= 3.12, so the array itself is not a Buffer to a 3.11 type checker).
    return zlib.crc32(np.ascontiguousarray(x).reshape(-1).view(np.uint8).data)


def checksums(arrays: dict[str, np.ndarray]) -> dict[str, int]:
    """``{leaf path: crc32}`` of host arrays, for the checkpoint's record. About 1 s per GB on
    one core; zlib releases the GIL, so the arrays are summed on up to 8 threads."""
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        return dict(zip(arrays, pool.map(crc32, arrays.values())))


def verify(arrays: dict[str, np.ndarray], expected: dict[str, int] | None, where: str) -> None:
    """Raise :class:`CheckpointDamaged` naming the first leaf whose bytes differ from the saved
    checksum. A record without checksums (saved before they existed) passes unchecked."""
    if expected is None:
        return
    found = checksums({k: arrays[k] for k in expected if k in arrays})
    bad = [k for k, crc in found.items() if crc != expected[k]]
    if bad:
        raise CheckpointDamaged(
            f"{where} is damaged: {len(bad)} array(s) do not match the checksum recorded when it "
            f"was saved (first: {bad[0]}); its files were changed or corrupted after the save"
        )


# ----------------------------------------------------------------------------------------------
# One writer
# ----------------------------------------------------------------------------------------------
class WriterLock:
    """An exclusive, non-blocking ``flock`` on ``<directory>/.qsdp-writer.lock``."""

    def __init__(self, directory: Path):
        self.path = Path(directory) / LOCK_NAME
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock, or raise :class:`CheckpointLocked` naming the holder, or ``OSError``
        naming the directory when it cannot be written (read-only, missing permission)."""
        if self._fd is not None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise OSError(
                e.errno,
                f"cannot write checkpoints to {self.path.parent}: {e.strerror} (is it read-only or on a full disk?)",
            ) from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "an unknown process"
            os.close(fd)
            raise CheckpointLocked(
                f"{self.path.parent} is being written by another Checkpointer ({holder}): one "
                "writer per checkpoint directory; stop that run or give this one another "
                "directory"
            ) from None
        os.ftruncate(fd, 0)
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())
        os.pwrite(fd, f"host {socket.gethostname()}, pid {os.getpid()}, since {stamp} UTC\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None


# ----------------------------------------------------------------------------------------------
# No save lost at exit
# ----------------------------------------------------------------------------------------------
_OPEN: set = set()  # strong references: a Checkpointer dropped right after save() still finishes
_HOOKED = False


def finish_at_exit(checkpointer) -> None:
    """Close ``checkpointer`` (completing its pending saves) when the interpreter shuts down,
    before the thread pools orbax writes with are stopped; :func:`closed` forgets it."""
    global _HOOKED
    _OPEN.add(checkpointer)
    if not _HOOKED:
        # threading's exit hooks run in reverse order of registration, before atexit and before
        # concurrent.futures stops its pools (registered when orbax imported it, before us).
        # No public hook runs early enough; the private one is not in typeshed's threading stubs.
        threading._register_atexit(_finish_pending)  # type: ignore[attr-defined]  # noqa: SLF001
        _HOOKED = True


def closed(checkpointer) -> None:
    _OPEN.discard(checkpointer)


# Python 3.12.0 and 3.12.1 start no thread at exit (CPython gh-113964, fixed in 3.12.2), and
# orbax needs threads to finish a save
_EXIT_HINT = (
    f" (Python {sys.version.split()[0]} cannot start threads at exit: call wait() or close() on the "
    "Checkpointer before the script ends, or use Python 3.12.2 or newer)"
    if sys.version_info[:3] in ((3, 12, 0), (3, 12, 1))
    else ""
)


def _finish_pending() -> None:
    for ckpt in list(_OPEN):
        try:
            ckpt.close()
        except BaseException as e:  # noqa: BLE001 - any failure here must end the process loudly
            print(
                f"qsdp_jax: a checkpoint save to {ckpt.directory} did not complete at exit: {type(e).__name__}: {e}"
                + _EXIT_HINT,
                file=sys.stderr,
                flush=True,
            )
            os._exit(1)
