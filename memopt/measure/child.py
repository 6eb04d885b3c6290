"""The fresh process a CPU measurement runs in, and what it reads from the OS.

PyTorch's CPU allocator keeps no counter, so a CPU step is measured in a child process
(``python -m memopt.measure ... --json``) started with ``MALLOC_MMAP_THRESHOLD_`` set to
one page, so that every buffer of a page or more is mmap'd and goes back to the OS when
freed. In it, memopt.measure.inprocess hands free heap pages back (``trim_heap``), resets
VmHWM to the current RSS (``reset_hwm``), reads VmRSS and, after the step, VmHWM
(``read_status_kib``); before the timed steps it sets glibc back to its steady state for
large buffers (``steady_allocator``). memopt.measure's docstring says why each is needed.

``measure_in_child`` starts that process, kills it (and whatever it started) at the
timeout, and reads its one JSON result line back into a Measurement.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .records import Measurement

logger = logging.getLogger(__name__)

__all__ = ["MALLOC_MMAP_THRESHOLD", "measure_in_child", "read_status_kib", "reset_hwm",
           "steady_allocator", "trim_heap"]

MALLOC_MMAP_THRESHOLD = 4096
"""Value of ``MALLOC_MMAP_THRESHOLD_`` in the child process (bytes)."""

_STDERR_TAIL_LINES = 30

#: glibc mallopt parameters, and the values its dynamic mmap threshold settles at on a
#: 64-bit machine (DEFAULT_MMAP_THRESHOLD_MAX; the trim threshold is then twice it).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_STEADY_MMAP_THRESHOLD = 32 << 20


# --------------------------------------------------------------------------
# Inside the child: the process's memory, as the OS sees it
# --------------------------------------------------------------------------


def read_status_kib(field_name: str) -> int:
    """A ``/proc/self/status`` field in KiB (``"VmRSS"``, ``"VmHWM"``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field_name}")


def steady_allocator() -> bool:
    """Set glibc's allocator back from the page-sized mmap threshold of the measuring
    child (``MALLOC_MMAP_THRESHOLD_``) to its steady state for large buffers, for the
    timed steps; False where this process does not run under that threshold, or is not
    on glibc."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != str(MALLOC_MMAP_THRESHOLD):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, _STEADY_MMAP_THRESHOLD)
                    and libc.mallopt(_M_TRIM_THRESHOLD, 2 * _STEADY_MMAP_THRESHOLD))
    except (OSError, AttributeError):
        return False


def trim_heap() -> None:
    """Return free heap pages to the OS (glibc `malloc_trim`), so that a step reusing
    memory freed during warm-up faults those pages in again and is counted."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the measurement may under-count
        logger.warning("malloc_trim unavailable; small buffers may be under-counted")


def reset_hwm() -> None:
    """Reset VmHWM to the current RSS (``5`` written to ``/proc/self/clear_refs``)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError as exc:
        raise RuntimeError(
            "cannot reset VmHWM through /proc/self/clear_refs; CPU peak "
            f"measurement needs Linux >= 4.0 and write access there: {exc}"
        ) from exc


# --------------------------------------------------------------------------
# In the parent: start the child and read its result
# --------------------------------------------------------------------------


def _tail(text: str, lines: int = _STDERR_TAIL_LINES) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def measure_in_child(
    workload: str,
    *,
    mode: str,
    budget: Any,
    device: str,
    warmup: int,
    timed_steps: int,
    options: dict | None,
    path: Sequence[str],
    timeout: float,
    grads: str = "none",
) -> Measurement:
    """Measure in a fresh ``python -m memopt.measure`` process (the arguments are
    memopt.measure.measure_step's, already checked). Raises RuntimeError when the child
    fails, times out or prints no result line, with the end of its stderr."""
    repo_root = str(Path(__file__).resolve().parents[2])
    cwd = os.getcwd()
    cmd = [
        sys.executable, "-m", "memopt.measure",
        "--workload", workload,
        "--mode", mode,
        "--device", device,
        "--warmup", str(warmup),
        "--timed-steps", str(timed_steps),
        "--grads", grads,
        "--json",
    ]  # fmt: skip
    if budget is not None:
        cmd += ["--budget", str(budget)]
    if options:
        try:
            cmd += ["--options", json.dumps(options)]
        except TypeError as exc:
            raise ValueError(f"options must be JSON-serializable: {exc}") from exc
    for entry in [cwd, *path]:
        cmd += ["--path", str(Path(entry).resolve())]

    env = dict(os.environ)
    env["MALLOC_MMAP_THRESHOLD_"] = str(MALLOC_MMAP_THRESHOLD)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (repo_root, env.get("PYTHONPATH", "")) if p
    )
    logger.debug("running %s", cmd)
    # A new session, so that a timeout kills the child and anything it started.
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            stdout, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            stdout, stderr = "", ""
        raise RuntimeError(
            f"measuring {workload!r} ({mode}) timed out after {timeout} s; "
            f"child stderr ends with:\n{_tail(stderr or '')}"
        ) from None
    if proc.returncode != 0:
        raise RuntimeError(
            f"measuring {workload!r} ({mode}) failed (exit status "
            f"{proc.returncode}); child stderr ends with:\n{_tail(stderr)}"
        )
    for line in reversed(stdout.splitlines()):
        if line.startswith("{"):
            try:
                return Measurement.from_json(line)
            except (ValueError, TypeError):
                continue
    raise RuntimeError(
        f"measuring {workload!r} ({mode}): the child printed no result line; "
        f"stdout ends with:\n{_tail(stdout)}\nstderr ends with:\n{_tail(stderr)}"
    )
