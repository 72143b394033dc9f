"""The worker's system metrics: every few seconds its CPU use and resident memory and each of its GPUs' utilisation,
memory and power (nvidia-ml-py; none without a driver), recorded as ordinary metrics under system/ at the run's
current step, so that the run page charts them beside the training metrics."""
import os
import threading
import time

from sqlalchemy import select
from sqlalchemy.engine import Engine

from .models import Attempt, Run

EVERY_S = 2.0


def gpu_handles() -> list[tuple[str, object]]:
    """(label, NVML handle) of this process's GPUs (CUDA_VISIBLE_DEVICES, as the supervisor set it; else every one)."""
    try:
        import pynvml
        pynvml.nvmlInit()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        text = lambda v: v.decode() if isinstance(v, bytes) else v  # noqa: E731 (older nvidia-ml-py gives bytes)
        devices = [(text(pynvml.nvmlDeviceGetUUID(h)), text(pynvml.nvmlDeviceGetPciInfo(h).busId)) for h in handles]
    except Exception:  # no nvidia-ml-py, or no NVIDIA driver on this machine: no GPU metrics
        return []
    return [(label, handles[i]) for label, i in cuda_devices(os.environ.get("CUDA_VISIBLE_DEVICES"), devices)]


def cuda_devices(visible: str | None, devices: list[tuple[str, str]]) -> list[tuple[str, int]]:
    """(label, NVML index) of each GPU that CUDA_VISIBLE_DEVICES (`visible`; None: every GPU) names, in its order.
    `devices`: each NVML device's (UUID, PCI bus id), in NVML's order, which is not CUDA's. An entry is a GPU's UUID
    (GPU-..., or a prefix that names one GPU) or an index in PCI bus order: CUDA's with CUDA_DEVICE_ORDER=PCI_BUS_ID,
    and its default order on a machine of one GPU model. As in CUDA, the first entry that names no GPU (or one
    named already) ends the list; a MIG instance names none here. The label is the index in PCI bus order, as
    nvidia-smi numbers GPUs."""
    by_bus = sorted(range(len(devices)), key=lambda i: devices[i][1].lower())
    entries = [str(n) for n in range(len(devices))] if visible is None else [e.strip() for e in visible.split(",")]
    found = []
    for entry in entries:
        if entry.isdigit():
            matches = [by_bus[int(entry)]] if int(entry) < len(by_bus) else []
        else:
            matches = [i for i, (uuid, _) in enumerate(devices) if entry and uuid.startswith(entry)]
        if len(matches) != 1 or matches[0] in found:
            break
        found.append(matches[0])
    return [(f"gpu{by_bus.index(i)}", i) for i in found]


def sample(handles, last: tuple[float, float]) -> tuple[dict[str, float], tuple[float, float]]:
    """One sample: CPU percent since `last` (wall, CPU seconds), resident memory, each GPU's use."""
    wall, times = time.monotonic(), os.times()
    cpu = times.user + times.system
    values = {"system/cpu_percent": 100 * (cpu - last[1]) / max(1e-9, wall - last[0])}
    try:
        with open("/proc/self/statm") as f:  # Linux: resident pages are the second field
            values["system/rss_gb"] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9
    except OSError:
        pass
    if handles:
        import pynvml
        for label, h in handles:
            memory = pynvml.nvmlDeviceGetMemoryInfo(h)
            values[f"system/{label}_util_percent"] = pynvml.nvmlDeviceGetUtilizationRates(h).gpu
            values[f"system/{label}_memory_gb"] = memory.used / 1e9
            values[f"system/{label}_power_w"] = pynvml.nvmlDeviceGetPowerUsage(h) / 1000
    return values, (wall, cpu)


class SystemSampler(threading.Thread):
    """Samples until stopped, each sample at the run's latest recorded step (a later sample at that step replaces
    the earlier one, as a metric row is unique per step)."""

    def __init__(self, engine: Engine, run_id: int, attempt_id: int, sink, every: float = EVERY_S):
        super().__init__(name=f"molt-system-{run_id}", daemon=True)
        self.engine, self.sink, self.every = engine, sink, every
        # only once this attempt's own first step is recorded: the sink takes an attempt's first metrics step as the
        # step it resumed from, which a sample at the previous attempt's last step would falsify
        self.step = (select(Run.step).join(Attempt, Attempt.run_id == Run.id)
                     .where(Run.id == run_id, Attempt.id == attempt_id, Attempt.start_step.is_not(None)))
        self.stopped = threading.Event()

    def run(self):
        handles = gpu_handles()
        times = os.times()
        last = (time.monotonic(), times.user + times.system)
        while not self.stopped.wait(self.every):
            try:
                values, last = sample(handles, last)
                with self.engine.connect() as c:
                    step = c.scalar(self.step)
                if step is not None:
                    self.sink.metrics(step, values)
            except Exception as e:  # a sample is worth less than the run: say so once a minute at most, go on
                print(f"molt worker: system metrics: {type(e).__name__}: {e}", flush=True)
                self.stopped.wait(60)

    def stop(self):
        self.stopped.set()
        self.join(10)  # a sample in flight reaches the sink before it closes
