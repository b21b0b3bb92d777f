"""What ``python -m experiments.gpt.train`` shows and writes about a run: the progress line,
the loss plot and the printed summary."""

from __future__ import annotations

import io
import sys
import time
from pathlib import Path

from experiments.gpt.args import ARTIFACTS
from experiments.gpt.files import write_atomic


class Progress:
    """One progress line on stderr: ``\\r``-updated on a TTY, a plain line every ~10% otherwise."""

    def __init__(self, total: int, tokens_per_step: int, stream=None, enabled: bool = True):
        self.total = total
        self.tokens = tokens_per_step
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every = max(1, total // 10)
        self.times: list[float] = []
        self.last_val: float | None = None
        self._last_draw = 0.0
        self._width = 0

    def update(self, log) -> None:
        self.times.append(log.seconds)
        if log.val_loss is not None:
            self.last_val = log.val_loss
        if not self.enabled:
            return
        done = log.step >= self.total
        if self.tty:
            now = time.monotonic()
            if done or log.val_loss is not None or now - self._last_draw > 0.1:
                self._last_draw = now
                line = self._line(log)
                self.stream.write("\r" + line.ljust(self._width))
                self._width = len(line)
                if done:
                    self.stream.write("\n")
                self.stream.flush()
        elif done or log.step % self.every == 0 or log.step == 1:
            self.stream.write(self._line(log) + "\n")
            self.stream.flush()

    def _line(self, log) -> str:
        timed = self.times[1:] or self.times  # the first step includes compilation
        recent = timed[-50:]
        sec = sum(recent) / len(recent)
        eta = sec * (self.total - log.step)
        w = len(str(self.total))
        val = f"  val {self.last_val:.4f}" if self.last_val is not None else ""
        return (
            f"step {log.step:>{w}}/{self.total}  loss {log.loss:.4f}{val}  "
            f"{self.tokens / sec:,.0f} tok/s  ETA {_hms(eta)}"
        )


def _hms(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


# ----------------------------------------------------------------------------------------------
# Output


def _num(x: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if x >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:.0f} B"


def plot_loss(history, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot([h.step for h in history], [h.loss for h in history], lw=1, label="train loss")
    val = [(h.step, h.val_loss) for h in history if h.val_loss is not None]
    if val:
        ax.plot(*zip(*val), "o-", ms=4, label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/byte)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, dpi=110, format="png")
    plt.close(fig)
    write_atomic(path, buf.getvalue())


def summary_text(summary: dict, report_table: str | None) -> str:
    devices = summary.get("devices", f"{summary['n_devices']} devices")
    lines = [
        f"run            {summary['name']}  ({summary['n_params']:,} params, {devices}, {summary['steps']} steps)",
        f"train loss     {summary['train_loss']:.4f}  (mean of the last 10% of steps)",
        f"val loss       {summary['val_loss']:.4f}",
        f"tokens/s       {summary['tokens_per_s']:,.0f}"
        + ("  (simulated devices on CPU: compute, not network, speed)" if "simulated" in devices else ""),
        f"time           setup {summary['setup_s']:.1f} s (data, init, compiling)   wall {summary['wall_s']:.1f} s",
        f"wire bytes     {_num(summary['wire_bytes_per_step'])} per device per step",
    ]
    by_axis = summary.get("wire_bytes_by_axis") or {}
    if len(summary.get("mesh") or {}) > 1:
        lines.append("  by mesh axis " + ", ".join(f"{k}: {_num(v)}" for k, v in sorted(by_axis.items())))
    ratio = summary.get("bytes_ratio_vs_fp32")
    if ratio is not None:
        lines.append(
            f"vs fp32 FSDP   {ratio:.2f}x fewer bytes ({_num(summary['fp32_wire_bytes_per_step'])} per step in fp32)"
        )
    if summary.get("bit_policy"):  # the bits of every sharded leaf
        lines += ["", "bit policy     " + summary["bit_policy"]["rules"], summary["bit_policy"]["table"]]
    if summary["nonfinite_steps"]:
        lines.append(f"WARNING        {summary['nonfinite_steps']} step(s) skipped for non-finite gradients")
    if report_table:
        lines += ["", report_table]
    lines.append(f"\nwrote {summary['out_dir']}/{{{','.join(ARTIFACTS)}}}")
    return "\n".join(lines)
