"""The memory-bandwidth reference and what each decode configuration achieves against it.

Reference: one large tensor copied into another (`dst.copy_(src)`) with the bench's thread
count, counted like STREAM's Copy (bytes read + bytes written), best of the repeats; the
harness measures it before and after the engines and keeps both sets of repeats.
A decode step must read the weights it multiplies and every K/V row it attends to, so
(KV bytes + weight bytes) / step time is a lower bound on the bandwidth it used.
"""

from __future__ import annotations

import time

import torch

from services.benchmark.results import Bandwidth, DecodeRun, ModelFacts

_REPEATS = 5


def measure_copy(nbytes: int, threads: int, repeats: int = _REPEATS) -> Bandwidth:
    """Copy `nbytes` of float32 `repeats` times after one untimed pass (page faults)."""
    torch.set_num_threads(threads)
    source = torch.ones(nbytes // 4, dtype=torch.float32)
    target = torch.empty_like(source)
    target.copy_(source)
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        target.copy_(source)
        seconds.append(time.perf_counter() - started)
    return Bandwidth(nbytes=source.nbytes, seconds=tuple(seconds), threads=threads)


def bytes_per_step(run: DecodeRun, facts: ModelFacts) -> int:
    """Bytes a decode step reads at least: the cache it starts from plus the weights."""
    return run.kv_bytes + facts.weight_bytes_read_per_step


def achieved(run: DecodeRun, facts: ModelFacts) -> float:
    """Bytes/s the median step achieved."""
    return bytes_per_step(run, facts) / (run.ms_per_token / 1000)


def fraction_of_reference(run: DecodeRun, facts: ModelFacts, reference: Bandwidth) -> float:
    return achieved(run, facts) / reference.bytes_per_s
