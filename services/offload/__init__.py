"""Omitted rows that can come back (DESIGN.md section 6).

The pure core, one module per stage, no I/O: `pages` (omitted positions grouped into pages,
their key summaries and their rows), `bound` (Quest-style page logit bounds, the
omitted-mass bound and which pages to recall), `store` (the bounded host-memory store, LRU
+ lease), `merge` (recalled rows into visible sets, and the successor state of a recall),
`errors`. On top of it: `recall`, the decode-side engine (bound a step, fetch pages,
recompute the step, fall back), and `evaluate` (`kvrelay eval recall`).
"""
