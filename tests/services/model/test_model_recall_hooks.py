"""The decode runtime's recall hooks: a captured step (queries and log-sum-exps against a
brute-force recomputation, logits unchanged) and undoing the step just committed."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from services.kvpolicy.packing import pack
from services.model import DecodeCache, InvalidModelInput, StepCapture, decode_step, kvcache
from services.model.config import parse_model_config
from services.model.layers import apply_rotary
from services.model.model import CausalLM

torch.set_num_threads(1)

PROMPT = 12


def tiny_llama(**overrides: object) -> CausalLM:
    config = parse_model_config(
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": 50,
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 8,
            "max_position_embeddings": 64,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "torch_dtype": "float32",
            **overrides,
        }
    )
    torch.manual_seed(0)
    return CausalLM(config).eval().requires_grad_(False)


def ragged_cache(model: CausalLM, expand: bool) -> DecodeCache:
    """One request whose owners keep different positions of a random prompt."""
    config = model.config
    owners = config.num_q_heads if expand else config.num_kv_heads
    generator = torch.Generator().manual_seed(1)
    k = torch.randn(2, config.num_kv_heads, PROMPT, config.head_dim, generator=generator)
    v = torch.randn(2, config.num_kv_heads, PROMPT, config.head_dim, generator=generator)
    selected = [
        [
            sorted({0, PROMPT - 1, *range(layer + owner, PROMPT, 2 + owner)})
            for owner in range(owners)
        ]
        for layer in range(2)
    ]
    owner_map = config.q_to_kv_head_map if expand else None
    cache = DecodeCache(config, torch.float32, row_capacity=4, owner_to_kv_head=owner_map)
    cache.admit_view("req", pack(k, v, selected, owner_map), frontier=PROMPT)
    return cache


@pytest.mark.parametrize("expand", [False, True])
def test_captured_queries_and_log_sum_exps_match_a_brute_force_recomputation(
    expand: bool,
) -> None:
    model = tiny_llama()
    plain = decode_step(model, ragged_cache(model, expand), [7])
    cache = ragged_cache(model, expand)
    capture = StepCapture()
    logits = decode_step(model, cache, [7], capture)
    assert torch.equal(logits, plain)  # capturing changes nothing the step computes
    query, lse = capture.query(0), capture.log_sum_exp(0)  # [L, H_q, d_h], [L, H_q]
    assert query.shape == (2, 4, 8) and lse.shape == (2, 4)
    layer0 = model.model.blocks()[0]
    x = layer0.input_layernorm(model.model.embed_tokens(torch.tensor([7])))  # [1, D]
    cos, sin = model.rope(torch.tensor([PROMPT]), x.dtype)
    q = apply_rotary(layer0.self_attn.q_proj(x).view(1, 4, 8), cos, sin)[0]  # [H_q, d_h]
    torch.testing.assert_close(query[0], q)
    for layer in range(2):
        for head, owner in enumerate(cache.head_to_owner):
            keys, _, positions = cache.rows("req", layer, owner)
            assert int(positions.max()) == PROMPT  # the step's own row is visible
            expected = torch.logsumexp(keys @ query[layer, head] * cache.scale, dim=0)
            torch.testing.assert_close(lse[layer, head], expected)


def test_head_to_owner_follows_the_cache_layout() -> None:
    model = tiny_llama()
    assert ragged_cache(model, expand=False).head_to_owner == (0, 0, 1, 1)
    assert ragged_cache(model, expand=True).head_to_owner == (0, 1, 2, 3)


def test_undo_step_takes_the_step_back_so_it_can_run_again() -> None:
    model = tiny_llama()
    cache = ragged_cache(model, expand=False)
    lengths = cache.lengths("req").clone()
    first = decode_step(model, cache, [5])
    cache.undo_step()
    assert torch.equal(cache.lengths("req"), lengths) and cache.frontier().tolist() == [PROMPT]
    with pytest.raises(InvalidModelInput, match="undo_step"):
        cache.undo_step()
    assert torch.equal(decode_step(model, cache, [5]), first)
    assert cache.frontier().tolist() == [PROMPT + 1]


def test_undo_step_refuses_once_rows_were_written_or_requests_changed() -> None:
    model = tiny_llama()
    cache = ragged_cache(model, expand=False)
    decode_step(model, cache, [5])
    row = torch.zeros(1, 8)
    cache.append_rows("req", 0, 0, row, row, torch.tensor([3]))
    with pytest.raises(InvalidModelInput, match="undo_step"):
        cache.undo_step()
    decode_step(model, cache, [5])
    cache.admit_dense("other", torch.zeros(2, 2, 3, 8), torch.zeros(2, 2, 3, 8))
    with pytest.raises(InvalidModelInput, match="undo_step"):
        cache.undo_step()


def test_rows_of_many_owners_in_one_write_equal_one_write_an_owner() -> None:
    """`append_owner_rows` (a recall's pages of several owners at once) leaves every owner
    holding what `append_rows` owner by owner leaves, and decodes the same step; counts that
    do not match the rows are refused naming the field, leaving the cache as it was."""
    model = tiny_llama()
    one, many = ragged_cache(model, expand=False), ragged_cache(model, expand=False)
    generator = torch.Generator().manual_seed(4)
    counts = torch.tensor([[2, 0], [1, 3]])
    keys, values = torch.randn(6, 8, generator=generator), torch.randn(6, 8, generator=generator)
    positions = torch.tensor([1, 3, 5, 2, 4, 6], dtype=torch.int32)
    start = 0
    for (layer, owner), n in zip([(0, 0), (0, 1), (1, 0), (1, 1)], counts.flatten().tolist(),
                                 strict=True):
        if n:
            one.append_rows("req", layer, owner, keys[start:start + n], values[start:start + n],
                            positions[start:start + n])
        start += n
    many.append_owner_rows("req", counts, keys, values, positions)
    for layer in range(2):
        for owner in range(2):
            for a, b in zip(one.rows("req", layer, owner), many.rows("req", layer, owner),
                            strict=True):
                assert torch.equal(a, b)
    assert torch.equal(decode_step(model, one, [5]), decode_step(model, many, [5]))
    held = many.lengths("req").clone()
    for bad in (torch.tensor([[2, 0], [1, 2]]), torch.tensor([[2, 0, 1, 3]]),
                torch.tensor([[7, -1], [0, 0]])):
        with pytest.raises(InvalidModelInput) as error:
            many.append_owner_rows("req", bad, keys, values, positions)
        assert error.value.field == "counts"
    assert torch.equal(many.lengths("req"), held)


def _prompt(model: CausalLM, expand: bool) -> tuple[torch.Tensor, torch.Tensor, list, tuple | None]:
    """`ragged_cache`'s prompt: keys, values `[L, H_kv, T, d_h]`, selection, owner map."""
    config = model.config
    owners = config.num_q_heads if expand else config.num_kv_heads
    generator = torch.Generator().manual_seed(1)
    k = torch.randn(2, config.num_kv_heads, PROMPT, config.head_dim, generator=generator)
    v = torch.randn(2, config.num_kv_heads, PROMPT, config.head_dim, generator=generator)
    selected = [[sorted({0, PROMPT - 1, *range(layer + owner, PROMPT, 2 + owner)})
                 for owner in range(owners)] for layer in range(2)]
    return k, v, selected, config.q_to_kv_head_map if expand else None


class ExactTerm:
    """The rows a ragged cache's owners omit, exactly: per layer and query head the
    log-sum-exp of their logits under the layer's query, and their softmax-weighted values
    (brute force, one head at a time). Records the queries it was asked with."""

    def __init__(self, cache: DecodeCache, k: torch.Tensor, v: torch.Tensor, selected: list,
                 owner_map: tuple | None) -> None:
        self.cache, self.k, self.v, self.selected, self.owner_map = cache, k, v, selected, owner_map
        self.asked: list[int] = []

    def __call__(self, layer: int, query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.asked.append(layer)
        heads = len(self.cache.head_to_owner)
        mass, value = torch.full((heads,), -torch.inf), torch.zeros(heads, self.k.shape[-1])
        for head, owner in enumerate(self.cache.head_to_owner):
            kv = owner if self.owner_map is None else self.owner_map[owner]
            omitted = [p for p in range(PROMPT) if p not in self.selected[layer][owner]]
            logits = self.k[layer, kv, omitted] @ query[head] * self.cache.scale  # [n]
            mass[head] = torch.logsumexp(logits, dim=0)
            value[head] = logits.softmax(dim=0) @ self.v[layer, kv, omitted]
        return mass, value


@pytest.mark.parametrize("expand", [False, True])
def test_an_exact_omitted_term_makes_the_ragged_step_the_full_cache_step(expand: bool) -> None:
    """The term merges with the paged rows through their log-sum-exp, layer by layer: given
    the omitted rows' own mass and value, the ragged cache's steps are the full cache's."""
    model = tiny_llama()
    k, v, selected, owner_map = _prompt(model, expand)
    full = DecodeCache(model.config, torch.float32, row_capacity=4)
    full.admit_dense("req", k, v)
    lossy = ragged_cache(model, expand)
    cache = ragged_cache(model, expand)
    term = ExactTerm(cache, k, v, selected, owner_map)
    cache.set_omitted_term("req", term)
    assert cache.has_omitted_term("req")
    for token in (7, 3, 11):
        want = decode_step(model, full, [token])
        torch.testing.assert_close(decode_step(model, cache, [token]), want, atol=2e-5, rtol=0)
        assert not torch.allclose(decode_step(model, lossy, [token]), want, atol=1e-3)
    assert term.asked == [0, 1] * 3
    # Cleared, the next step reads the rows only: the lossy cache's step, given the same rows.
    cache.clear_omitted_term("req")
    assert not cache.has_omitted_term("req")
    decode_step(model, cache, [5])
    assert term.asked == [0, 1] * 3


def test_a_term_of_no_mass_changes_nothing_and_leaves_the_other_requests_alone() -> None:
    model = tiny_llama()
    k, v, selected, owner_map = _prompt(model, False)

    def batch() -> DecodeCache:  # "req" ragged, "b" a short dense prompt
        cache = ragged_cache(model, expand=False)
        cache.admit_dense("b", k[:, :, :5], v[:, :, :5])
        return cache

    plain = decode_step(model, batch(), [7, 4])
    cache = batch()
    heads, d_h = model.config.num_q_heads, model.config.head_dim
    cache.set_omitted_term("req", lambda layer, q: (torch.full((heads,), -torch.inf),
                                                    torch.zeros(heads, d_h)))
    assert torch.equal(decode_step(model, cache, [7, 4]), plain)
    cache.undo_step()
    cache.set_omitted_term("req", lambda layer, q: None)  # nothing omitted
    assert torch.equal(decode_step(model, cache, [7, 4]), plain)
    cache.undo_step()
    cache.set_omitted_term("req", ExactTerm(cache, k, v, selected, owner_map))
    merged = decode_step(model, cache, [7, 4])
    assert torch.equal(merged[1], plain[1])  # "b" has no term
    assert not torch.allclose(merged[0], plain[0], atol=1e-4)
    cache.release("req")
    assert not cache.has_omitted_term("req") and not cache.has_omitted_term("b")
    with pytest.raises(InvalidModelInput, match="not admitted"):
        cache.clear_omitted_term("req")


@pytest.mark.parametrize(
    ("mass", "value"),
    [
        (torch.zeros(3), torch.zeros(4, 8)),
        (torch.zeros(4), torch.zeros(4, 7)),
        (torch.full((4,), torch.nan), torch.zeros(4, 8)),
        (torch.full((4,), torch.inf), torch.zeros(4, 8)),
        (torch.zeros(4), torch.full((4, 8), torch.inf)),
    ],
)
def test_a_malformed_term_is_refused_naming_the_request(mass: torch.Tensor,
                                                        value: torch.Tensor) -> None:
    model = tiny_llama()
    cache = ragged_cache(model, expand=False)
    cache.set_omitted_term("req", lambda layer, q: (mass, value))
    with pytest.raises(InvalidModelInput, match="'req': layer 0") as error:
        decode_step(model, cache, [7])
    assert error.value.field == "omitted_term"


class StartedTerm:
    """A term that starts beside the step (`OmittedTerm.start_layer_parts`), logging when its
    layer's terms start and when the cache waits for them."""

    def __init__(self, exact: ExactTerm, log: list[tuple[str, int, int]]) -> None:
        self.exact, self.log = exact, log

    def __call__(self, layer: int, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.exact(layer, q)

    @staticmethod
    def start_layer_parts(layer: int, calls: list[tuple[StartedTerm, torch.Tensor]]
                          ) -> Callable[[], list[tuple[torch.Tensor, torch.Tensor]]]:
        log = calls[0][0].log
        log.append(("start", layer, len(calls)))
        parts = [term.exact(layer, q) for term, q in calls]

        def wait() -> list[tuple[torch.Tensor, torch.Tensor]]:
            log.append(("wait", layer, len(calls)))
            return parts

        return wait


def test_terms_that_start_beside_the_step_start_before_the_rows_and_merge_as_asked_ones(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Terms sharing a `start_layer_parts` are started together once a layer, before the
    layer attends over its rows, and waited for after; the step equals the one whose terms
    were asked one by one, to the bit."""
    model = tiny_llama()
    k, v, selected, owner_map = _prompt(model, False)
    log: list[tuple[str, int, int]] = []
    attend = kvcache.paged_decode_attention

    def logged(*args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor | None]:
        log.append(("attend", -1, 0))
        return attend(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(kvcache, "paged_decode_attention", logged)

    def batch(started: bool) -> DecodeCache:
        cache = ragged_cache(model, expand=False)
        cache.admit_dense("b", k[:, :, :5], v[:, :, :5])
        exact = ExactTerm(cache, k, v, selected, owner_map)
        for request_id in ("req", "b"):
            cache.set_omitted_term(request_id, StartedTerm(exact, log) if started else
                                   exact)
        return cache

    asked = decode_step(model, batch(False), [7, 4])
    log.clear()
    started = decode_step(model, batch(True), [7, 4])
    assert torch.equal(started, asked)
    layers = model.config.num_layers
    assert log == [entry for layer in range(layers)
                   for entry in (("start", layer, 2), ("attend", -1, 0), ("wait", layer, 2))]


def test_a_term_that_raises_fails_the_step_and_the_cache_goes_on() -> None:
    model = tiny_llama()
    cache = ragged_cache(model, expand=False)

    def broken(layer: int, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise RuntimeError(f"term of layer {layer} broke")

    cache.set_omitted_term("req", broken)
    with pytest.raises(RuntimeError, match="term of layer 0 broke"):
        decode_step(model, cache, [7])
    cache.clear_omitted_term("req")
    assert torch.isfinite(decode_step(model, cache, [7])).all()
