"""Offline evaluation of KV visibility policies on a checkpoint.

- `generation`: in-process compressed generation through the prefill worker's stages
  (forward → score → allocate → select → pack) and the decode worker's cache;
- `policies`: the manifest grid the quality sweep runs (built from the manifest dataclasses);
- `needle_eval`, `report`: `kvrelay eval`, needle retrieval accuracy per policy, Markdown + PNG;
- `kvpress_agreement`: which prompt rows kvrelay's SnapKV keeps vs kvpress's `SnapKVPress`;
- `calibrate`, `profile`: `kvrelay calibrate`, HeadKV retrieval-head profiles beside a checkpoint;
- `quality`: the `kvrelay eval` command (presets, profile, sweep, report files);
- `needs`: optional packages (matplotlib, kvpress) imported on first use, with an error naming them.

Modules are imported one by one (nothing here), so the prefill worker can read profiles
(`profile`) without pulling in matplotlib or kvpress.
"""
