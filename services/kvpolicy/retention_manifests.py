"""Named decode-time retention policies, next to `manifest.default_manifests` (which keeps its
names and meanings: `window` and `sink-recent` select once at prefill, then decode appends).

Every policy here bounds each (layer, owner) to `budget_rows` rows at every decode step:

- `window-decode`: the newest rows (sliding window, keys at their original positions);
- `sink-recent-decode`: StreamingLLM's `sinks` first rows + the newest, original positions;
- `sink-recent-local`: the same with cache-local positions (keys rotated by their slot), the
  one that stays in distribution past the checkpoint's trained context;
- `h2o`: heavy hitters by accumulated attention + the newest half of the budget;
- `scissorhands`: drops a batch of the rows most often below 1/t attention (history 32 steps);
- `keyformer`: accumulated Gumbel-regularized scores, temperature 1 -> 2 over 4096 steps;
- `snapkv-h2o`: SnapKV at prefill (uniform), then H2O at decode: a composed policy.

The prefill worker sends keys post-RoPE at their original positions under every one of them
(the tensor contract is the served model's); cache-local rotation is the decode worker's.
"""

from __future__ import annotations

from dataclasses import replace

from services.kvpolicy.manifest import (
    EvidenceFamily,
    Fidelity,
    KVVisibilityPolicyManifest,
    Phase,
    ProtectedRule,
    RecoverabilityContract,
    RecoverabilityMode,
    RepresentationContract,
    RowKind,
    SelectionContract,
    SelectionMethod,
    SelectionUnit,
    TensorContract,
    UpdateCadence,
    cache_abi_sha256,
    default_manifests,
)
from services.kvpolicy.retention_contract import (
    KeyformerParams,
    PositionContract,
    RetentionContract,
    RetentionMethod,
    ScissorhandsParams,
)

SCISSORHANDS_HISTORY = 32
KEYFORMER_SCHEDULE_STEPS = 4096


def retention_contracts(budget_rows: int = 1024, sinks: int = 4,
                        publish_every_steps: int = 64) -> dict[str, RetentionContract]:
    """The retention contract of each named policy at a per-owner budget."""
    def contract(method: RetentionMethod, recent: int, sinks: int = 0,
                 scissorhands: ScissorhandsParams | None = None,
                 keyformer: KeyformerParams | None = None) -> RetentionContract:
        return RetentionContract(method, budget_rows, recent, sinks,
                                 publish_every_steps=publish_every_steps,
                                 scissorhands=scissorhands, keyformer=keyformer)

    sink_recent = contract(RetentionMethod.SINK_RECENT, budget_rows - sinks, sinks)
    h2o = contract(RetentionMethod.H2O, budget_rows // 2)
    quarter = max(1, budget_rows // 4)
    return {
        "window-decode": contract(RetentionMethod.WINDOW, budget_rows),
        "sink-recent-decode": sink_recent,
        "sink-recent-local": replace(sink_recent, positions=PositionContract.CACHE_LOCAL),
        "h2o": h2o,
        "scissorhands": contract(RetentionMethod.SCISSORHANDS, quarter, scissorhands=(
            ScissorhandsParams(SCISSORHANDS_HISTORY, max(1, budget_rows // 16)))),
        "keyformer": contract(RetentionMethod.KEYFORMER, quarter,
                              keyformer=KeyformerParams(KEYFORMER_SCHEDULE_STEPS)),
        "snapkv-h2o": h2o,
    }


def retention_manifests(
    tensor: TensorContract,
    *,
    checkpoint_generation: int = 0,
    logical_cache_abi_sha256: str | None = None,
    budget_rows: int = 1024,
    sinks: int = 4,
    budget_fraction: float = 0.25,
) -> dict[str, KVVisibilityPolicyManifest]:
    """The named decode-time retention policies (generation 1), omitting irrecoverably."""
    snapkv = default_manifests(tensor, checkpoint_generation=checkpoint_generation,
                               logical_cache_abi_sha256=logical_cache_abi_sha256,
                               budget_fraction=budget_fraction)["snapkv"]
    tensor = snapkv.tensor  # with the GQA map filled in, as default_manifests does
    abi = logical_cache_abi_sha256 or cache_abi_sha256(tensor)
    out = {}
    for name, retention in retention_contracts(budget_rows, sinks).items():
        selection = _prefill_selection(name, retention, snapkv.selection)
        out[name] = KVVisibilityPolicyManifest(
            name=name,
            policy_manifest_id=f"{name}@1",
            policy_generation=1,
            logical_cache_abi_sha256=abi,
            checkpoint_generation=checkpoint_generation,
            tensor=tensor,
            selection=selection,
            representation=RepresentationContract(RowKind.ORIGINAL_ROWS, Fidelity.LOSSY_SUBSET),
            recoverability=RecoverabilityContract(RecoverabilityMode.OMITTED_IRRECOVERABLE),
        )
    return out


def _prefill_selection(name: str, retention: RetentionContract,
                       snapkv: SelectionContract) -> SelectionContract:
    """What prefill selects before `retention` takes over: the same window for the positional
    methods, SnapKV for the composed policy, every row for the rest."""
    if name == "snapkv-h2o":
        return replace(snapkv, phase=Phase.BOTH, update_cadence=UpdateCadence.EVERY_STEP,
                       retention=retention)
    if retention.method is RetentionMethod.WINDOW:
        method, evidence = SelectionMethod.SLIDING_WINDOW, EvidenceFamily.POSITIONAL
    elif retention.method is RetentionMethod.SINK_RECENT:
        method, evidence = SelectionMethod.SINK_RECENT, EvidenceFamily.POSITIONAL
    else:
        method, evidence = SelectionMethod.FULL, EvidenceFamily.NONE
    positional = method is not SelectionMethod.FULL
    return SelectionContract(
        method, SelectionUnit.TOKEN, Phase.BOTH, evidence, UpdateCadence.EVERY_STEP,
        protected=ProtectedRule(sinks=retention.sinks),
        recent_window=retention.recent_window if positional else None, retention=retention)
