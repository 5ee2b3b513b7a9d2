"""What a decode costs, measured the same way for our engine and for transformers' `generate`.

* Forward passes: a forward hook on the model counts its calls. Our engine also counts them
  (`DecodeStats`); the hook is what makes the transformers baselines comparable, and equal
  counts for our methods are checked by the tests.
* Target KV-cache bytes: the same hook reads the cache the forward returned (keys + values of
  every layer, all rows). Measured after each forward, so a forest's nodes (DSBD), the draft
  candidates (assisted generation) and all W beams (beam sampling) are included; the peak over a
  decode is what the lean-memory target compares with speculative sampling.
* Process RSS: sampled by a thread every 10 ms during the decode, reported as the peak minus the
  RSS just before it. Freed memory is not always handed back to the OS, so a method that runs
  after a hungrier one can show a smaller delta; it is a coarse figure (the KV bytes are exact).
* CUDA: `max_memory_allocated` minus the allocation before the decode, when the device is CUDA.
* Energy: NVML's total-energy counter of the GPU (millijoules since driver load, Volta and
  newer) read before and after; on CPU there is no counter, so it is None with the reason.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import psutil
import torch

from dsbd_core.models.static_step import preparing, replayed_forwards


def cache_shape_and_bytes(cache: object) -> tuple[int, int, int]:
    """(rows, columns, bytes) of a KV cache: a transformers `Cache` or legacy tuples."""
    if cache is None:
        return 0, 0, 0
    layers = getattr(cache, "layers", None)
    pairs = (
        [(getattr(x, "keys", None), getattr(x, "values", None)) for x in layers]
        if layers is not None
        else list(cache)  # type: ignore[call-overload]  # legacy caches: tuples of (keys, values)
    )
    rows = columns = total = 0
    for keys, values in pairs:
        for tensor in (keys, values):
            if isinstance(tensor, torch.Tensor) and tensor.dim() == 4:
                total += tensor.numel() * tensor.element_size()
                rows, columns = max(rows, tensor.shape[0]), max(columns, tensor.shape[2])
    return rows, columns, total


class ForwardCounter:
    """Counts a model's forward calls and the peak KV-cache bytes its outputs hold.

    Python forwards are counted by a forward hook; forwards replayed as captured CUDA graphs (the
    static decode path) run no Python and no hook, so they are read from the static step's own
    count (`replayed_forwards`); the forwards that capture a bucket are not counted. Replays
    hold their KV cache in the static pool, not in an output: the KV peak covers Python forwards
    only.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.kv_peak_bytes = 0
        self.kv_peak_shape = (0, 0)  # (rows, columns) of the cache at the peak
        self._hooked = 0
        self._replays_before = replayed_forwards(model)
        self._paused = False
        self._handle = model.register_forward_hook(self._hook)

    @property
    def calls(self) -> int:
        """Forwards since the start (or `reset`), paused blocks left out."""
        return self._hooked + replayed_forwards(self.model) - self._replays_before

    def reset(self) -> None:
        self._hooked = 0
        self._replays_before = replayed_forwards(self.model)
        self.kv_peak_bytes = 0
        self.kv_peak_shape = (0, 0)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Forwards inside are not counted (scoring an answer is not part of decoding it)."""
        self._paused = True
        replays = replayed_forwards(self.model)
        try:
            yield
        finally:
            self._paused = False
            self._replays_before += replayed_forwards(self.model) - replays

    def remove(self) -> None:
        self._handle.remove()

    def _hook(self, module: torch.nn.Module, args: object, output: object) -> None:
        if self._paused or preparing(module):  # capturing a bucket is not decoding
            return
        self._hooked += 1
        rows, columns, size = cache_shape_and_bytes(getattr(output, "past_key_values", None))
        if size > self.kv_peak_bytes:
            self.kv_peak_bytes, self.kv_peak_shape = size, (rows, columns)


class RssSampler:
    """Peak resident memory of this process during a block, as a delta over its start."""

    def __init__(self, interval_s: float = 0.01) -> None:
        self.interval_s = interval_s
        self._process = psutil.Process()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.baseline = 0
        self.peak = 0

    def __enter__(self) -> RssSampler:
        self.baseline = self.peak = self._process.memory_info().rss
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak = max(self.peak, self._process.memory_info().rss)

    @property
    def peak_delta(self) -> int:
        return max(0, self.peak - self.baseline)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, self._process.memory_info().rss)


class EnergyMeter:
    """GPU energy through NVML; `available` False (and `reason` why) when it cannot measure."""

    def __init__(self, device: torch.device) -> None:
        self.available = False
        self.reason = ""
        self._handle = None
        if device.type != "cuda":
            self.reason = f"no GPU: the run is on {device.type}; NVML measures GPU energy only"
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            index = device.index if device.index is not None else torch.cuda.current_device()
            bus_id = getattr(torch.cuda.get_device_properties(index), "pci_bus_id", None)
            self._handle = (
                pynvml.nvmlDeviceGetHandleByPciBusId(bus_id)
                if bus_id
                else pynvml.nvmlDeviceGetHandleByIndex(index)
            )
            pynvml.nvmlDeviceGetTotalEnergyConsumption(self._handle)
            self._nvml = pynvml
            self.available = True
        except Exception as error:  # no pynvml, no driver, a GPU older than Volta
            self.reason = f"NVML energy counter unavailable: {type(error).__name__}: {error}"

    def read_joules(self) -> float | None:
        if not self.available:
            return None
        return self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle) / 1000.0


@dataclass
class Measurement:
    """What one measured block cost."""

    seconds: float = 0.0
    cpu_seconds: float = 0.0
    rss_peak_delta_bytes: int = 0
    cuda_peak_bytes: int | None = None
    energy_joules: float | None = None


@contextlib.contextmanager
def measured(device: torch.device, energy: EnergyMeter) -> Iterator[Measurement]:
    """Time, CPU time, RSS peak, CUDA peak and GPU energy of the block (filled in at exit)."""
    result = Measurement()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        cuda_base = torch.cuda.memory_allocated(device)
    joules = energy.read_joules()
    with RssSampler() as rss:
        cpu, wall = time.process_time(), time.perf_counter()
        yield result
        if cuda:
            torch.cuda.synchronize(device)
        result.seconds = time.perf_counter() - wall
        result.cpu_seconds = time.process_time() - cpu
    result.rss_peak_delta_bytes = rss.peak_delta
    if cuda:
        result.cuda_peak_bytes = torch.cuda.max_memory_allocated(device) - cuda_base
    after = energy.read_joules()
    if joules is not None and after is not None:
        result.energy_joules = after - joules
