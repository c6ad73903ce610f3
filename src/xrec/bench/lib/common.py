"""What every benchmark shares: the environment record, statistics, peak memory, output files."""

from __future__ import annotations

import ctypes
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

MIB = 1 << 20


def environment(device: str = "cpu") -> dict[str, Any]:
    """Where and how a benchmark ran: CPU, cores, versions, threads, git SHA, date, command."""
    import torch

    env = {
        "cpu": _cpu_model(), "cores": os.cpu_count(), "python": platform.python_version(),
        "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
        "transformers": _version("transformers"), "device": device,
        "git_sha": _git("rev-parse", "HEAD") or "unknown",
        "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "load_avg_1m": _load_avg(),
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(torch.device(device))
    if device == "cpu":
        from xrec.model.gemm import cpu_fp32_gemm
        env["cpu_fp32_gemm"] = cpu_fp32_gemm()   # the library of xrec's float32 products
    return env


def _load_avg() -> float | None:
    """Other processes on the machine skew every number; the 1-minute load says how busy it was."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _git(*args: str) -> str:
    """Output of a git command run beside this file; '' outside a checkout."""
    try:
        out = subprocess.run(["git", *args], cwd=Path(__file__).parent, capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


# ---- statistics --------------------------------------------------------------------------

def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100) of a non-empty sequence."""
    data = sorted(values)
    if not data:
        return float("nan")
    pos = (len(data) - 1) * q / 100.0
    low = int(pos)
    high = min(low + 1, len(data) - 1)
    return data[low] + (data[high] - data[low]) * (pos - low)


def summarize(wall_s: Sequence[float], latencies_s: Sequence[float], num_requests: int) -> dict:
    """Median batch time, requests/s and per-request latency percentiles (milliseconds)."""
    median = statistics.median(wall_s)
    return {"runs": len(wall_s), "wall_ms": [round(w * 1e3, 3) for w in wall_s],
            "median_ms": median * 1e3, "requests_per_s": num_requests / median,
            "p50_ms": percentile(latencies_s, 50) * 1e3, "p95_ms": percentile(latencies_s, 95) * 1e3,
            "p99_ms": percentile(latencies_s, 99) * 1e3}


# ---- peak memory --------------------------------------------------------------------------

class PeakMemory:
    """Peak extra memory of a block: on CPU the RSS of process `pid` (default this one)
    sampled every `interval_s` by a background thread (and the kernel's VmHWM where it can
    be reset), minus the RSS before; on CUDA `torch.cuda.max_memory_allocated` minus the
    allocation before.

    >>> with PeakMemory("cpu") as mem: run()
    >>> mem.peak_bytes
    """

    def __init__(self, device: str = "cpu", interval_s: float = 0.001, pid: int | None = None):
        self.device, self.interval_s = device, interval_s
        self.proc = Path("/proc") / ("self" if pid is None else str(pid))
        self.peak_bytes = 0
        self._stop = threading.Event()

    def __enter__(self) -> "PeakMemory":
        import gc
        gc.collect()
        if self.device.startswith("cuda"):
            import torch
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._base = torch.cuda.memory_allocated()
            return self
        if self.proc.name == "self":
            _trim_heap()
        self._hwm_reset = _reset_hwm(self.proc)
        self._base = self._max = _status_bytes(self.proc, "VmRSS")
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._max = max(self._max, _status_bytes(self.proc, "VmRSS"))

    def __exit__(self, *exc: Any) -> None:
        if self.device.startswith("cuda"):
            import torch
            torch.cuda.synchronize()
            self.peak_bytes = torch.cuda.max_memory_allocated() - self._base
            return
        self._stop.set()
        self._thread.join()
        peak = max(self._max, _status_bytes(self.proc, "VmRSS"))
        if self._hwm_reset:
            peak = max(peak, _status_bytes(self.proc, "VmHWM"))
        self.peak_bytes = max(0, peak - self._base)


def _status_bytes(proc: Path, key: str) -> int:
    try:
        with open(proc / "status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _reset_hwm(proc: Path) -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) of `proc` to its current RSS; False where
    not allowed."""
    try:
        with open(proc / "clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _trim_heap() -> None:
    """Give freed heap pages back to the OS so the baseline is not inflated by a previous run."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


# ---- child processes ----------------------------------------------------------------------

# runs `python -m MODULE ARGS` (argv[2:]) after asking the kernel for SIGTERM when its parent,
# the bench (pid argv[1]), ends however it ends (PR_SET_PDEATHSIG, Linux); a parent gone
# before the request took effect is checked by pid
_ENDS_WITH_PARENT = ("import ctypes, os, runpy, signal, sys\n"
                     "libc = ctypes.CDLL(None)\n"
                     "if hasattr(libc, 'prctl'):\n    libc.prctl(1, signal.SIGTERM)\n"
                     "if os.getppid() != int(sys.argv[1]):\n    sys.exit(1)\n"
                     "sys.argv = sys.argv[2:]\n"
                     "runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)\n")


def module_command(module: str, *args: str) -> list[str]:
    """The command that runs `python -m module *args` as a child that gets SIGTERM when this
    process ends, also by SIGKILL or a crash (where the kernel offers it: Linux), so that a
    killed bench leaves no server behind. Start it from a thread that outlives the child:
    the kernel signals it when the thread that started it ends."""
    return [sys.executable, "-c", _ENDS_WITH_PARENT, str(os.getpid()), module, *args]


# ---- output -----------------------------------------------------------------------------

def output_paths(out_dir: str | os.PathLike, name: str) -> dict[str, Path]:
    """`<out>/<name>-<timestamp>.{json,md,png}` (the directory is created); a run that ends
    in the same second as another takes `<name>-<timestamp>-2`, and so on: the JSON file
    is claimed here, so no run writes over another's results."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stamp = f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    for attempt in range(1, 1000):
        base = stamp if attempt == 1 else f"{stamp}-{attempt}"
        try:
            (out / f"{base}.json").open("x").close()
        except FileExistsError:
            continue
        return {ext: out / f"{base}.{ext}" for ext in ("json", "md", "png")}
    raise OSError(f"{out}: no free name for {stamp}.json")


def write_outputs(paths: dict[str, Path], record: dict, render: Callable[[dict], str],
                  draw: Callable[[Path], None] | None = None) -> None:
    """Note the load at the end, write the JSON record and its Markdown `render`ing, print it,
    then `draw` the plot into `paths["png"]`: the results are on disk before the plot runs,
    so a plot that fails loses none of them."""
    if "environment" in record:
        record["environment"]["load_avg_1m_end"] = _load_avg()
    markdown = render(record)
    paths["json"].write_text(json.dumps(record, indent=2, default=_json_default) + "\n")
    paths["md"].write_text(markdown + "\n")
    print(markdown)
    if draw is not None:
        draw(paths["png"])
    written = [str(p) for p in paths.values() if p.exists()]
    print("\nwrote " + ", ".join(written))


def _json_default(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
        return "" if value is None else str(value)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def environment_markdown(env: dict[str, Any]) -> str:
    sha = env["git_sha"][:12] + (" (dirty)" if env.get("git_dirty") else "")
    return (f"{env['cpu']}, {env['cores']} cores, torch {env['torch']} "
            f"({env['torch_threads']} threads), transformers {env.get('transformers')}, "
            f"python {env['python']}, device {env['device']}"
            f"{', float32 products ' + env['cpu_fp32_gemm'] if env.get('cpu_fp32_gemm') else ''}"
            f", git {sha}, {env['date']}, "
            f"load average {env.get('load_avg_1m')} at start, {env.get('load_avg_1m_end')} at end")


def pyplot():
    """matplotlib's pyplot on the Agg backend (imported only when a plot is written)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt
