"""The codes table's scoring kernel: every omitted row's estimated logit for each reading head,
and the per-page log-sum-exp the codes ranking reads, in one pass over the table.

Why a kernel of our own: torch's batched bfloat16 product with 3 query rows per owner runs at
4-7 GB/s on a CPU that streams the same table at 27-34 GB/s, and its bfloat16 accumulation errs
by up to 0.04 nats (docs/results/recall-smollm2/tuning.md, "The page sketch on prose"). Over
the table's blocks (`CodeTable`: each block of `block` slots is `[d_h, block]`, contiguous)
the loop below accumulates in float32 and vectorizes over slots.

Built once per machine with `torch.utils.cpp_extension.load_inline` (a C++ compiler and ninja;
cached under torch's extensions folder), for the CPU it runs on (`-march=native`). A container
image has no compiler in its final stage and a read-only home: its builder stage builds the
kernel ahead for each x86-64 level (`prebuild`, `kvrelay build-kernels`), and the best one this
CPU runs is loaded from that folder (`KERNELS_ENV`) before any build is tried. Where neither
is there, tables are laid out in one block (`table_block`: coordinates-first, as before the
kernel) and torch's bfloat16 product scores them as it did; `available()` says whether a
kernel is in use and `describe()` which.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

# Most heads one owner is read by that the kernel takes (GQA groups are 1-8 heads wide), and
# its widest block of slots.
MAX_GROUP = 8
MAX_BLOCK = 256
# Slots a block holds, about: 128 measured fastest on a 2-core AVX-512 host (64: 3.0 ms, 128:
# 2.9 ms, 256: 4.0 ms for a 44 MB table, tuning.md, "The page sketch on prose").
BLOCK_SLOTS = 128


def block_for(page_size: int) -> int:
    """The kernel's block for pages of `page_size` slots: whole pages, about `BLOCK_SLOTS`."""
    return page_size * max(1, BLOCK_SLOTS // page_size)


def table_block(page_size: int, slots: int) -> int:
    """The block a codes table of `slots` slots a segment is laid out in: the kernel's where it
    is built, else one block of every slot (coordinates-first `[S, d_h, slots]`, the layout
    torch's batched product reads fastest)."""
    block = block_for(page_size)
    if block <= MAX_BLOCK and available():
        return block
    return max(slots, page_size)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

namespace {
constexpr int64_t kMaxGroup = 8;
constexpr int64_t kMaxBlock = 256;

inline float bf16(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float out;
  std::memcpy(&out, &wide, sizeof(out));
  return out;
}

#ifdef __AVX512F__
typedef float f32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

// 32 bfloat16 values from one 64-byte load, widened to float32 without shuffles: each 32-bit
// lane holds two, the even one in its low half (shifted up, it is that float32) and the odd
// one in its high half (the low half masked off).
inline void widen_pairs(const uint16_t* p, f32x16& even, f32x16& odd) {
  u32x16 pair;
  std::memcpy(&pair, p, sizeof(pair));
  const u32x16 lo = pair << 16, hi = pair & (u32x16{} + 0xFFFF0000u);
  std::memcpy(&even, &lo, sizeof(lo));
  std::memcpy(&odd, &hi, sizeof(hi));
}

// One step of 32 kLoads slots (`kLoads` loads a coordinate): even[k][v] and odd[k][v] =
// sum_c w[k, c] * rows[c * stride + 32 v + 2j (+1)], every sum in a register.
template <int64_t K, int64_t kLoads>
inline void step_dot(const float* __restrict w, const uint16_t* __restrict rows, int64_t stride,
                     int64_t D, f32x16 (&even)[K][kLoads], f32x16 (&odd)[K][kLoads]) {
  for (int64_t k = 0; k < K; ++k)
    for (int64_t v = 0; v < kLoads; ++v) even[k][v] = odd[k][v] = f32x16{};
  for (int64_t c = 0; c < D; ++c) {
    f32x16 lo[kLoads], hi[kLoads];
    for (int64_t v = 0; v < kLoads; ++v) widen_pairs(rows + c * stride + 32 * v, lo[v], hi[v]);
    for (int64_t k = 0; k < K; ++k) {
      const float wk = w[k * D + c];
      for (int64_t v = 0; v < kLoads; ++v) {
        even[k][v] += wk * lo[v];
        odd[k][v] += wk * hi[v];
      }
    }
  }
}

// `heads_dot` in steps of 32 kLoads slots (a block's last slots through zero-padded rows).
template <int64_t K, int64_t kLoads>
void steps_dot(const float* w, int64_t g0, const uint16_t* block, int64_t D, int64_t width,
               float (*acc)[kMaxBlock]) {
  constexpr int64_t kStep = 32 * kLoads;
  f32x16 even[K][kLoads], odd[K][kLoads];
  std::vector<uint16_t> padded;
  for (int64_t i0 = 0; i0 < width; i0 += kStep) {
    const int64_t lanes = std::min(kStep, width - i0);
    if (lanes == kStep) {
      step_dot<K, kLoads>(w, block + i0, width, D, even, odd);
    } else {
      padded.assign(D * kStep, 0);
      for (int64_t c = 0; c < D; ++c)
        std::memcpy(padded.data() + c * kStep, block + c * width + i0, sizeof(uint16_t) * lanes);
      step_dot<K, kLoads>(w, padded.data(), kStep, D, even, odd);
    }
    for (int64_t k = 0; k < K; ++k) {
      for (int64_t v = 0; v < kLoads; ++v) {
        alignas(64) float e[16], o[16];
        std::memcpy(e, &even[k][v], sizeof(e));
        std::memcpy(o, &odd[k][v], sizeof(o));
        float* out = acc[g0 + k] + i0 + 32 * v;
        for (int64_t j = 0; j < 16 && 32 * v + 2 * j < lanes; ++j) {
          out[2 * j] = e[j];
          if (32 * v + 2 * j + 1 < lanes) out[2 * j + 1] = o[j];
        }
      }
    }
  }
}
#endif

// acc[g0 + k][i] = sum_c q[g0 + k, c] * block[c, i] for k < K <= 4 and i < width: up to four
// reading heads at a time. With AVX-512, a step of up to 128 slots keeps every head's sums in
// registers over all coordinates while reading each coordinate's row of the block in order
// (1.9x the loop below on a cached table, 1.6x streaming one); else the loop over slots
// inside one over coordinates, each head's sums in memory. Both sum each slot in coordinate
// order, so they agree to the bit.
template <int64_t K>
void heads_dot(const float* q, int64_t g0, const uint16_t* block, int64_t D, int64_t width,
               float (*acc)[kMaxBlock]) {
#ifdef __AVX512F__
  // 2 K kLoads sums in registers, of 32: four loads a step up to three heads.
  constexpr int64_t kLoads = K <= 3 ? 4 : 2;
  steps_dot<K, kLoads>(q + g0 * D, g0, block, D, width, acc);
#else
  for (int64_t k = 0; k < K; ++k) std::fill(acc[g0 + k], acc[g0 + k] + width, 0.f);
  float* __restrict a0 = acc[g0];
  float* __restrict a1 = acc[g0 + (K > 1 ? 1 : 0)];
  float* __restrict a2 = acc[g0 + (K > 2 ? 2 : 0)];
  float* __restrict a3 = acc[g0 + (K > 3 ? 3 : 0)];
  for (int64_t c = 0; c < D; ++c) {
    const uint16_t* __restrict row = block + c * width;
    const float w0 = q[g0 * D + c];
    const float w1 = K > 1 ? q[(g0 + 1) * D + c] : 0.f;
    const float w2 = K > 2 ? q[(g0 + 2) * D + c] : 0.f;
    const float w3 = K > 3 ? q[(g0 + 3) * D + c] : 0.f;
    #pragma omp simd
    for (int64_t i = 0; i < width; ++i) {
      const float x = bf16(row[i]);
      a0[i] += w0 * x;
      if constexpr (K > 1) a1[i] += w1 * x;
      if constexpr (K > 2) a2[i] += w2 * x;
      if constexpr (K > 3) a3[i] += w3 * x;
    }
  }
#endif
}

// acc[g][i] = sum_c q[g, c] * block[c, i] for g < G, i < width (block: [D, width] bfloat16).
void dot_any(int64_t G, const float* q, const uint16_t* block, int64_t D, int64_t width,
             float (*acc)[kMaxBlock]) {
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    switch (std::min<int64_t>(4, G - g0)) {
      case 1: heads_dot<1>(q, g0, block, D, width, acc); break;
      case 2: heads_dot<2>(q, g0, block, D, width, acc); break;
      case 3: heads_dot<3>(q, g0, block, D, width, acc); break;
      default: heads_dot<4>(q, g0, block, D, width, acc); break;
    }
  }
}

void check(const torch::Tensor& q, const torch::Tensor& table, int64_t slots, int64_t block) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32 && q.is_contiguous(), "q");
  TORCH_CHECK(q.size(1) >= 1 && q.size(1) <= kMaxGroup, "q: 1 to 8 heads an owner");
  TORCH_CHECK(table.dim() == 2 && table.scalar_type() == torch::kBFloat16 && table.is_contiguous(),
              "table");
  TORCH_CHECK(table.size(0) == q.size(0) && table.size(1) == q.size(2) * slots, "table shape");
  TORCH_CHECK(block >= 1 && block <= kMaxBlock, "block");
}
}  // namespace

// logits[s, g, n] = q[s, g] . row n of segment s  -> [S, G, slots] float32
// out[s, g, n] = q[s, g] . row n of segment s, for `block_logits` and `LayerTermJob`.
void logits_into(const float* qp, const uint16_t* tp, int64_t S, int64_t G, int64_t D,
                 int64_t slots, int64_t block, float* op) {
  alignas(64) float acc[kMaxGroup][kMaxBlock];
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t n0 = 0; n0 < slots; n0 += block) {
      const int64_t width = std::min(block, slots - n0);
      dot_any(G, qp + s * G * D, tp + s * D * slots + n0 * D, D, width, acc);
      for (int64_t g = 0; g < G; ++g)
        std::memcpy(op + (s * G + g) * slots + n0, acc[g], sizeof(float) * width);
    }
  }
}

torch::Tensor block_logits(torch::Tensor q, torch::Tensor table, int64_t slots, int64_t block) {
  check(q, table, slots, block);
  const int64_t S = q.size(0), G = q.size(1), D = q.size(2);
  auto out = torch::empty({S, G, slots}, q.options());
  pybind11::gil_scoped_release no_gil;  // a recall planner thread scores beside the decode loop
  logits_into(q.data_ptr<float>(), reinterpret_cast<const uint16_t*>(table.data_ptr<at::BFloat16>()),
              S, G, D, slots, block, out.data_ptr<float>());
  return out;
}

// e^x for x <= 88 within about 2 ulp, 0 below -87 (so e^-inf is 0): Cody-Waite reduction to
// 2^n e^r, |r| <= ln2 / 2, and a degree-6 polynomial (Cephes' expf). Written so a slot loop
// vectorizes: std::exp without -ffast-math is one scalar call a slot, and so is std::floor.
inline float exp_approx(float x) {
  const float z = std::min(std::max(x, -87.f), 88.f);
  const float n = (z * 1.44269504088896341f + 12582912.f) - 12582912.f;  // rounded (1.5 * 2^23)
  const float r = z - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.f ? 0.f : p * scale;
}

// Per page of `page` consecutive slots (from slot n0 on): logsumexp over its slots of
// max_g (acc[g][i] - r[g]) + bias[i]; written to out[(n0 + p0) / page].
void reduce_pages(const float* const* acc, int64_t G, const float* r, const float* bias,
                  int64_t width, int64_t page, float* out) {
  alignas(64) float best[kMaxBlock];
  for (int64_t i = 0; i < width; ++i) best[i] = acc[0][i] - r[0];
  for (int64_t g = 1; g < G; ++g)
    for (int64_t i = 0; i < width; ++i) best[i] = std::max(best[i], acc[g][i] - r[g]);
  for (int64_t i = 0; i < width; ++i) best[i] += bias[i];
  // Each slot less its page's largest (a page of unused slots only: 0 - inf, never NaN), one
  // vectorized exp over the block (`exp_approx`: std::exp was a scalar call a slot, most of
  // the reduction's time), then a sum and a log a page.
  alignas(64) float top[kMaxBlock];
  for (int64_t p0 = 0; p0 < width; p0 += page) {
    float m = -INFINITY;
    for (int64_t i = p0; i < p0 + page; ++i) m = std::max(m, best[i]);
    for (int64_t i = p0; i < p0 + page; ++i) top[i] = m == -INFINITY ? 0.f : m;
  }
  #pragma omp simd
  for (int64_t i = 0; i < width; ++i) best[i] = exp_approx(best[i] - top[i]);
  for (int64_t p0 = 0; p0 < width; p0 += page) {
    float total = 0.f;
    for (int64_t i = p0; i < p0 + page; ++i) total += best[i];
    out[p0 / page] = total == 0.f ? -INFINITY : top[p0] + std::log(total);
  }
}

void check_reduce(const torch::Tensor& r, const torch::Tensor& bias, int64_t S, int64_t G,
                  int64_t slots, int64_t block, int64_t page) {
  TORCH_CHECK(page >= 1 && block % page == 0 && slots % page == 0, "page");
  TORCH_CHECK(r.scalar_type() == torch::kFloat32 && r.is_contiguous() && r.numel() == S * G, "r");
  TORCH_CHECK(bias.scalar_type() == torch::kFloat32 && bias.is_contiguous() &&
              bias.numel() == S * slots, "bias");
}

// The page log-sum-exps of `block_logits`' output, in one pass over the table
// -> [S, slots / page] float32
torch::Tensor block_page_lse(torch::Tensor q, torch::Tensor r, torch::Tensor table,
                             torch::Tensor bias, int64_t slots, int64_t block, int64_t page) {
  check(q, table, slots, block);
  const int64_t S = q.size(0), G = q.size(1), D = q.size(2);
  check_reduce(r, bias, S, G, slots, block, page);
  auto out = torch::empty({S, slots / page}, q.options());
  pybind11::gil_scoped_release no_gil;
  const float* qp = q.data_ptr<float>();
  const auto* tp = reinterpret_cast<const uint16_t*>(table.data_ptr<at::BFloat16>());
  float* op = out.data_ptr<float>();
  alignas(64) float acc[kMaxGroup][kMaxBlock];
  const float* rows[kMaxGroup];
  for (int64_t g = 0; g < G; ++g) rows[g] = acc[g];
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t n0 = 0; n0 < slots; n0 += block) {
      const int64_t width = std::min(block, slots - n0);
      dot_any(G, qp + s * G * D, tp + s * D * slots + n0 * D, D, width, acc);
      reduce_pages(rows, G, r.data_ptr<float>() + s * G, bias.data_ptr<float>() + s * slots + n0,
                   width, page, op + s * (slots / page) + n0 / page);
    }
  }
  return out;
}

// One segment's term parts from its logits [G, slots] and slot bias [slots]: top[g], the
// largest live logit (0 when none is live), and page_mass[g, p], the sum over page p's slots
// of e^(logit + bias - top).
void segment_masses(const float* logits, int64_t G, int64_t slots, const float* bias,
                    int64_t page, float* page_mass, float* top) {
  const int64_t pages = slots / page, chunk = page * (kMaxBlock / page);
  alignas(64) float e[kMaxBlock];
  for (int64_t g = 0; g < G; ++g) {
    const float* z = logits + g * slots;
    float m = -INFINITY;
    #pragma omp simd reduction(max : m)
    for (int64_t i = 0; i < slots; ++i) m = std::max(m, z[i] + bias[i]);
    m = m == -INFINITY ? 0.f : m;
    top[g] = m;
    for (int64_t n0 = 0; n0 < slots; n0 += chunk) {
      const int64_t width = std::min(chunk, slots - n0);
      #pragma omp simd
      for (int64_t i = 0; i < width; ++i) e[i] = exp_approx(z[n0 + i] + bias[n0 + i] - m);
      for (int64_t p0 = 0; p0 < width; p0 += page) {
        float total = 0.f;
        for (int64_t i = p0; i < p0 + page; ++i) total += e[i];
        page_mass[g * pages + (n0 + p0) / page] = total;
      }
    }
  }
}

#ifdef __AVX512F__
// `segment_term`'s weighted sum for heads g0 .. g0 + K - 1 and D = 32 kHalves: each head's
// value in registers over every page, each page's row read once for the K heads (as a
// `step_dot` load: even and odd coordinates, put back in order at the end). Each coordinate is
// still summed over pages in page order, so the sums are the loop's in `segment_term`.
template <int64_t K, int64_t kHalves>
void heads_values(const float* page_mass, const float* total, int64_t g0, int64_t pages,
                  const uint16_t* grid, float* value) {
  constexpr int64_t D = 32 * kHalves;
  f32x16 even[K][kHalves] = {}, odd[K][kHalves] = {};
  for (int64_t p = 0; p < pages; ++p) {
    float w[K];
    bool any = false;
    for (int64_t k = 0; k < K; ++k) {
      w[k] = total[k] > 0.f ? page_mass[(g0 + k) * pages + p] / total[k] : 0.f;
      any |= w[k] != 0.f;
    }
    if (!any) continue;
    for (int64_t v = 0; v < kHalves; ++v) {
      f32x16 lo, hi;
      widen_pairs(grid + p * D + 32 * v, lo, hi);
      for (int64_t k = 0; k < K; ++k) {
        if (w[k] == 0.f) continue;
        even[k][v] += w[k] * lo;
        odd[k][v] += w[k] * hi;
      }
    }
  }
  for (int64_t k = 0; k < K; ++k) {
    float* out = value + (g0 + k) * D;
    for (int64_t v = 0; v < kHalves; ++v) {
      alignas(64) float e[16], o[16];
      std::memcpy(e, &even[k][v], sizeof(e));
      std::memcpy(o, &odd[k][v], sizeof(o));
      for (int64_t j = 0; j < 16; ++j) {
        out[32 * v + 2 * j] = e[j];
        out[32 * v + 2 * j + 1] = o[j];
      }
    }
  }
}

template <int64_t kHalves>
void values_by_threes(const float* page_mass, const float* total, int64_t G, int64_t pages,
                      const uint16_t* grid, float* value) {
  for (int64_t g0 = 0; g0 < G; g0 += 3) {
    switch (std::min<int64_t>(3, G - g0)) {
      case 1: heads_values<1, kHalves>(page_mass, total + g0, g0, pages, grid, value); break;
      case 2: heads_values<2, kHalves>(page_mass, total + g0, g0, pages, grid, value); break;
      default: heads_values<3, kHalves>(page_mass, total + g0, g0, pages, grid, value); break;
    }
  }
}
#endif

// One segment's term from its page masses [G, pages] (scaled by e^-top) and value grid
// [pages, D] bfloat16: log_mass[g] = log(sum_p mass) + top[g] and value[g] the masses'
// average of the pages' mean values, in float32 (0 where no page has mass).
void segment_term(const float* page_mass, const float* top, int64_t G, int64_t pages,
                  const uint16_t* grid, int64_t D, float* log_mass, float* value) {
  float total[kMaxGroup];
  for (int64_t g = 0; g < G; ++g) {
    const float* mass = page_mass + g * pages;
    total[g] = 0.f;
    for (int64_t p = 0; p < pages; ++p) total[g] += mass[p];
    log_mass[g] = std::log(total[g]) + top[g];
  }
#ifdef __AVX512F__
  if (D == 64) return values_by_threes<2>(page_mass, total, G, pages, grid, value);
  if (D == 128) return values_by_threes<4>(page_mass, total, G, pages, grid, value);
#endif
  for (int64_t g = 0; g < G; ++g) {
    const float* mass = page_mass + g * pages;
    float* __restrict out = value + g * D;
    std::fill(out, out + D, 0.f);
    if (!(total[g] > 0.f)) continue;
    for (int64_t p = 0; p < pages; ++p) {
      const float w = mass[p] / total[g];
      if (w == 0.f) continue;
      const uint16_t* __restrict row = grid + p * D;
      #pragma omp simd
      for (int64_t c = 0; c < D; ++c) out[c] += w * bf16(row[c]);
    }
  }
}

void check_term(const torch::Tensor& bias, const torch::Tensor& grid, int64_t S, int64_t slots,
                int64_t page) {
  TORCH_CHECK(page >= 1 && page <= kMaxBlock && slots % page == 0, "page");
  TORCH_CHECK(bias.scalar_type() == torch::kFloat32 && bias.is_contiguous() &&
              bias.numel() == S * slots, "bias");
  TORCH_CHECK(grid.dim() == 3 && grid.scalar_type() == torch::kBFloat16 && grid.is_contiguous() &&
              grid.size(0) == S && grid.size(1) == slots / page, "grid");
}

// `value_term_of`'s parts into tensors of its shapes (no interpreter lock handling).
void terms_into(const torch::Tensor& logits, const torch::Tensor& bias, const torch::Tensor& grid,
                int64_t page, torch::Tensor& page_mass, torch::Tensor& top,
                torch::Tensor& log_mass, torch::Tensor& value) {
  const int64_t S = logits.size(0), G = logits.size(1), slots = logits.size(2);
  const int64_t pages = slots / page, D = grid.size(2);
  const auto* gp = reinterpret_cast<const uint16_t*>(grid.data_ptr<at::BFloat16>());
  for (int64_t s = 0; s < S; ++s) {
    float* pm = page_mass.data_ptr<float>() + s * G * pages;
    float* tp = top.data_ptr<float>() + s * G;
    segment_masses(logits.data_ptr<float>() + s * G * slots, G, slots,
                   bias.data_ptr<float>() + s * slots, page, pm, tp);
    segment_term(pm, tp, G, pages, gp + s * pages * D, D, log_mass.data_ptr<float>() + s * G,
                 value.data_ptr<float>() + s * G * D);
  }
}

// The omitted-value term of owner segments from logits already computed [S, G, slots]
// -> page_mass [S, G, pages], top [S, G, 1], log_mass [S, G], value [S, G, D] float32
std::vector<torch::Tensor> value_term_of(torch::Tensor logits, torch::Tensor bias,
                                         torch::Tensor grid, int64_t page) {
  TORCH_CHECK(logits.dim() == 3 && logits.scalar_type() == torch::kFloat32 &&
              logits.is_contiguous() && logits.size(1) <= kMaxGroup, "logits");
  const int64_t S = logits.size(0), G = logits.size(1), slots = logits.size(2);
  check_term(bias, grid, S, slots, page);
  const int64_t pages = slots / page, D = grid.size(2);
  auto page_mass = torch::empty({S, G, pages}, logits.options());
  auto top = torch::empty({S, G, 1}, logits.options());
  auto log_mass = torch::empty({S, G}, logits.options());
  auto value = torch::empty({S, G, D}, logits.options());
  pybind11::gil_scoped_release no_gil;
  terms_into(logits, bias, grid, page, page_mass, top, log_mass, value);
  return {page_mass, top, log_mass, value};
}

// `value_term_of` with the logits scored here, in one call over the layer's segments
// -> logits [S, G, slots] (`block_logits`' to the bit), then value_term_of's four
std::vector<torch::Tensor> block_value_term(torch::Tensor q, torch::Tensor table,
                                            torch::Tensor bias, torch::Tensor grid,
                                            int64_t slots, int64_t block, int64_t page) {
  torch::Tensor logits = block_logits(q, table, slots, block);
  std::vector<torch::Tensor> parts = value_term_of(logits, bias, grid, page);
  parts.insert(parts.begin(), logits);
  return parts;
}

// One request's omitted-value term of one layer: `block_value_term` for the layer's query
// [H_q, D] float32, each owner segment's reading heads gathered and scaled by `scale`
// (q[s, g] = query[readers[s, g]] * scale, as torch multiplies a float32 tensor by a scalar),
// and the log mass and value written per query head (readers is a permutation of the query
// heads). Inputs checked and outputs allocated while the interpreter lock is held; `run`
// computes them without it. parts: logits [S, G, slots], page_mass [S, G, pages],
// top [S, G, 1], log_mass [H_q], value [H_q, D]
struct LayerTermJob {
  torch::Tensor query, readers, table, bias, grid;
  int64_t slots, block, page;
  torch::Tensor q, logits, page_mass, top, log_mass, value, head_mass, head_value;

  LayerTermJob(torch::Tensor query_, torch::Tensor readers_, torch::Tensor table_,
               torch::Tensor bias_, torch::Tensor grid_, int64_t slots_, int64_t block_,
               int64_t page_)
      : query(query_), readers(readers_), table(table_), bias(bias_), grid(grid_),
        slots(slots_), block(block_), page(page_) {
    TORCH_CHECK(query.dim() == 2 && query.scalar_type() == torch::kFloat32 &&
                query.is_contiguous(), "query");
    TORCH_CHECK(readers.dim() == 2 && readers.scalar_type() == torch::kInt64 &&
                readers.is_contiguous() && readers.size(1) >= 1 &&
                readers.size(1) <= kMaxGroup && readers.size(0) * readers.size(1) == query.size(0),
                "readers");
    const int64_t S = readers.size(0), G = readers.size(1), H = query.size(0), D = query.size(1);
    const int64_t* rp = readers.data_ptr<int64_t>();
    std::vector<bool> seen(H, false);
    for (int64_t i = 0; i < H; ++i) {
      TORCH_CHECK(rp[i] >= 0 && rp[i] < H && !seen[rp[i]], "readers: a permutation of the heads");
      seen[rp[i]] = true;
    }
    q = torch::empty({S, G, D}, query.options());
    check(q, table, slots, block);
    logits = torch::empty({S, G, slots}, query.options());
    check_term(bias, grid, S, slots, page);
    page_mass = torch::empty({S, G, slots / page}, query.options());
    top = torch::empty({S, G, 1}, query.options());
    log_mass = torch::empty({S, G}, query.options());
    value = torch::empty({S, G, grid.size(2)}, query.options());
    head_mass = torch::empty({H}, query.options());
    head_value = torch::empty({H, grid.size(2)}, query.options());
  }

  // Without the interpreter lock.
  void run(float factor) {
    const int64_t S = readers.size(0), G = readers.size(1), H = query.size(0), D = query.size(1);
    const int64_t* rp = readers.data_ptr<int64_t>();
    const float* src = query.data_ptr<float>();
    float* qp = q.data_ptr<float>();
    for (int64_t i = 0; i < H; ++i)
      for (int64_t c = 0; c < D; ++c) qp[i * D + c] = src[rp[i] * D + c] * factor;
    logits_into(qp, reinterpret_cast<const uint16_t*>(table.data_ptr<at::BFloat16>()), S, G, D,
                slots, block, logits.data_ptr<float>());
    terms_into(logits, bias, grid, page, page_mass, top, log_mass, value);
    const int64_t V = grid.size(2);
    for (int64_t i = 0; i < H; ++i) {
      head_mass.data_ptr<float>()[rp[i]] = log_mass.data_ptr<float>()[i];
      std::memcpy(head_value.data_ptr<float>() + rp[i] * V, value.data_ptr<float>() + i * V,
                  sizeof(float) * V);
    }
  }

  std::vector<torch::Tensor> parts() const {
    return {logits, page_mass, top, head_mass, head_value};
  }
};

// Work computed on one of torch's inter-op threads (`at::launch`) while the caller goes on:
// the decode thread starts a layer's terms before it attends over the rows and waits for them
// after, and the thread that computes them never takes the interpreter lock (no hand-offs
// with the decode loop). Its outputs, allocated before it starts, live until computed even if
// the caller drops this.
class Pending {
 public:
  explicit Pending(std::vector<std::vector<torch::Tensor>> parts) : parts_(std::move(parts)) {}

  void finish() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      done_ = true;
    }
    ready_.notify_all();
  }

  // -> each job's parts (waits without the interpreter lock)
  std::vector<std::vector<torch::Tensor>> wait() {
    {
      pybind11::gil_scoped_release no_gil;
      std::unique_lock<std::mutex> lock(mutex_);
      ready_.wait(lock, [this] { return done_; });
    }
    return parts_;
  }

 private:
  std::vector<std::vector<torch::Tensor>> parts_;
  std::mutex mutex_;
  std::condition_variable ready_;
  bool done_ = false;
};

// `jobs` (checked, outputs allocated) run one after another by `run` beside the caller.
template <typename Job, typename Run>
std::shared_ptr<Pending> launch(std::vector<Job> jobs, Run run) {
  std::vector<std::vector<torch::Tensor>> parts;
  parts.reserve(jobs.size());
  for (const auto& job : jobs) parts.push_back(job.parts());
  auto pending = std::make_shared<Pending>(std::move(parts));
  auto work = std::make_shared<std::vector<Job>>(std::move(jobs));
  at::launch([pending, work, run]() mutable {
    for (auto& job : *work) run(job);
    pending->finish();
  });
  return pending;
}

// Element i of each list is request i's (`LayerTermJob`'s inputs); checked here, computed
// beside the caller (`Pending::wait` for the parts).
std::shared_ptr<Pending> start_layers_value_term(
    std::vector<torch::Tensor> queries, std::vector<torch::Tensor> readers, double scale,
    std::vector<torch::Tensor> tables, std::vector<torch::Tensor> biases,
    std::vector<torch::Tensor> grids, std::vector<int64_t> slots, std::vector<int64_t> blocks,
    std::vector<int64_t> pages) {
  const size_t n = queries.size();
  TORCH_CHECK(readers.size() == n && tables.size() == n && biases.size() == n &&
              grids.size() == n && slots.size() == n && blocks.size() == n && pages.size() == n,
              "one of each input a request");
  std::vector<LayerTermJob> jobs;
  jobs.reserve(n);
  for (size_t i = 0; i < n; ++i)
    jobs.emplace_back(queries[i], readers[i], tables[i], biases[i], grids[i], slots[i],
                      blocks[i], pages[i]);
  const float factor = static_cast<float>(scale);
  return launch(std::move(jobs), [factor](LayerTermJob& job) { job.run(factor); });
}

// A term's log mass and value from page masses [S, G, pages] and top [S, G, 1] (a term with
// pages taken out) -> log_mass [S, G], value [S, G, D]
std::vector<torch::Tensor> term_of(torch::Tensor page_mass, torch::Tensor top,
                                   torch::Tensor grid) {
  TORCH_CHECK(page_mass.dim() == 3 && page_mass.scalar_type() == torch::kFloat32 &&
              page_mass.is_contiguous() && page_mass.size(1) <= kMaxGroup, "page_mass");
  const int64_t S = page_mass.size(0), G = page_mass.size(1), pages = page_mass.size(2);
  TORCH_CHECK(top.scalar_type() == torch::kFloat32 && top.is_contiguous() &&
              top.numel() == S * G, "top");
  TORCH_CHECK(grid.dim() == 3 && grid.scalar_type() == torch::kBFloat16 && grid.is_contiguous() &&
              grid.size(0) == S && grid.size(1) == pages, "grid");
  const int64_t D = grid.size(2);
  auto log_mass = torch::empty({S, G}, page_mass.options());
  auto value = torch::empty({S, G, D}, page_mass.options());
  pybind11::gil_scoped_release no_gil;
  const auto* gp = reinterpret_cast<const uint16_t*>(grid.data_ptr<at::BFloat16>());
  for (int64_t s = 0; s < S; ++s)
    segment_term(page_mass.data_ptr<float>() + s * G * pages, top.data_ptr<float>() + s * G, G,
                 pages, gp + s * pages * D, D, log_mass.data_ptr<float>() + s * G,
                 value.data_ptr<float>() + s * G * D);
  return {log_mass, value};
}

// Page log-sum-exps from logits already computed, one segment after another (no lock).
void page_lse_into(const float* lp, int64_t S, int64_t G, int64_t slots, const float* r,
                   const float* bias, int64_t block, int64_t page, float* op) {
  const float* rows[kMaxGroup];
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t n0 = 0; n0 < slots; n0 += block) {
      const int64_t width = std::min(block, slots - n0);
      for (int64_t g = 0; g < G; ++g) rows[g] = lp + (s * G + g) * slots + n0;
      reduce_pages(rows, G, r + s * G, bias + s * slots + n0, width, page,
                   op + s * (slots / page) + n0 / page);
    }
  }
}

// The same page log-sum-exps from logits already computed (`block_logits`), to the bit
// -> [S, slots / page] float32
torch::Tensor page_lse_of(torch::Tensor logits, torch::Tensor r, torch::Tensor bias,
                          int64_t block, int64_t page) {
  TORCH_CHECK(logits.dim() == 3 && logits.scalar_type() == torch::kFloat32 &&
              logits.is_contiguous() && logits.size(1) <= kMaxGroup, "logits");
  TORCH_CHECK(block >= 1 && block <= kMaxBlock, "block");
  const int64_t S = logits.size(0), G = logits.size(1), slots = logits.size(2);
  check_reduce(r, bias, S, G, slots, block, page);
  auto out = torch::empty({S, slots / page}, logits.options());
  pybind11::gil_scoped_release no_gil;
  page_lse_into(logits.data_ptr<float>(), S, G, slots, r.data_ptr<float>(),
                bias.data_ptr<float>(), block, page, out.data_ptr<float>());
  return out;
}

// One request's `page_lse_of` for one layer, its r gathered from the step's log-sum-exps:
// r[s, g] = lse[row, readers[s, g]]. Checked and allocated with the interpreter lock held;
// `run` computes without it. parts: the page log-sum-exps [S, slots / page]
struct PageLseJob {
  torch::Tensor logits, lse, readers, bias, r, out;
  int64_t row, block, page;

  PageLseJob(torch::Tensor logits_, torch::Tensor lse_, int64_t row_, torch::Tensor readers_,
             torch::Tensor bias_, int64_t block_, int64_t page_)
      : logits(logits_), lse(lse_), readers(readers_), bias(bias_), row(row_), block(block_),
        page(page_) {
    TORCH_CHECK(logits.dim() == 3 && logits.scalar_type() == torch::kFloat32 &&
                logits.is_contiguous() && logits.size(1) <= kMaxGroup, "logits");
    TORCH_CHECK(block >= 1 && block <= kMaxBlock, "block");
    const int64_t S = logits.size(0), G = logits.size(1), slots = logits.size(2);
    TORCH_CHECK(lse.dim() == 2 && lse.scalar_type() == torch::kFloat32 && lse.is_contiguous() &&
                row >= 0 && row < lse.size(0), "lse");
    TORCH_CHECK(readers.dim() == 2 && readers.scalar_type() == torch::kInt64 &&
                readers.is_contiguous() && readers.size(0) == S && readers.size(1) == G, "readers");
    const int64_t* rp = readers.data_ptr<int64_t>();
    for (int64_t i = 0; i < S * G; ++i)
      TORCH_CHECK(rp[i] >= 0 && rp[i] < lse.size(1), "readers: heads of the step");
    r = torch::empty({S, G}, logits.options());
    check_reduce(r, bias, S, G, slots, block, page);
    out = torch::empty({S, slots / page}, logits.options());
  }

  void run() {
    const int64_t S = logits.size(0), G = logits.size(1), slots = logits.size(2);
    const float* heads = lse.data_ptr<float>() + row * lse.size(1);
    const int64_t* rp = readers.data_ptr<int64_t>();
    float* rr = r.data_ptr<float>();
    for (int64_t i = 0; i < S * G; ++i) rr[i] = heads[rp[i]];
    page_lse_into(logits.data_ptr<float>(), S, G, slots, rr, bias.data_ptr<float>(), block,
                  page, out.data_ptr<float>());
  }

  std::vector<torch::Tensor> parts() const { return {out}; }
};

// Several requests' `page_lse_of` of one layer (element i of each list is request i's; `rows`:
// each request's row of the step's log-sum-exps `lse` [B, H_q]), computed beside the caller
// like `start_layers_value_term`: the planner reads them without scoring the layer itself.
std::shared_ptr<Pending> start_pages_lse_of(std::vector<torch::Tensor> logits, torch::Tensor lse,
                                            std::vector<int64_t> rows,
                                            std::vector<torch::Tensor> readers,
                                            std::vector<torch::Tensor> biases,
                                            std::vector<int64_t> blocks,
                                            std::vector<int64_t> pages) {
  const size_t n = logits.size();
  TORCH_CHECK(rows.size() == n && readers.size() == n && biases.size() == n &&
              blocks.size() == n && pages.size() == n, "one of each input a request");
  std::vector<PageLseJob> jobs;
  jobs.reserve(n);
  for (size_t i = 0; i < n; ++i)
    jobs.emplace_back(logits[i], lse, rows[i], readers[i], biases[i], blocks[i], pages[i]);
  return launch(std::move(jobs), [](PageLseJob& job) { job.run(); });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("block_logits", &block_logits);
  m.def("block_page_lse", &block_page_lse);
  m.def("page_lse_of", &page_lse_of);
  m.def("value_term_of", &value_term_of);
  m.def("block_value_term", &block_value_term);
  m.def("term_of", &term_of);
  m.def("start_layers_value_term", &start_layers_value_term);
  m.def("start_pages_lse_of", &start_pages_lse_of);
  pybind11::class_<Pending, std::shared_ptr<Pending>>(m, "Pending").def("wait", &Pending::wait);
}
"""

_LOCK = threading.Lock()
_STATE: dict[str, Any] = {}
# The build's name (a new version when the source changes, so an old build is never loaded).
KERNEL_VERSION = "v12"
# A folder of kernels built ahead (`prebuild`), loaded before a build is tried.
KERNELS_ENV = "KVRELAY_CODES_KERNELS"
_MANIFEST = "kernels.json"


@dataclass(frozen=True)
class CpuLevel:
    """A CPU level a kernel is built ahead for: its `-march` (None: the compiler's default)
    and the /proc/cpuinfo flags a CPU needs to run it."""

    name: str
    march: str | None
    needs: frozenset[str]


_V3 = frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"})
# The x86-64 psABI levels, best first (`abm` is how /proc/cpuinfo names lzcnt): v4 is AVX-512
# (the kernel's widest vectors), v3 AVX2 and FMA, and x86-64 runs on any of them.
X86_64_LEVELS = (
    CpuLevel("x86-64-v4", "x86-64-v4",
             _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}),
    CpuLevel("x86-64-v3", "x86-64-v3", _V3),
    CpuLevel("x86-64", "x86-64", frozenset()),
)
_BASELINE = (CpuLevel("baseline", None, frozenset()),)


def levels_for(machine: str) -> tuple[CpuLevel, ...]:
    """The levels kernels are built ahead for on `machine` (`platform.machine()`), best first."""
    return X86_64_LEVELS if machine in ("x86_64", "AMD64") else _BASELINE


def level_for(machine: str, flags: frozenset[str], built: Sequence[str]) -> CpuLevel | None:
    """The best of the `built` levels a CPU with `flags` runs, or None."""
    return next((level for level in levels_for(machine)
                 if level.name in built and level.needs <= flags), None)


def use_prebuilt(folder: Path | None) -> None:
    """Look for kernels built ahead in `folder` (default: the `KERNELS_ENV` variable); before
    the first scoring, as the decode worker's start-up does."""
    with _LOCK:
        _STATE["folder"] = folder


def _source_digest() -> str:
    return hashlib.sha256(_SOURCE.encode()).hexdigest()[:12]


def _module_name(suffix: str) -> str:
    return f"kvrelay_codes_kernel_{KERNEL_VERSION}_{suffix}"


def _prebuilt_name(level: CpuLevel) -> str:
    return _module_name(level.name.replace("-", "_"))


def _module() -> Any | None:
    """The kernel, or None where none is built ahead for this CPU and none can be built
    (logged once)."""
    with _LOCK:
        if "module" not in _STATE:
            found = _load_prebuilt()
            if found is None:
                module = _build()
                found = (module, "built for this CPU (-march=native)") if module else (None, "")
            _STATE["module"], _STATE["kind"] = found
        return _STATE["module"]


def _prebuilt_folder() -> Path | None:
    folder = _STATE.get("folder")
    if folder is None and os.environ.get(KERNELS_ENV):
        folder = Path(os.environ[KERNELS_ENV])
    return folder


def _load_prebuilt() -> tuple[Any, str] | None:
    """The best kernel built ahead (`prebuild`) this CPU runs, if it was built from this
    source for this torch; None (logged) otherwise."""
    folder = _prebuilt_folder()
    if folder is None:
        return None
    try:
        manifest = json.loads((folder / _MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        log.warning("no prebuilt codes kernels in %s (%s)", folder, exc)
        return None
    want = {"torch": torch.__version__, "source": _source_digest()}
    if {key: manifest.get(key) for key in want} != want:
        log.warning("prebuilt codes kernels in %s are for torch %s and source %s, not %s and %s;"
                    " not loaded", folder, manifest.get("torch"), manifest.get("source"),
                    want["torch"], want["source"])
        return None
    level = level_for(platform.machine(), _cpu_flags(), manifest.get("levels", ()))
    if level is None:
        log.warning("no prebuilt codes kernel in %s runs on this CPU", folder)
        return None
    name = _prebuilt_name(level)
    try:
        spec = importlib.util.spec_from_file_location(name, folder / f"{name}.so")
        if spec is None or spec.loader is None:
            raise ImportError(f"{folder / name}.so is not an extension module")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (ImportError, OSError) as exc:
        log.warning("prebuilt codes kernel %s not loaded (%s)", name, exc)
        return None
    return module, f"prebuilt {level.name}"


def _build() -> Any | None:
    try:
        return _compile(_module_name(_cpu_tag()), "native", None)
    except Exception as exc:  # noqa: BLE001 - no compiler or ninja: torch computes the same
        log.warning("codes kernel not built (%s: %s); scoring falls back to torch",
                    type(exc).__name__, exc)
        return None


def _compile(name: str, march: str | None, build_directory: str | None) -> Any:
    from torch.utils import cpp_extension

    # A ninja installed into this interpreter's environment is found even when its bin folder
    # is not on PATH (`.venv/bin/pytest`, `.venv/bin/kvrelay`).
    bin_dir = os.path.dirname(sys.executable)
    os.environ["PATH"] = os.pathsep.join([bin_dir, os.environ.get("PATH", "")])
    flags = ["-O3", *([f"-march={march}"] if march else []), "-fopenmp-simd", "-fno-math-errno"]
    return cpp_extension.load_inline(name, cpp_sources=_SOURCE,
                                     extra_cflags=flags, build_directory=build_directory,
                                     verbose=False)


def prebuild(folder: Path, levels: Sequence[str] | None = None) -> list[Path]:
    """Build the kernel ahead for each of this machine's CPU levels (`levels_for`; or those
    named) into `folder`, with a manifest of the torch and source they were built from
    (`use_prebuilt` loads only those). Each level is built in a child process: one this CPU
    lacks is compiled, never imported here.  # the .so files written"""
    known = levels_for(platform.machine())
    chosen = [level for level in known if levels is None or level.name in levels]
    unknown = set(levels or ()) - {level.name for level in known}
    if unknown:
        raise ValueError(f"levels {sorted(unknown)}: not one of {[lv.name for lv in known]}")
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for level in chosen:
        name = _prebuilt_name(level)
        with tempfile.TemporaryDirectory() as build:
            child = subprocess.run(
                [sys.executable, "-c", "import sys; from services.offload.codes_kernel import "
                 "_compile; _compile(sys.argv[1], sys.argv[2] or None, sys.argv[3])",
                 name, level.march or "", build],
                capture_output=True, text=True, check=False)
            built = Path(build) / f"{name}.so"
            if not built.exists():
                raise RuntimeError(f"{level.name}: the kernel did not build: "
                                   f"{child.stderr.strip()[-2000:]}")
            written.append(Path(shutil.copy2(built, folder / built.name)))
    manifest = {"torch": torch.__version__, "source": _source_digest(),
                "levels": [level.name for level in chosen]}
    (folder / _MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return written


def _cpu_flags_line() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            return next((line for line in info if line.startswith("flags")), "")
    except OSError:
        return ""


def _cpu_flags() -> frozenset[str]:
    return frozenset(_cpu_flags_line().partition(":")[2].split())


def _cpu_tag() -> str:
    """The build's name part that tells CPUs apart: `-march=native` code from one machine must
    never load on another (a shared home folder), so the instruction sets name the build."""
    flags = _cpu_flags_line()
    return hashlib.sha256(f"{platform.machine()} {flags}".encode()).hexdigest()[:12]


def describe() -> str:
    """Which kernel scores: "prebuilt <level>", "built for this CPU (-march=native)", or
    "unavailable (torch fallback)"."""
    return _STATE["kind"] if _module() is not None else "unavailable (torch fallback)"


def available() -> bool:
    """Whether scoring runs the built kernel (builds it on first call)."""
    return _module() is not None


def to_blocks(coordinates_first: torch.Tensor, block: int) -> torch.Tensor:
    """`[S, d_h, slots]` -> the blocked layout `[S, d_h * slots]`: slots in blocks of `block`
    (the last one shorter when `block` does not divide `slots`), each block `[d_h, width]`."""
    segments, dim, slots = coordinates_first.shape
    if block >= slots:
        return coordinates_first.reshape(segments, -1).contiguous()
    parts = [coordinates_first[:, :, n0:n0 + block].reshape(segments, -1)
             for n0 in range(0, slots, block)]
    out = torch.cat(parts, dim=1) if parts else coordinates_first.reshape(segments, 0)
    return out.contiguous()


def from_blocks(table: torch.Tensor, dim: int, block: int) -> torch.Tensor:
    """The inverse of `to_blocks`: `[S, d_h * slots]` -> `[S, d_h, slots]` (a copy)."""
    segments = table.shape[0]
    slots = table.shape[1] // dim if dim else 0
    if block >= slots:  # one block: already coordinates-first
        return table.view(segments, dim, slots)
    parts = []
    for n0 in range(0, slots, block):
        width = min(block, slots - n0)
        parts.append(table[:, n0 * dim:(n0 + width) * dim].view(segments, dim, width))
    return torch.cat(parts, dim=2) if parts else table.new_zeros(segments, dim, 0)


def block_logits(query: torch.Tensor, table: torch.Tensor, dim: int, block: int) -> torch.Tensor:
    """s q . k^ for every slot and reading head: grouped query `[S, G, d_h]` float32 over the
    blocked table `[S, d_h * slots]` bfloat16.  # [S, G, slots] float32"""
    slots = table.shape[1] // dim
    module = _kernel(query, block)
    if module is None:
        return _torch_logits(query, table, dim, block)
    return module.block_logits(query.float().contiguous(), table, slots, block)


def block_page_lse(query: torch.Tensor, retained_lse: torch.Tensor, table: torch.Tensor,
                   bias: torch.Tensor, dim: int, block: int, page: int) -> torch.Tensor:
    """Per page of `page` slots, the log-sum-exp over its slots of the best reading head's
    s q . k^ - r plus the slot's bias (`retained_lse` r `[S, G]`, bias `[S, slots]`, -inf for an
    unused slot).  # [S, slots / page] float32"""
    module = _kernel(query, block)
    if module is None:
        return page_lse_of(_torch_logits(query, table, dim, block), retained_lse, bias, block,
                           page)
    return module.block_page_lse(query.float().contiguous(), retained_lse.float().contiguous(),
                                 table, bias.float().contiguous(), table.shape[1] // dim, block,
                                 page)


def page_lse_of(logits: torch.Tensor, retained_lse: torch.Tensor, bias: torch.Tensor,
                block: int, page: int) -> torch.Tensor:
    """`block_page_lse` from `block_logits`' output `[S, G, slots]`, equal to it to the bit
    (the same reduction code).  # [S, slots / page] float32"""
    module = _kernel(logits, block)
    if module is None:
        best = (logits - retained_lse[:, :, None]).amax(dim=1).add_(bias)  # [S, slots]
        return best.view(best.shape[0], -1, page).logsumexp(dim=2)
    return module.page_lse_of(logits.float().contiguous(), retained_lse.float().contiguous(),
                              bias.float().contiguous(), block, page)


def block_value_term(query: torch.Tensor, table: torch.Tensor, bias: torch.Tensor,
                     grid: torch.Tensor, dim: int, block: int, page: int) -> tuple[torch.Tensor, ...]:
    """One layer's omitted-value term in one call: `block_logits`' logits `[S, G, slots]`
    (to the bit), then `value_term_of`'s page masses, top, log mass and value."""
    module = _kernel(query, block)
    if module is None:
        logits = _torch_logits(query, table, dim, block)
        return (logits, *value_term_of(logits, bias, grid, page))
    return tuple(module.block_value_term(query.float().contiguous(), table,
                                         bias.float().contiguous(), grid.contiguous(),
                                         table.shape[1] // dim, block, page))


def start_layers_value_term(queries: Sequence[torch.Tensor], readers: Sequence[torch.Tensor],
                            scale: float, tables: Sequence[torch.Tensor],
                            biases: Sequence[torch.Tensor], grids: Sequence[torch.Tensor],
                            dim: int, blocks: Sequence[int], pages: Sequence[int]) -> Any | None:
    """`bound.layer_value_term` of one layer for several requests (item i of each sequence is
    request i's), computed on one of torch's inter-op threads while the caller goes on, that
    thread never taking the interpreter lock: the kernel's pending terms, whose `wait()`
    answers a list of five a request (logits, page masses, top, and the log mass `[H_q]` and
    value `[H_q, d_h]` per query head), to the bit `block_value_term` of the grouped, scaled
    query. `readers`, `biases` (float32) and `grids` contiguous, as `bound.TermInputs` holds
    them (the kernel checks). None where the kernel does not run for every one of them (the
    caller does it request by request)."""
    fits = all(r.dim() == 2 and r.shape[1] <= MAX_GROUP and q.device.type == "cpu"
               and q.dtype == torch.float32 for q, r in zip(queries, readers, strict=True))
    module = _module() if fits and all(block <= MAX_BLOCK for block in blocks) else None
    if module is None:
        return None
    return module.start_layers_value_term(
        [q.contiguous() for q in queries], list(readers), scale, list(tables), list(biases),
        list(grids), [t.shape[1] // dim for t in tables], list(blocks), list(pages))


def start_pages_lse_of(logits: Sequence[torch.Tensor], lse: torch.Tensor, rows: Sequence[int],
                       readers: Sequence[torch.Tensor], biases: Sequence[torch.Tensor],
                       blocks: Sequence[int], pages: Sequence[int]) -> Any | None:
    """`page_lse_of` of one layer for several requests (item i of each sequence is request
    i's: its code logits `[S, G, slots]`, its row of the step's log-sum-exps `lse` `[B, H_q]`
    float32, whose heads `readers` `[S, G]` gathers into r, its slot bias `[S, slots]` float32),
    computed on one of torch's inter-op threads like `start_layers_value_term`: pending page
    log-sum-exps, whose `wait()` answers `[out]` a request, to the bit `page_lse_of`'s. None
    where the kernel does not run for every one of them."""
    fits = all(part.shape[1] <= MAX_GROUP and part.device.type == "cpu" for part in logits)
    module = _module() if fits and all(block <= MAX_BLOCK for block in blocks) else None
    if module is None:
        return None
    return module.start_pages_lse_of(list(logits), lse.float().contiguous(), list(rows),
                                     list(readers), list(biases), list(blocks), list(pages))


def value_term_of(logits: torch.Tensor, bias: torch.Tensor, grid: torch.Tensor,
                  page: int) -> tuple[torch.Tensor, ...]:
    """The omitted-value term's parts from code logits `[S, G, slots]`, slot bias `[S, slots]`
    (-inf: not live) and the pages' mean values `grid` `[S, slots / page, d_h]` bfloat16:
    page masses `[S, G, pages]` scaled by e^-top, top `[S, G, 1]` (each head's largest live
    logit, 0 when none is live), log mass `[S, G]` and value `[S, G, d_h]`, in float32."""
    module = _kernel(logits, page)
    if module is None:
        count, width, _ = logits.shape
        z = logits + bias[:, None, :]  # [S, G, slots]
        top = z.amax(dim=2, keepdim=True)
        top = torch.where(torch.isfinite(top), top, 0.0)
        page_mass = z.sub_(top).exp_().view(count, width, -1, page).sum(dim=3)
        return (page_mass, top, *term_of(page_mass, top, grid))
    return tuple(module.value_term_of(logits.float().contiguous(), bias.float().contiguous(),
                                      grid.contiguous(), page))


def term_of(page_mass: torch.Tensor, top: torch.Tensor,
            grid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Log mass `[S, G]` and the masses' average of the pages' mean values `[S, G, d_h]`
    (0 where no page has mass) from page masses `[S, G, pages]` scaled by e^-top, top
    `[S, G, 1]` and the value grid `[S, pages, d_h]`, in float32."""
    module = _kernel(page_mass, 1)
    if module is None:
        total = page_mass.sum(dim=2)  # [S, G]
        weights = (page_mass / total[..., None]).nan_to_num_(0.0)  # no live page: 0
        return total.log() + top[..., 0], torch.bmm(weights, grid.float())
    log_mass, value = module.term_of(page_mass.float().contiguous(), top.float().contiguous(),
                                     grid.contiguous())
    return log_mass, value


def row_logits(query: torch.Tensor, rows: torch.Tensor, block: int) -> torch.Tensor:
    """`[C, G, d_h] @ [C, d_h, n]` for rows gathered from a table of blocks of `block` slots,
    summed as that table is scored (float32 where the kernel scores it, else torch's bfloat16
    product), so a page scored from its rows equals the whole table's scoring.  # float32"""
    if _kernel(query, block) is not None:
        return torch.bmm(query.float(), rows.float())
    return torch.bmm(query.to(rows.dtype), rows).float()


def _kernel(query: torch.Tensor, block: int) -> Any | None:
    """The kernel where it takes these shapes (`query` `[S, G, ...]` on the CPU), else None."""
    fits = query.shape[1] <= MAX_GROUP and block <= MAX_BLOCK and query.device.type == "cpu"
    return _module() if fits else None


def _torch_logits(query: torch.Tensor, table: torch.Tensor, dim: int, block: int) -> torch.Tensor:
    """`block_logits` without the kernel: torch's bfloat16 product over the coordinates-first
    table (a view when the table is one block, `table_block`; else a copy)."""
    return torch.bmm(query.to(table.dtype), from_blocks(table, dim, block)).float()
