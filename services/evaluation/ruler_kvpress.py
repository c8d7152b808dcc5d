"""The kvpress anchor of `kvrelay eval --suite ruler`: the same prompts through NVIDIA kvpress.

Weights. The checkpoint kvrelay loaded is handed to transformers tensor for tensor: a
transformers model is built from the checkpoint's config (an HF directory's `config.json`,
or for a `.gguf` file the config `kvrelay convert` writes, `gguf_convert.hf_config`) and
takes kvrelay's own state dict (`load_state_dict`, strict), so both runtimes hold the very
same dequantized fp32 values; nothing is read twice and no GGUF is re-converted.
`logit_gap` measures what is left: the largest |logit difference| on one prompt.

Generation. kvpress's own pipeline code runs each prompt
(`KVPressTextGenerationPipeline._forward`): the press compresses while the prefix (the
prompt without its cue) is prefilled, then the cue is decoded over the compressed cache
and the answer greedily until EOS / end of turn or the task's limit. The split is the same
as kvrelay's, so both engines answer from a compressed cache.

Presses: `SnapKVPress` (window and kernel set to kvrelay's SnapKV shape, so the two differ
only in arithmetic order and budget rounding, see `kvpress_agreement`),
`ExpectedAttentionPress` (kvpress defaults) and `AdaKVPress(SnapKVPress)` (alpha_safeguard
0.2, kvrelay's Ada-KV uniform share); `full` is transformers without a press. A kvrelay budget b
is kvpress's `compression_ratio` 1 - b. KVzip is left out: it replays the context 2-3 times per prefill.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from services.evaluation import ruler
from services.evaluation.kvpress_agreement import import_kvpress
from services.evaluation.policies import ADAKV_UNIFORM_SHARE, SnapKVShape
from services.evaluation.ruler_eval import Trial
from services.model import LoadedModel, PrefillOptions, prefill

FULL = "full"
PRESSES = ("snapkv", "expected_attention", "adakv_snapkv")


def press_factory(shape: SnapKVShape) -> dict[str, Callable[[float], Any]]:
    """Press name -> a press at `compression_ratio`."""
    kvpress = import_kvpress()

    def snapkv(ratio: float) -> Any:
        return kvpress.SnapKVPress(compression_ratio=ratio, window_size=shape.observation_window,
                                   kernel_size=shape.pooling_kernel)

    return {
        "snapkv": snapkv,
        "expected_attention": lambda ratio: kvpress.ExpectedAttentionPress(compression_ratio=ratio),
        "adakv_snapkv": lambda ratio: kvpress.AdaKVPress(snapkv(ratio), alpha_safeguard=ADAKV_UNIFORM_SHARE),
    }


def transformers_config(checkpoint: Path) -> dict[str, Any]:
    """The transformers `config.json` of an HF directory or of a GGUF file."""
    if checkpoint.is_file():
        from services.model.gguf import read_gguf
        from services.model.gguf_convert import hf_config

        return hf_config(read_gguf(checkpoint), "float32")
    return dict(json.loads((checkpoint / "config.json").read_text()))


def transformers_twin(loaded: LoadedModel, checkpoint: Path) -> Any:
    """A transformers causal LM holding `loaded`'s weights (fp32, SDPA attention: AdaKVPress
    masks keys through kvpress's SDPA patch)."""
    transformers = importlib.import_module("transformers")
    transformers.utils.logging.disable_progress_bar()
    raw = transformers_config(checkpoint)
    config = transformers.AutoConfig.for_model(**{**raw, "dtype": "float32"})
    with importlib.import_module("transformers.initialization").no_init_weights():  # replaced below
        model = transformers.AutoModelForCausalLM.from_config(
            config, attn_implementation="sdpa", dtype=torch.float32
        )
    model.load_state_dict(
        {name: t.to(torch.float32) for name, t in loaded.model.state_dict().items()
         if not name.startswith("rotary.")},
        strict=False,
    )
    missing = _missing_weights(model, loaded)
    if missing:
        raise RuntimeError(f"transformers model lacks kvrelay's weights for {missing[:3]}")
    return model.eval()


def _missing_weights(model: Any, loaded: LoadedModel) -> list[str]:
    ours = {n: t for n, t in loaded.model.state_dict().items() if not n.startswith("rotary.")}
    theirs = model.state_dict()
    return [n for n, t in theirs.items() if n not in ours or not torch.equal(ours[n].float(), t)]


def logit_gap(loaded: LoadedModel, model: Any, ids: list[int]) -> float:
    """max |kvrelay logits - transformers logits| at the last position of `ids`."""
    with torch.no_grad():
        ours = prefill(loaded.model, ids, PrefillOptions(obs_window=0)).logits  # [V]
        theirs = model(torch.tensor([ids])).logits[0, -1].float()  # [V]
    return float((ours - theirs).abs().max())


class KvpressRunner:
    """kvpress presses on suite prompts, on `loaded`'s weights in transformers."""

    def __init__(self, loaded: LoadedModel, checkpoint: Path, shape: SnapKVShape) -> None:
        kvpress = import_kvpress()
        transformers = importlib.import_module("transformers")
        self.model = transformers_twin(loaded, checkpoint)
        tokenizer = loaded.require_tokenizer()
        stop = sorted({*loaded.generation_config.eos_token_ids, *tokenizer.end_of_turn_ids()})
        self.model.generation_config.eos_token_id = stop
        hf_tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
        self.pipeline = kvpress.KVPressTextGenerationPipeline(
            model=self.model, tokenizer=hf_tokenizer
        )
        self.presses = press_factory(shape)
        self.kvpress = kvpress

    def run(
        self, prompt: ruler.RulerPrompt, index: int, press: str, budget: float | None
    ) -> Trial:
        """One prompt under one press (`full`: no press) at `budget`."""
        if (press == FULL) != (budget is None):
            raise ValueError(f"budget: {press} takes {'no' if press == FULL else 'a'} budget")
        chosen = None if budget is None else self.presses[press](1.0 - budget)
        inputs = {"context_ids": torch.tensor([prompt.prefix]),
                  "questions_ids": [torch.tensor([prompt.cue])]}
        with torch.no_grad():
            output = str(self.pipeline._forward(inputs, prompt.max_new_tokens, chosen)[0])
        spec = prompt.spec
        kept = 1.0 if budget is None else (
            self.kvpress.utils.compute_n_kept(len(prompt.prefix), 1.0 - budget) / len(prompt.prefix)
        )
        return Trial(
            engine="kvpress", policy=press, budget=budget, task=spec.task.value,
            haystack=spec.haystack.value, placement=spec.placement.value, length=spec.length,
            index=index, seed=spec.seed, depth=spec.depth,
            score=ruler.string_match_all(output, prompt.answers), output=output,
            answers=prompt.answers, retained_share=kept,
        )
