"""The pure offload core: omitted rows that can come back (DESIGN.md section 6). No I/O.

One module per stage: `pages` (omitted positions grouped into pages, their key summaries
and their rows), `bound` (Quest-style page logit bounds, the omitted-mass bound and which
pages to recall), `store` (the bounded host-memory store, LRU + lease), `merge` (recalled
rows into visible sets, and the successor state of a recall), `errors`.
"""
