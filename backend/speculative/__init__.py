"""Speculative decoding with EAGLE-3 draft heads.

- ``tree``: token trees (chain / static / dynamic), masks, positions, accepted paths (no torch);
- ``accept``: exact-match and rejection-sampling acceptance;
- ``checkpoint``: EAGLE-3 checkpoints (public HF layout in, bundle ``draft/`` out);
- ``draft_model``: the draft head in plain torch, with its own small KV cache;
- ``grow``: growing the next tree with the draft;
- ``speculator``: the executor's ``Speculator`` (prepare / verify / propose), ``attach(executor)``;
- ``record``: the same seam recording the target's hidden states (the draft stage's training data);
- ``bench``: ``python -m harness.perf.throughput.eagle``.
Submodules are imported explicitly so the torch-free ones stay torch-free.
"""
