"""Progress as it happens, on global rank 0: epoch, step, loss, tokens/s, MFU and ETA.

Rate-limited: a report waits for the device (it reads the loss), so it comes at most every
`interval_s` seconds (every second as a progress bar on a terminal), never every step.

Rates are measured from the end of the first step after each (re)start of measuring: that step
carries start-up (data workers, allocator, compilation, the first eval's aftermath), which would
otherwise show as a slow rate and an ETA of days. tokens/s and MFU are those of the latest window;
the ETA is from every window of this run together, so that it settles instead of swinging with each
window's few steps.

An MFU over 100% is a peak that is wrong, not a run that beats the hardware: the first time a
window does better than the peak, the peak is measured again (flops.peak_above, a CPU's); an MFU
still over 100% is not shown, nor recorded, and one warning says why.
"""
import datetime
import time
from typing import Callable, Optional

import torch

from mingpt.common.logger import log, on_terminal, show_status, warn_once
from mingpt.reporting.flops import model_flops_utilization

LONG_RUN_S = 3600.0
"""A first ETA longer than this brings the long-run hint (see TrainingMonitor.long_run_hint)."""
BAR_WIDTH = 20
ASSUMED_MFU = 0.3
"""A step's time as start-up estimates it, before any is measured: its FLOPs at this share of the peak."""
TERMINAL_INTERVAL_S = 1.0


def format_eta(seconds: float) -> str:
    return str(datetime.timedelta(seconds=int(seconds)))


class TrainingMonitor:
    def __init__(self, flops_per_token: int, peak_flops: Optional[float], world_size: int,
                 total_steps: int, max_epochs: Optional[int], interval_s: float, active: bool,
                 long_run_hint: str = "", peak_above: Optional[Callable[[float], Optional[float]]] = None):
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        """One device's peak in the precision training uses (flops.peak_flops); None: no MFU."""
        self.peak_above = peak_above
        """Given the FLOP/s a device achieved above its peak: the peak measured again, or None when it
        is still below (flops.peak_above for this device and dtype); asked once."""
        self.world_size = world_size
        self.total_steps = total_steps
        self.max_epochs = max_epochs
        self.interval_s = TERMINAL_INTERVAL_S if on_terminal() else interval_s
        self.active = active
        self.tokens_per_s: Optional[float] = None
        """Throughput of all ranks together over the latest report window."""
        self._window: Optional[tuple[float, int, int]] = None  # start time, step, tokens
        self._timed = (0.0, 0)
        """Seconds and steps of every window so far: the ETA's rate."""
        self.long_run_hint = long_run_hint
        """Said once, when the first ETA is over LONG_RUN_S (a GPU-sized run on a CPU)."""
        self.ranks_note: Callable[[int], str] = lambda step: ""
        """What the progress line says of the ranks at a step (a slow one: stragglers.py), or ""."""

    def step_estimate_s(self, step_tokens: int) -> float:
        """A step's time before any is measured: its FLOPs at ASSUMED_MFU of the device's peak (0:
        unknown, as on ranks other than 0)."""
        if not self.peak_flops:
            return 0.0
        return self.flops_per_token * step_tokens / (ASSUMED_MFU * self.peak_flops)

    def forecast(self, steps: int, step_estimate_s: float) -> None:
        """Before the first step: the long-run hint now, when the steps at the estimated time each
        (from the device's peak) are a long run already, rather than after two steps (minutes each
        for a GPU-sized model on a laptop CPU)."""
        eta_s = steps * step_estimate_s
        if self.active and self.long_run_hint and eta_s > LONG_RUN_S:
            log.info(f"This run will take about {format_eta(eta_s)} here ({steps:,} steps of about "
                     f"{step_estimate_s:.0f} s, estimated before the first); {self.long_run_hint}")
            self.long_run_hint = ""

    def restart_window(self) -> None:
        """Measure afresh from the end of the next step: call before training starts or resumes
        after anything that is not training (eval, snapshots)."""
        self._window = None

    @property
    def achieved_flops(self) -> Optional[float]:
        """One device's model FLOP/s over the latest window."""
        if self.tokens_per_s is None:
            return None
        return self.tokens_per_s / self.world_size * self.flops_per_token

    @property
    def mfu(self) -> Optional[float]:
        """The latest window's MFU; None without a peak, and never over 100% (see above)."""
        if self.tokens_per_s is None or not self.peak_flops:
            return None
        per_device = self.tokens_per_s / self.world_size
        mfu = model_flops_utilization(per_device, self.flops_per_token, self.peak_flops)
        return mfu if mfu <= 1.0 else None

    def _check_peak(self) -> None:
        """A window above the peak: the peak measured again, once; if still below, no MFU."""
        achieved = self.achieved_flops
        if not self.peak_flops or achieved <= self.peak_flops:
            return
        before, ask, self.peak_above = self.peak_flops, self.peak_above, None
        self.peak_flops = ask(achieved) if ask else None
        if self.peak_flops is None:
            warn_once(f"MFU is not shown: training does {achieved / 1e9:,.1f} GFLOP/s per device, more than "
                      f"its peak ({before / 1e9:,.1f} GFLOP/s) even measured again, so the peak cannot be "
                      "trusted (on a CPU: measured while other processes held its cores)")

    def update(self, epoch: int, step: int, tokens: int, loss: torch.Tensor) -> None:
        if not self.active:
            return
        if self._window is None:
            loss.item()  # wait for the warm-up step itself to finish, once per window
            self._window = (time.monotonic(), step, tokens)
            return
        start, start_step, start_tokens = self._window
        if time.monotonic() - start < self.interval_s or step == start_step:
            return
        loss_value = loss.item()  # waits for the device, so the clock below is honest
        elapsed = time.monotonic() - start
        self.tokens_per_s = (tokens - start_tokens) / elapsed
        self._check_peak()
        timed_s, timed_steps = self._timed[0] + elapsed, self._timed[1] + step - start_step
        self._timed = (timed_s, timed_steps)
        eta_s = max(self.total_steps - step, 0) * timed_s / timed_steps
        note = self.ranks_note(step)
        show_status(self._line(epoch, step, loss_value, eta_s) + (f" | {note}" if note else ""))
        if self.long_run_hint and eta_s > LONG_RUN_S:
            log.info(f"This run will take about {format_eta(eta_s)} here; {self.long_run_hint}")
        self.long_run_hint = ""
        self._window = (time.monotonic(), step, tokens)

    def _line(self, epoch: int, step: int, loss: float, eta_s: float) -> str:
        done = step / max(self.total_steps, 1)
        mfu = f" | MFU {self.mfu:.1%}" if self.mfu is not None else ""
        bar = ""
        if on_terminal():
            filled = round(BAR_WIDTH * done)
            bar = f"[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {done:4.0%} "
        epochs = f"/{self.max_epochs}" if self.max_epochs else ""  # none under a step budget
        return (f"{bar}epoch {epoch}{epochs} | step {step}/{self.total_steps} | "
                f"loss {loss:.4f} | {self.tokens_per_s:,.0f} tok/s{mfu} | ETA {format_eta(eta_s)}")
