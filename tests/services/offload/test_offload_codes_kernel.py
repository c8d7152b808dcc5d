"""The codes table's scoring kernel against float64 brute force over the same estimates, and
the torch fallback against the kernel (services/offload/codes_kernel.py)."""

from __future__ import annotations

import json
import math
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from services.offload import codes_kernel

REPO = Path(__file__).resolve().parents[3]


def _case(seed: int, segments: int, group: int, dim: int, slots: int, page: int
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    table = torch.randn(segments, dim, slots, generator=gen).to(torch.bfloat16)
    query = torch.randn(segments, group, dim, generator=gen) * 0.5
    lse = torch.randn(segments, group, generator=gen)
    bias = torch.zeros(segments, slots)
    bias[:, -(page + 1):] = -math.inf  # a page wholly unused and one partly
    bias[0, :] = -math.inf  # a segment with no rows
    return table, query, lse, bias


def _brute(table: torch.Tensor, query: torch.Tensor, lse: torch.Tensor, bias: torch.Tensor,
           page: int) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.einsum("sgd,sdn->sgn", query.double(), table.double())
    best = (logits - lse.double()[:, :, None]).amax(dim=1) + bias.double()
    return logits, best.view(best.shape[0], -1, page).logsumexp(dim=2)


def test_the_kernel_is_built_wherever_a_compiler_is() -> None:
    if shutil.which("c++") is None and shutil.which("g++") is None:
        assert not codes_kernel.available()
        return
    assert codes_kernel.available()


# Blocks of every width the kernel's steps meet: whole steps of 128 (three heads) or 64 slots
# (four) and the slots after them, narrower than a step, one head group or two.
@pytest.mark.parametrize(("group", "slots", "page", "block", "dim"),
                         [(3, 96, 8, 32, 16), (3, 100, 4, 64, 16), (1, 40, 8, 16, 16),
                          (5, 24, 8, 8, 16), (8, 16, 4, 256, 16), (3, 200, 8, 256, 64),
                          (4, 200, 8, 256, 64), (7, 136, 8, 128, 64), (2, 44, 4, 44, 128)])
def test_scores_equal_brute_force_whatever_the_blocks(group: int, slots: int, page: int,
                                                      block: int, dim: int) -> None:
    table, query, lse, bias = _case(group * slots, 6, group, dim, slots, page)
    blocked = codes_kernel.to_blocks(table, block)
    assert blocked.shape == (6, dim * slots)
    assert torch.equal(codes_kernel.from_blocks(blocked, dim, block), table)
    want_logits, want_pages = _brute(table, query, lse, bias, page)
    logits = codes_kernel.block_logits(query, blocked, dim, block)
    assert torch.allclose(logits.double(), want_logits, atol=1e-4, rtol=0)  # float32 sums
    pages = codes_kernel.block_page_lse(query, lse, blocked, bias, dim, block, page)
    finite = torch.isfinite(want_pages)
    assert torch.equal(torch.isfinite(pages), finite)
    assert bool(finite.any()) and not bool(finite[0].any())
    assert torch.allclose(pages.double()[finite], want_pages[finite], atol=1e-4, rtol=0)
    # From logits already computed: the same values to the bit.
    assert torch.equal(codes_kernel.page_lse_of(logits, lse, bias, block, page), pages)


def test_the_torch_fallback_gives_what_the_kernel_gives(monkeypatch: pytest.MonkeyPatch) -> None:
    table, query, lse, bias = _case(3, 4, 3, 16, 48, 8)
    blocked = codes_kernel.to_blocks(table, 32)
    kernel = codes_kernel.block_page_lse(query, lse, blocked, bias, 16, 32, 8)
    kernel_logits = codes_kernel.block_logits(query, blocked, 16, 32)
    monkeypatch.setattr(codes_kernel, "_kernel", lambda query, block: None)
    # torch's product is bfloat16 (what scored the table before the kernel): its sums err
    # by up to a few hundredths here, the kernel's float32 ones by 1e-5.
    for layout in (blocked, codes_kernel.to_blocks(table, 48)):
        block = 32 if layout is blocked else 48
        fallback = codes_kernel.block_page_lse(query, lse, layout, bias, 16, block, 8)
        finite = torch.isfinite(kernel)
        assert torch.equal(torch.isfinite(fallback), finite)
        assert torch.allclose(fallback[finite], kernel[finite], atol=5e-2, rtol=0)
        assert torch.allclose(codes_kernel.block_logits(query, layout, 16, block), kernel_logits,
                              atol=5e-2, rtol=0)


def _brute_term(logits: torch.Tensor, bias: torch.Tensor, grid: torch.Tensor,
                page: int) -> tuple[torch.Tensor, ...]:
    """The omitted-value term in float64: page masses under each head's top live logit, the
    log mass and the masses' average of the pages' mean values."""
    z = logits.double() + bias.double()[:, None, :]
    top = z.amax(dim=2, keepdim=True)
    top = torch.where(torch.isfinite(top), top, 0.0)
    page_mass = (z - top).exp().view(*z.shape[:2], -1, page).sum(dim=3)
    total = page_mass.sum(dim=2)
    value = torch.bmm((page_mass / total[..., None]).nan_to_num(0.0), grid.double())
    return page_mass, top, total.log() + top[..., 0], value


# Head dims 64 and 128 take the kernel's register-held sums of page values (AVX-512), others
# its loop over coordinates.
@pytest.mark.parametrize(("group", "slots", "page", "block", "dim"),
                         [(3, 96, 8, 32, 16), (1, 40, 8, 16, 16), (8, 256, 4, 256, 16),
                          (3, 1200, 8, 128, 16), (3, 1200, 8, 128, 64), (5, 96, 8, 32, 128)])
def test_the_value_term_equals_brute_force_and_its_parts_agree_to_the_bit(
        group: int, slots: int, page: int, block: int, dim: int) -> None:
    """`block_value_term` (one pass: the code logits, then each head's page masses and the
    term) against float64, with unused slots, an unused page and a segment with no live row
    (no mass: log mass -inf, value 0); its logits are `block_logits`' and its term
    `value_term_of`'s and `term_of`'s, to the bit. Logits tens of nats apart keep every page's
    mass within 2e-6 of its own size, or 1e-12 of the top's (the kernel's exponential is a
    polynomial, not libm's, and 0 below e^-87)."""
    table, query, _, bias = _case(slots + group, 5, group, dim, slots, page)
    query = query * 4 * math.sqrt(16 / dim)  # logits tens of nats apart
    gen = torch.Generator().manual_seed(slots)
    grid = torch.randn(5, slots // page, dim, generator=gen).to(torch.bfloat16)
    blocked = codes_kernel.to_blocks(table, block)
    logits, page_mass, top, log_mass, value = codes_kernel.block_value_term(
        query, blocked, bias, grid, dim, block, page)
    assert torch.equal(logits, codes_kernel.block_logits(query, blocked, dim, block))
    want_mass, want_top, want_log, want_value = _brute_term(logits, bias, grid, page)
    assert float((logits.amax(dim=2) - logits.amin(dim=2)).max()) > 20
    assert torch.equal(top.double(), want_top)
    assert torch.allclose(page_mass.double(), want_mass, rtol=2e-6, atol=1e-12)
    assert torch.equal(torch.isfinite(log_mass), torch.isfinite(want_log))
    assert not bool(torch.isfinite(log_mass[0]).any()) and bool((value[0] == 0).all())
    live = torch.isfinite(want_log)
    assert torch.allclose(log_mass.double()[live], want_log[live], atol=1e-5, rtol=0)
    assert torch.allclose(value.double(), want_value, atol=1e-5, rtol=0)
    parts = codes_kernel.value_term_of(logits, bias, grid, page)
    assert all(torch.equal(a, b) for a, b in zip(parts, (page_mass, top, log_mass, value),
                                                 strict=True))
    taken = page_mass.clone()
    taken[:, :, ::3] = 0  # pages recalled: their mass out, the same top
    log_without, value_without = codes_kernel.term_of(taken, top, grid)
    _, _, want_log, want_value = _brute_term(
        logits, bias.view(5, -1, page).index_fill(1, torch.arange(0, slots // page, 3),
                                                  -math.inf).view(5, -1), grid, page)
    live = torch.isfinite(want_log)
    assert torch.allclose(log_without.double()[live], want_log[live], atol=1e-5, rtol=0)
    assert torch.allclose(value_without.double(), want_value, atol=1e-5, rtol=0)


def test_the_value_terms_torch_fallback_gives_what_the_kernel_gives(
        monkeypatch: pytest.MonkeyPatch) -> None:
    table, query, _, bias = _case(9, 4, 3, 16, 96, 8)
    grid = torch.randn(4, 12, 16, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    blocked = codes_kernel.to_blocks(table, 32)
    kernel = codes_kernel.block_value_term(query, blocked, bias, grid, 16, 32, 8)
    monkeypatch.setattr(codes_kernel, "_kernel", lambda query, block: None)
    fallback = codes_kernel.block_value_term(query, blocked, bias, grid, 16, 32, 8)
    # The fallback's logits are torch's bfloat16 product (a few hundredths off); from the
    # kernel's logits its term is the kernel's within float32 rounding.
    assert torch.allclose(fallback[0], kernel[0], atol=5e-2, rtol=0)
    parts = codes_kernel.value_term_of(kernel[0], bias, grid, 8)
    for got, want in zip(parts, kernel[1:], strict=True):
        finite = torch.isfinite(want)
        assert torch.equal(torch.isfinite(got), finite)
        assert torch.allclose(got[finite], want[finite], atol=1e-5, rtol=1e-5)


def test_without_the_kernel_a_table_is_one_coordinates_first_block(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(codes_kernel, "available", lambda: False)
    assert codes_kernel.table_block(8, 96) == 96
    assert codes_kernel.table_block(8, 0) == 8
    table = torch.randn(2, 4, 96).to(torch.bfloat16)
    blocked = codes_kernel.to_blocks(table, 96)
    assert torch.equal(blocked.view(2, 4, 96), table)
    view = codes_kernel.from_blocks(blocked, 4, 96)
    assert view.data_ptr() == blocked.data_ptr()  # a view, no copy a step
    monkeypatch.undo()
    if codes_kernel.available():
        assert codes_kernel.table_block(8, 96) == codes_kernel.BLOCK_SLOTS


def test_a_block_holds_whole_pages() -> None:
    for page in (1, 3, 8, 16, 100, 128, 300):
        block = codes_kernel.block_for(page)
        assert block % page == 0 and block >= page
    assert codes_kernel.block_for(8) == codes_kernel.BLOCK_SLOTS


def test_the_kernel_lets_other_python_threads_run_while_it_scores() -> None:
    """A recall plan scores on the planner thread beside the decode loop: the kernel must not
    hold the interpreter lock while it reads the table (where no compiler built it, torch's
    product scores, and must not either)."""
    table, query, lse, bias = _case(0, 64, 3, 64, 4096, 8)
    blocked = codes_kernel.to_blocks(table, 128)
    codes_kernel.block_page_lse(query, lse, blocked, bias, 64, 128, 8)  # warm
    ticks, stop = [0], threading.Event()

    def count() -> None:
        while not stop.is_set():
            ticks[0] += 1

    counter = threading.Thread(target=count)
    counter.start()
    try:
        time.sleep(0.01)
        calls, during = 0, 0
        deadline = time.perf_counter() + 2.0
        while calls < 20 and time.perf_counter() < deadline:  # bounded in count and time
            before = ticks[0]
            codes_kernel.block_page_lse(query, lse, blocked, bias, 64, 128, 8)
            during += ticks[0] - before
            calls += 1
    finally:
        stop.set()
        counter.join(timeout=5.0)
    assert during > 1000 * calls / 20, f"{during} ticks over {calls} kernel calls"


def test_the_best_prebuilt_level_a_cpu_runs_is_chosen() -> None:
    v3 = set(codes_kernel.X86_64_LEVELS[1].needs)
    v4 = v3 | set(codes_kernel.X86_64_LEVELS[0].needs)
    every = [level.name for level in codes_kernel.X86_64_LEVELS]
    assert codes_kernel.level_for("x86_64", frozenset(v4), every).name == "x86-64-v4"
    assert codes_kernel.level_for("x86_64", frozenset(v4 - {"avx512vl"}), every).name == "x86-64-v3"
    assert codes_kernel.level_for("x86_64", frozenset(v3 - {"fma"}), every).name == "x86-64"
    assert codes_kernel.level_for("x86_64", frozenset(v4), ["x86-64-v3"]).name == "x86-64-v3"
    assert codes_kernel.level_for("x86_64", frozenset(v3), ["x86-64-v4"]) is None
    assert codes_kernel.level_for("aarch64", frozenset(), ["baseline"]).name == "baseline"
    assert codes_kernel.level_for("aarch64", frozenset(), every) is None


# A 4-segment table of 200 slots, d_h 64 (blocks of 128 slots and of 72), and what the
# kernel in use scores from it (`_scored`).
_CASE = """
import torch
from services.offload import codes_kernel
gen = torch.Generator().manual_seed(7)
table = torch.randn(4, 64, 200, generator=gen).to(torch.bfloat16)
query = torch.randn(4, 3, 64, generator=gen) * 0.25
bias = torch.zeros(4, 200)
grid = torch.randn(4, 25, 64, generator=gen).to(torch.bfloat16)
block = codes_kernel.table_block(8, 200)
logits = codes_kernel.block_logits(query, codes_kernel.to_blocks(table, block), 64, block)
_, _, mass, value = codes_kernel.value_term_of(logits, bias, grid, 8)
"""


def _scored() -> dict[str, torch.Tensor]:
    scope: dict[str, object] = {}
    exec(_CASE, scope)  # noqa: S102 - the test's own case, run here and in a child process
    return {name: scope[name] for name in ("table", "query", "grid", "logits", "mass", "value")}  # type: ignore[misc]


def _score_in_a_process_without_a_compiler(kernels: Path, tmp_path: Path) -> tuple[str, dict[str, torch.Tensor]]:
    """Scores `_CASE` in a child process that can build nothing (no compiler on PATH, an
    empty extensions folder), with `kernels` as the prebuilt folder: which kernel it used and
    what it scored."""
    env = {**os.environ, "PATH": str(tmp_path / "no-bin"), "CXX": str(tmp_path / "no-bin" / "c++"),
           "TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions"),
           codes_kernel.KERNELS_ENV: str(kernels), "PYTHONPATH": str(REPO)}
    out = tmp_path / "scored.pt"
    script = _CASE + (f"torch.save(dict(logits=logits, mass=mass, value=value), {str(out)!r})\n"
                      "print(codes_kernel.describe())\n")
    child = subprocess.run([sys.executable, "-c", script], env=env, cwd=REPO,
                           capture_output=True, text=True, timeout=300, check=False)
    assert child.returncode == 0, child.stderr[-2000:]
    return child.stdout.strip(), torch.load(out)


def _errors(scored: dict[str, torch.Tensor]) -> list[float]:
    """Largest errors of the logits, log masses and values against float64."""
    case = _scored()
    want = torch.einsum("sgd,sdn->sgn", case["query"].double(), case["table"].double())
    weights = want.exp().view(4, 3, 25, 8).sum(dim=3)
    want_value = torch.einsum("sgp,spd->sgd", weights / weights.sum(dim=2, keepdim=True),
                              case["grid"].double())
    return [float((scored["logits"].double() - want).abs().max()),
            float((scored["mass"].double() - want.logsumexp(dim=2)).abs().max()),
            float((scored["value"].double() - want_value).abs().max())]


@pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which("c++") is None
                    or not codes_kernel.X86_64_LEVELS[1].needs <= codes_kernel._cpu_flags(),
                    reason="builds the x86-64-v3 kernel: an x86-64-v3 CPU and a compiler")
def test_a_kernel_built_ahead_scores_where_nothing_can_be_built(tmp_path: Path) -> None:
    kernels = tmp_path / "kernels"
    written = codes_kernel.prebuild(kernels, ["x86-64-v3"])
    assert [path.name for path in written] == [f"kvrelay_codes_kernel_{codes_kernel.KERNEL_VERSION}_x86_64_v3.so"]
    kind, scored = _score_in_a_process_without_a_compiler(kernels, tmp_path)
    assert kind == "prebuilt x86-64-v3"
    assert all(error < 1e-4 for error in _errors(scored))  # float32 sums, as built here
    if codes_kernel.describe().startswith("built") and "avx512f" in codes_kernel._cpu_flags():
        # The AVX-512 build holds its sums in registers, x86-64-v3's loops over coordinates
        # with its sums in memory: each slot summed in the same order, so to the bit the same.
        here = _scored()
        assert all(torch.equal(scored[name], here[name]) for name in ("logits", "mass", "value"))
    # Built from another source (or for another torch): never loaded; torch scores instead.
    manifest = json.loads((kernels / "kernels.json").read_text())
    (kernels / "kernels.json").write_text(json.dumps({**manifest, "source": "0" * 12}))
    kind, scored = _score_in_a_process_without_a_compiler(kernels, tmp_path)
    assert kind == "unavailable (torch fallback)"
    assert all(error < 0.1 for error in _errors(scored))  # torch's bfloat16 product


def test_unknown_levels_are_refused_before_anything_is_built(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="x86-64-v9"):
        codes_kernel.prebuild(tmp_path / "kernels", ["x86-64-v9"])
    assert not (tmp_path / "kernels").exists()


def _term_request(gen: torch.Generator, slots: int) -> tuple[torch.Tensor, ...]:
    """One request's layer: query `[9, 64]`, a permutation of its heads as readers, a table of
    `slots` slots, a bias with some pages not live, and a value grid."""
    owners, group, dim, page = 3, 3, 64, 8
    block = codes_kernel.table_block(page, slots)
    table = codes_kernel.to_blocks(torch.randn(owners, dim, slots, generator=gen).to(torch.bfloat16), block)
    query = torch.randn(owners * group, dim, generator=gen)
    readers = torch.randperm(owners * group, generator=gen).view(owners, group)
    bias = torch.zeros(owners, slots)
    bias[1, -3 * page:] = -math.inf
    grid = torch.randn(owners, slots // page, dim, generator=gen).to(torch.bfloat16)
    return query, readers, table, bias, grid


def test_a_layers_terms_started_beside_the_caller_equal_grouping_and_scaling_in_torch() -> None:
    """`start_layers_value_term` computes several requests' terms of a layer on torch's
    inter-op thread, gathering and scaling each owner's reading heads and writing the term per
    query head inside the kernel: each request's bits equal scaling and grouping in torch
    before `block_value_term` and ordering its output by head. Bad readers are refused when
    the terms start; a start nobody waits for still finishes without harm."""
    dim, page, scale = 64, 8, 64 ** -0.5
    gen = torch.Generator().manual_seed(11)
    requests = [_term_request(gen, slots) for slots in (200, 96)]
    blocks = [codes_kernel.table_block(page, table.shape[1] // dim) for _, _, table, _, _ in requests]

    def start(readers: list[torch.Tensor]) -> object:
        return codes_kernel.start_layers_value_term(
            [query for query, *_ in requests], readers, scale,
            [table for _, _, table, _, _ in requests], [bias for *_, bias, _ in requests],
            [grid for *_, grid in requests], dim, blocks, [page, page])

    pending = start([readers for _, readers, *_ in requests])
    if not codes_kernel.available():
        assert pending is None
        return
    assert pending is not None
    for (query, readers, table, bias, grid), block, parts in zip(
            requests, blocks, pending.wait(), strict=True):
        logits, page_mass, top, mass, value = parts
        want = codes_kernel.block_value_term((query * scale)[readers], table, bias, grid, dim,
                                             block, page)
        for got, expected in zip((logits, page_mass, top), want[:3], strict=True):
            assert torch.equal(got, expected)
        heads = readers.flatten()
        assert torch.equal(mass[heads], want[3].flatten())
        assert torch.equal(value[heads], want[4].flatten(0, 1))
    with pytest.raises(RuntimeError, match="permutation"):
        start([torch.zeros_like(readers) for _, readers, *_ in requests])
    start([readers for _, readers, *_ in requests])  # dropped: computed all the same
    assert len(start([readers for _, readers, *_ in requests]).wait()) == 2


def test_page_scores_started_from_a_steps_log_sum_exps_equal_page_lse_of() -> None:
    """`start_pages_lse_of` gathers each request's r from its row of the step's log-sum-exps
    and reduces its code logits to page log-sum-exps on torch's inter-op thread: the bits of
    `page_lse_of` with r gathered in torch. Readers naming no head of the step are refused."""
    gen = torch.Generator().manual_seed(5)
    owners, group, page = 3, 3, 8
    slots = (64, 40)
    logits = [torch.randn(owners, group, n, generator=gen) for n in slots]
    lse = torch.randn(2, owners * group, generator=gen)
    readers = [torch.randperm(owners * group, generator=gen).view(owners, group) for _ in slots]
    biases = [torch.zeros(owners, n) for n in slots]
    biases[0][1, -page:] = -math.inf
    blocks = [codes_kernel.table_block(page, n) for n in slots]
    pending = codes_kernel.start_pages_lse_of(logits, lse, [1, 0], readers, biases, blocks,
                                              [page, page])
    if not codes_kernel.available():
        assert pending is None
        return
    assert pending is not None
    for i, (row, parts) in enumerate(zip([1, 0], pending.wait(), strict=True)):
        want = codes_kernel.page_lse_of(logits[i], lse[row][readers[i]].contiguous(), biases[i],
                                        blocks[i], page)
        assert torch.equal(parts[0], want)
    with pytest.raises(RuntimeError, match="heads of the step"):
        codes_kernel.start_pages_lse_of(logits, lse, [1, 0], [r + 9 for r in readers], biases,
                                        blocks, [page, page])
