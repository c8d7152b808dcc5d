"""The pure KV visibility policy core: no I/O, no globals, CPU-testable in milliseconds.

One module per stage: `manifest` (the versioned contract), `snapkv` (score, select),
`allocation` (integer budgets), `static` (full / window / sink + recent), `packing`
(PackedKVView), `state` (KVPolicyState snapshots), `receipt` (digest binding view and
state), `ledger` (bytes), `quality` (dense vs selected attention), `errors`; decode-time
retention: `retention_contract` (its manifest fields), `retention` (the per-step decisions),
`retention_manifests` (the named policies).
"""
