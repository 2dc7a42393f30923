"""Step input preparation: exact tensors for hand-checked batches, and agreement with the block
manager over random workloads (no model: the "model" is a deterministic function of the tokens)."""
import random
import sys

import pytest
import torch

from backend.engine.inputs import InputPreparer
from backend.engine.kv_cache import BlockManager
from backend.engine.request import Request
from backend.engine.sampling_params import SamplingParams
from backend.engine.scheduler import Scheduler


def make(rid, prompt, max_tokens=8):
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def setup(num_blocks=16, bs=4, budget=16, batch=8):
    bm = BlockManager(num_blocks, bs)
    sched = Scheduler(bm, max_batch_size=batch, max_num_tokens=budget)
    prep = InputPreparer(bs, max_blocks_per_seq=8, initial_rows=2)
    return bm, sched, prep


def test_hand_checked_mixed_prefill_and_decode_batch():
    bm, sched, prep = setup()
    a, b = make("a", [10, 11, 12, 13, 14, 15]), make("b", [20, 21, 22])
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    first = prep.prepare(out)
    # Step 1: two prefills. a -> blocks [0, 1], b -> block [2].
    assert first.input_ids.tolist() == [10, 11, 12, 13, 14, 15, 20, 21, 22]
    assert first.meta.slot_mapping.tolist() == [0, 1, 2, 3, 4, 5, 8, 9, 10]
    assert first.logits_indices.tolist() == [5, 8]
    sched.update(out, [100, 200])

    c = make("c", [30, 31, 32, 33, 34])
    sched.add(c)
    out = sched.schedule()
    step = prep.prepare(out)
    m = step.meta
    # Prefill c (blocks 3, 4) first, then decodes of a (position 6) and b (position 3).
    assert step.input_ids.tolist() == [30, 31, 32, 33, 34, 100, 200]
    assert m.positions.tolist() == [0, 1, 2, 3, 4, 6, 3]
    assert m.slot_mapping.tolist() == [12, 13, 14, 15, 16, 6, 11]
    assert m.block_tables.tolist() == [[3, 4], [0, 1], [2, 0]]
    assert m.seq_lens.tolist() == [5, 7, 4]
    assert m.query_start_loc.tolist() == [0, 5, 6, 7]
    assert m.context_lens.tolist() == [0, 6, 3]
    assert (m.num_prefills, m.num_prefill_tokens, m.num_decode_tokens) == (1, 5, 2)
    assert (m.max_query_len, m.max_seq_len, m.num_seqs, m.num_decodes) == (5, 7, 3, 2)
    assert m.tree_mask is None
    assert step.logits_indices.tolist() == [4, 5, 6]
    assert [s.request.request_id for s in step.sample_seqs] == ["c", "a", "b"]
    assert step.logits_counts is None
    for t in (step.input_ids, m.positions, m.slot_mapping, step.logits_indices):
        assert t.dtype == torch.int64
    for t in (m.block_tables, m.seq_lens, m.query_start_loc, m.context_lens):
        assert t.dtype == torch.int32


def test_chunk_that_does_not_sample_has_no_logits_row():
    bm, sched, prep = setup(budget=6)
    sched.add(make("a", [1, 2]))
    out = sched.schedule()
    sched.update(out, [prep.prepare(out).input_ids.tolist()[-1]])
    sched.add(make("long", range(40, 50)))        # 10 tokens: chunk of 5 after a's decode
    out = sched.schedule()
    step = prep.prepare(out)
    assert [(s.request.request_id, s.num_new_tokens, s.sample) for s in out.scheduled] == \
        [("long", 5, False), ("a", 1, True)]
    assert step.logits_indices.tolist() == [5]
    assert step.meta.positions.tolist() == [0, 1, 2, 3, 4, 2]
    assert step.meta.seq_lens.tolist() == [5, 3]


def test_speculative_rows_and_block_table_padding_after_rollback():
    bm, sched, prep = setup()
    r = make("s", [5, 6, 7], max_tokens=20)
    sched.add(r)
    out = sched.schedule()
    prep.prepare(out)
    sched.update(out, [8])                         # 4 tokens, 3 computed, block [0]
    r.spec_token_ids = [40, 41, 42, 43, 44, 45]
    out = sched.schedule()
    step = prep.prepare(out)
    m = step.meta
    assert step.input_ids.tolist() == [8, 40, 41, 42, 43, 44, 45]
    assert m.positions.tolist() == list(range(3, 10))
    assert m.slot_mapping.tolist() == [3, 4, 5, 6, 7, 8, 9]
    assert m.block_tables.tolist() == [[0, 1, 2]]
    assert step.logits_indices.tolist() == list(range(7)) and step.logits_counts == [7]
    assert (m.num_prefills, m.num_decode_tokens, m.max_query_len) == (0, 7, 7)
    sched.update(out, [[99]])                      # every draft rejected: blocks 1, 2 returned
    assert r.block_ids == [0] and r.num_slots == 4
    bm._free.reverse()                             # make the next block differ from the old one
    out = sched.schedule()
    step = prep.prepare(out)                       # position 4 needs a block again
    new_block = r.block_ids[1]
    assert new_block not in (0, 1) and step.meta.block_tables.tolist() == [[0, new_block]]
    assert prep._bt[prep._row_of["s"]].tolist() == [0, new_block, 0, 0, 0, 0, 0, 0]   # exact


def test_rows_are_released_and_reused_and_grow_past_the_initial_size():
    bm, sched, prep = setup(num_blocks=64, batch=8, budget=64)
    reqs = [make(f"r{i}", [3 + i, 4, 5], max_tokens=2) for i in range(5)]
    for r in reqs:
        sched.add(r)
    out = sched.schedule()
    step = prep.prepare(out)
    assert prep.num_rows_in_use == 5              # grew from 2 rows
    assert step.meta.block_tables.tolist() == [[i] for i in range(5)]
    sched.update(out, [1] * 5)
    out = sched.schedule()
    prep.prepare(out)
    sched.update(out, [1] * 5)                     # all finish (max_tokens=2)
    sched.add(make("new", [7, 7, 7, 7, 7]))
    out = sched.schedule()
    assert sorted(out.finished_request_ids) == sorted(r.request_id for r in reqs)
    step = prep.prepare(out)
    assert prep.num_rows_in_use == 1
    new_blocks = out.scheduled[0].request.block_ids
    assert step.meta.block_tables.tolist() == [new_blocks]


@pytest.mark.parametrize("change_log", [True, False])
def test_preempted_request_gets_a_fresh_row(change_log):
    bm = BlockManager(4, 4)
    sched = Scheduler(bm, max_batch_size=4, max_num_tokens=64)
    prep = InputPreparer(4, 4, block_manager=bm if change_log else None)
    a, b = make("a", range(10, 16), max_tokens=8), make("b", range(20, 26), max_tokens=8)
    sched.add(a)
    sched.add(b)
    preempted = False
    while sched.has_unfinished():
        out = sched.schedule()
        preempted |= bool(out.preempted)
        step = prep.prepare(out)
        expected = [bm.slot(s.request, p) for s in out.scheduled
                    for p in range(s.start_pos, s.start_pos + s.num_new_tokens)]
        assert step.meta.slot_mapping.tolist() == expected
        for i, s in enumerate(out.scheduled):
            row = step.meta.block_tables[i].tolist()
            assert row[:len(s.request.block_ids)] == s.request.block_ids
            assert not any(row[len(s.request.block_ids):])
        sched.update(out, [t % 50 + 3 for t in range(out.num_sampled)])
    assert preempted


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("change_log", [True, False])
def test_random_workload_matches_block_manager(seed, change_log):
    rng = random.Random(seed)
    bm = BlockManager(40, 4)                       # small: preemptions happen
    sched = Scheduler(bm, max_batch_size=6, max_num_tokens=24, max_seq_len=120)
    prep = InputPreparer(4, 30, initial_rows=1, block_manager=bm if change_log else None)
    for i in range(20):
        sched.add(make(f"r{i}", [rng.randrange(3, 40) for _ in range(rng.randrange(1, 50))],
                       max_tokens=rng.randrange(1, 15)))
    while sched.has_unfinished():
        out = sched.schedule()
        step = prep.prepare(out)
        m = step.meta
        ids, slots, pos = [], [], []
        for s in out.scheduled:
            r = s.request
            known = r.all_token_ids + r.spec_token_ids[:s.num_spec_tokens]   # drafts come last
            for p in range(s.start_pos, s.start_pos + s.num_new_tokens):
                ids.append(known[p])
                slots.append(bm.slot(r, p))
                pos.append(p)
        assert step.input_ids.tolist() == ids
        assert m.slot_mapping.tolist() == slots and m.positions.tolist() == pos
        assert m.seq_lens.tolist() == [s.start_pos + s.num_new_tokens for s in out.scheduled]
        assert m.num_tokens == len(ids) == out.num_tokens
        for i, s in enumerate(out.scheduled):
            row = m.block_tables[i].tolist()
            n = len(s.request.block_ids)
            assert row[:n] == s.request.block_ids and not any(row[n:])
        sampled = []
        for s in out.scheduled:
            if s.sample:                           # accept a random part of the drafts
                k = s.num_spec_tokens
                sampled.append([rng.randrange(3, 40) for _ in range(rng.randrange(k + 1) + 1)]
                               if k else rng.randrange(3, 40))
        sched.update(out, sampled)
        for r in sched.running:
            if not r.is_prefill and r.output_token_ids and rng.random() < 0.5:
                r.spec_token_ids = [rng.randrange(3, 40) for _ in range(rng.randrange(1, 5))]
    assert bm.num_free_blocks == 40 and sched.num_preemptions > 0 and sched.num_draft_tokens > 0


@pytest.mark.parametrize("seed", range(6))
def test_decode_batches_with_aborts_and_arrivals_match_block_manager(seed):
    # Long decode runs over block boundaries, where the preparer reuses the last step's rows while
    # the batch is unchanged, broken by aborts, finishes and new arrivals that change it.
    rng = random.Random(100 + seed)
    bm = BlockManager(200, 4)
    sched = Scheduler(bm, max_batch_size=8, max_num_tokens=64, max_seq_len=200)
    prep = InputPreparer(4, 50, initial_rows=2, block_manager=bm)
    n = 0

    def arrive():
        nonlocal n
        sched.add(make(f"r{n}", [rng.randrange(3, 40) for _ in range(rng.randrange(1, 20))],
                       max_tokens=rng.randrange(5, 60)))
        n += 1

    for _ in range(6):
        arrive()
    steps = reused = 0
    while sched.has_unfinished() and steps < 400:
        out = sched.schedule()
        rows_before = prep._prev_rows
        step = prep.prepare(out)
        reused += rows_before is not None and prep._prev_rows is rows_before
        m = step.meta
        assert step.input_ids.tolist() == [s.request.all_token_ids[p] for s in out.scheduled
                                           for p in range(s.start_pos, s.start_pos + s.num_new_tokens)]
        assert m.slot_mapping.tolist() == [bm.slot(s.request, p) for s in out.scheduled
                                           for p in range(s.start_pos, s.start_pos + s.num_new_tokens)]
        for i, s in enumerate(out.scheduled):
            row = m.block_tables[i].tolist()
            k = len(s.request.block_ids)
            assert row[:k] == s.request.block_ids and not any(row[k:])
        sched.update(out, [rng.randrange(3, 40) for _ in range(out.num_sampled)])
        if sched.running and rng.random() < 0.05:
            sched.abort(rng.choice(sched.running).request_id)
        if n < 40 and rng.random() < 0.08:
            arrive()
        steps += 1
    assert reused > 20 and n > 6                 # both paths ran, many times


def test_block_table_overflow_is_a_clear_error():
    bm = BlockManager(16, 4)
    sched = Scheduler(bm, max_batch_size=2, max_num_tokens=64)
    prep = InputPreparer(4, max_blocks_per_seq=2)
    sched.add(make("big", range(3, 15)))          # 12 tokens = 3 blocks
    with pytest.raises(ValueError, match=r"request 'big' holds 3 KV blocks; the block table has room for 2"):
        prep.prepare(sched.schedule())


def test_host_overhead_benchmark_runs_and_records_its_context(tmp_path):
    import json

    from harness.perf.step import host_overhead as bench_overhead

    out = tmp_path / "host.json"
    assert bench_overhead.main(["--num-seqs", "8", "--steps", "5", "--max-num-tokens", "64",
                                "--max-seq-len", "1024", "--runs", "2", "--output", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert {"machine", "date", "command", "commit", "config", "results"} <= set(doc)
    assert doc["machine"]["cpu"] and "stub" in doc["what"]
    assert set(doc["results"]) == set(bench_overhead.SCENARIOS)
    for name, r in doc["results"].items():
        assert r["steps"] == 5 and r["mean_batch_size"] == 8
        if name.startswith("executor"):   # the whole Executor.step, with the loop it names
            assert r["loop"] == ("overlapped" if name == "executor_overlap" else "synchronous")
            assert r["us_per_sequence_p50"] > 0
        else:
            assert set(r["breakdown_us_mean"]) == set(bench_overhead.PARTS)
        assert r["host_overhead_ms_per_step"]["p50"] > 0 and len(r["all_runs_host_p50_ms"]) == 2
        # Two runs: the reported one is the upper median.
        assert round(r["host_overhead_ms_per_step"]["p50"], 4) == max(r["all_runs_host_p50_ms"])
    with pytest.raises(SystemExit):
        bench_overhead.main(["--scenarios", "decode,bogus", "--output", "-"])


def test_host_overhead_ab_runs_a_base_revision_beside_this_tree(tmp_path, capsys):
    import json

    from harness.perf.step import overhead_ab

    out = tmp_path / "ab.json"
    assert overhead_ab.main(["--base", "HEAD", "--num-seqs", "8", "--steps", "6", "--max-num-tokens", "64",
                             "--max-seq-len", "1024", "--output", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert {"machine", "date", "command", "base", "new", "config", "results"} <= set(doc)
    assert len(doc["base"]) == 40 and doc["new"].startswith(doc["base"][:40])   # HEAD on both sides
    r = doc["results"]
    assert r["steps"] == 6 and r["ratio_new_over_base_p50"] > 0
    for side in ("base", "new"):
        assert r[side]["host_us_p50"] > 0 and set(r[side]["breakdown_us_p50"]) == {
            "schedule", "prepare_inputs", "model_stub", "sample", "update"}
    # The base side really ran the base revision's copy of the engine, not this tree's.
    assert sys.modules["kiln_base_engine.scheduler"].__file__ != sys.modules["backend.engine.scheduler"].__file__
    # The whole executor step, overlapped loop: each side's Executor is its own revision's.
    assert overhead_ab.main(["--base", "HEAD", "--scenario", "executor_overlap", "--num-seqs", "8", "--steps", "4",
                             "--max-num-tokens", "64", "--max-seq-len", "1024", "--output", str(out)]) == 0
    r = json.loads(out.read_text())["results"]
    assert r["loop"] == "overlapped" and r["steps"] == 4 and r["ratio_new_over_base_p50"] > 0
    assert r["base"]["host_us_p50"] > 0 and r["new"]["host_us_p50"] > 0
    assert sys.modules["kiln_base_engine.executor"].__file__ != sys.modules["backend.engine.executor"].__file__
    with pytest.raises(SystemExit, match="--base 'no-such-rev': not a revision"):
        overhead_ab.main(["--base", "no-such-rev", "--steps", "2"])
    capsys.readouterr()


def _collect(step):
    m = step.meta
    return {"ids": step.input_ids.tolist(), "logits": step.logits_indices.tolist(),
            **{k: getattr(m, k).tolist() for k in ("positions", "slot_mapping", "block_tables",
                                                    "seq_lens", "query_start_loc", "context_lens")},
            "dtypes": [str(t.dtype) for t in (step.input_ids, m.slot_mapping, m.block_tables,
                                              m.seq_lens)]}


def _mixed_workload(prep_a, prep_b):
    """Drive one scheduler and feed every output to two preparers; return both results."""
    rng = random.Random(5)
    bm = BlockManager(64, 4)
    sched = Scheduler(bm, max_batch_size=4, max_num_tokens=16)
    for i in range(6):
        sched.add(make(f"q{i}", [rng.randrange(3, 40) for _ in range(rng.randrange(1, 30))], 6))
    got_a, got_b = [], []
    while sched.has_unfinished():
        out = sched.schedule()
        got_a.append(_collect(prep_a.prepare(out)))
        got_b.append(_collect(prep_b.prepare(out)))
        sched.update(out, [rng.randrange(3, 40) for _ in range(out.num_sampled)])
    return got_a, got_b


def test_packed_single_copy_path_equals_the_direct_path():
    # The packing path (one buffer per dtype, views sliced out) is what a GPU uses; exercise its
    # logic on CPU by forcing it (no pinning here: that needs CUDA).
    direct = InputPreparer(4, 16)
    packed = InputPreparer(4, 16)
    packed._pack = True
    a, b = _mixed_workload(direct, packed)
    assert a == b and len(a) > 3


def test_block_table_change_log_is_off_unless_a_preparer_reads_it():
    bm = BlockManager(8, 4)
    r = make("a", [1, 2, 3, 4, 5])
    bm.allocate_for(r, 5)
    assert bm.block_table_changes is None         # nobody reads it: it must not grow
    InputPreparer(4, 8, block_manager=bm)
    bm.free(r)
    assert bm.block_table_changes == [r]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cuda_inputs_equal_cpu_inputs():
    cpu, gpu = _mixed_workload(InputPreparer(4, 16), InputPreparer(4, 16, device="cuda"))
    assert cpu == gpu
