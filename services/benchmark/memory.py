"""Resident memory: a per-phase peak probe for the measurement processes, and the estimate
that decides which (model, context) cells fit the memory budget before anything runs.

The probe resets the kernel's peak-RSS mark (`/proc/self/clear_refs`, value 5, Linux >= 4.0)
at the start of a phase and reads VmHWM at its end. Freed heap is first handed back with
glibc's `malloc_trim`, so a phase does not inherit an earlier phase's high-water mark.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import resource
import sys
from dataclasses import dataclass
from pathlib import Path

import psutil

from services.benchmark.results import PhaseMemory

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
_FP32 = 4
# Resident before any model loads (interpreter, torch; transformers and kvpress too),
# as measured at the start of the bench's processes, rounded up.
_BASELINE = {"kvrelay": 512 * 2**20, "transformers": 768 * 2**20}


class PeakProbe:
    """Measures one phase at a time: `start()`, run the phase, `stop()` -> PhaseMemory."""

    def __init__(self) -> None:
        self._libc = _libc()
        self._start = 0
        self._scope = "phase"

    def start(self) -> None:
        if self._libc is not None:
            self._libc.malloc_trim(0)
        try:
            _CLEAR_REFS.write_text("5")
        except OSError:
            self._scope = "process"
        self._start = current_rss()

    def stop(self) -> PhaseMemory:
        return PhaseMemory(start=self._start, peak=max(_peak_rss(), self._start), scope=self._scope)


def current_rss() -> int:
    return int(psutil.Process().memory_info().rss)


def _peak_rss() -> int:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    libc = ctypes.CDLL(name)
    return libc if hasattr(libc, "malloc_trim") else None


def available_bytes() -> int:
    return int(psutil.virtual_memory().available)


@dataclass(frozen=True)
class ModelDims:
    """What the estimate needs from a model config (fp32 everywhere in this bench)."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    weight_bytes: int


def kv_bytes(dims: ModelDims, tokens: int) -> int:
    """K + V of `tokens` positions over every layer and K/V head.  # [L, H_kv, T, d_h] x 2"""
    return 2 * dims.num_layers * dims.num_kv_heads * tokens * dims.head_dim * _FP32


def estimate_peak(dims: ModelDims, process: str, context: int, chunk: int, obs_window: int) -> int:
    """A deliberately generous peak-RSS estimate of one measurement process at `context` tokens.

    Both: the process baseline (interpreter and libraries) and the weights. kvrelay: source
    K/V, a packed copy of up to all of it, the observation attention `[L, H_q, W, T]`, one
    chunk's attention scores `[H_q, C, T]` (and its softmax), the hidden states and the
    chunk's MLP activations. transformers (and kvpress): the DynamicCache, hidden states and
    MLP activations of the whole prompt in one forward, K/V of one layer expanded to the
    query heads, and a materialized `[T, T]` boolean causal mask.
    """
    if process not in _BASELINE:
        raise ValueError(f"process: unknown {process!r}")
    kv = kv_bytes(dims, context)
    fixed = _BASELINE[process] + dims.weight_bytes
    if process == "kvrelay":
        rows = min(chunk, context)
        observation = dims.num_layers * dims.num_q_heads * obs_window * context * _FP32
        scores = 2 * dims.num_q_heads * rows * context * _FP32
        activations = rows * (3 * dims.intermediate_size + 4 * dims.hidden_size) * _FP32
        hidden = context * dims.hidden_size * _FP32
        return fixed + 2 * kv + observation + scores + activations + hidden
    activations = context * (3 * dims.intermediate_size + 8 * dims.hidden_size) * _FP32
    expanded = 2 * dims.num_q_heads * context * dims.head_dim * _FP32
    return fixed + kv + activations + expanded + context * context
