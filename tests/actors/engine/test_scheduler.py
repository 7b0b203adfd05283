"""Scheduler (pure Python, no model): token budget, max_num_seqs, chunked prefill, decodes
first, preemption newest-first, prefix-cache hits on admission, and the n-sample fork."""

from __future__ import annotations

from actors.engine.block_manager import BlockManager
from actors.engine.scheduler import Scheduler
from actors.engine.sequence import PENDING, Request, Sequence, SeqStatus
from sampler.params import SamplingParams


def make(num_blocks=64, block_size=4, max_num_seqs=4, budget=16, max_model_len=128,
         caching=True):
    bm = BlockManager(num_blocks, block_size, caching)
    return Scheduler(bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                     max_model_len=max_model_len)


def add(sched, prompt, n=1, max_tokens=16, prompt_logprobs=None, rid=None):
    params = SamplingParams(n=n, max_tokens=max_tokens, prompt_logprobs=prompt_logprobs)
    req = Request(rid, list(prompt), params, seed=0, arrival=0, num_unfinished=n)
    seq = Sequence(req, 0, list(prompt), fanout=n)
    req.sequences.append(seq)
    sched.add(seq)
    return seq


def sample(out, token=7):
    """What the engine does once a step's tokens are known (no async here)."""
    for seq in out.sample_seqs:
        seq.token_ids.append(token)


def test_chunked_prefill_under_the_token_budget():
    s = make(budget=16)
    seq = add(s, range(50))
    sizes = []
    for _ in range(4):
        out = s.schedule()
        sizes.append([(c.start, c.num_tokens) for c in out.chunks])
        assert out.num_tokens <= 16
        if len(sizes) < 4:
            assert out.sample_seqs == []
    assert sizes == [[(0, 16)], [(16, 16)], [(32, 16)], [(48, 2)]]
    assert out.sample_seqs == [seq] and seq.num_computed_tokens == 50
    assert len(seq.block_table) == 13


def test_max_num_seqs_and_decodes_first():
    s = make(max_num_seqs=2, budget=12)
    a, b, c = add(s, range(3)), add(s, range(5)), add(s, range(40))
    out = s.schedule()
    assert [ch.seq for ch in out.chunks] == [a, b] and c.status is SeqStatus.WAITING
    sample(out)
    s.finish(a)  # a frees its slot: c is admitted behind b's decode
    out = s.schedule()
    assert [(ch.seq, ch.num_tokens) for ch in out.chunks] == [(b, 1), (c, 11)]
    sample(out)
    out = s.schedule()
    assert [(ch.seq, ch.num_tokens) for ch in out.chunks] == [(b, 1), (c, 11)]


def test_preemption_frees_the_newest_and_requeues_it_first():
    s = make(num_blocks=6, block_size=4, budget=64)
    old, new = add(s, range(8)), add(s, range(100, 108))  # 2 pages each
    out = s.schedule()
    sample(out)
    for _ in range(4):  # decodes at positions 8..11 take a third page each
        out = s.schedule()
        sample(out)
    assert s.bm.num_free_blocks == 0 and not out.preempted
    new_slot = new.slot
    # position 12 needs a 4th page each: none free -> the newest is preempted
    out = s.schedule()
    assert out.preempted == [new] and new.status is SeqStatus.WAITING
    assert s.waiting[0] is new and new.num_computed_tokens == 0 and new.block_table == []
    assert out.released_slots == [new_slot] and new.slot == -1
    assert [c.seq for c in out.chunks] == [old]
    s.bm.check_invariants()


def test_waiting_sequence_with_a_pending_token_waits():
    s = make()
    seq = add(s, range(5))
    seq.token_ids.append(PENDING)
    seq.num_pending = 1
    assert s.schedule().is_empty
    seq.token_ids[-1] = 9
    seq.num_pending = 0
    assert s.schedule().chunks[0].num_tokens == 6


def test_prefix_hits_on_admission_and_the_last_token_is_computed():
    s = make(block_size=4, budget=64)
    first = add(s, range(12))
    out = s.schedule()
    first_pages = list(first.block_table)
    sample(out)
    s.finish(first)
    again = add(s, range(12))  # all 3 blocks cached, but the last token must run
    out = s.schedule()
    assert out.chunks[0].start == 8 and out.chunks[0].num_tokens == 4
    longer = add(s, list(range(12)) + [99, 98])
    out = s.schedule()
    assert out.chunks[-1].seq is longer and out.chunks[-1].start == 12
    assert s.stats.num_cached_prompt_tokens == 8 + 12
    # "again" recomputed its last block into a new page; "longer" reuses all three
    assert again.block_table[:2] == first_pages[:2] and again.block_table[2] != first_pages[2]
    assert longer.block_table[:3] == first_pages


def test_prompt_logprob_requests_do_not_skip_unscored_positions():
    s = make(block_size=4, budget=64)
    first = add(s, range(12))
    sample(s.schedule())
    s.finish(first)
    scored = add(s, range(12), prompt_logprobs=0)
    out = s.schedule()
    assert out.chunks[0].start == 0 and out.chunks[0].num_tokens == 12
    assert scored.block_table  # pages allocated


def test_fork_shares_full_pages_and_copies_the_partial_one():
    s = make(block_size=4, budget=64, max_num_seqs=4)
    parent = add(s, range(10), n=3)  # 2 full pages + 2 tokens
    out = s.schedule()
    children = [seq for seq in out.sample_seqs if seq is not parent]
    assert len(out.sample_seqs) == 3 and out.sample_chunks == [0, 0, 0]
    assert [c.sample_index for c in children] == [1, 2]
    full = parent.block_table[:2]
    assert s.bm.ref_counts[full].tolist() == [3, 3]
    partial = [c.block_table[2] for c in children]
    assert sorted(out.copies) == sorted((parent.block_table[2], p) for p in partial)
    assert len({parent.slot, *[c.slot for c in children]}) == 3
    assert len(s.free_slots) == 1 and len(s.running) == 3
    # the forked samples are in the step (preemption must not pick them) without a chunk
    assert [c.seq for c in out.chunks] == [parent]
    assert out.scheduled_ids == {parent.seq_id, *[c.seq_id for c in children]}
    assert s._newest_unscheduled(out.scheduled_ids) is None
    sample(out)
    out = s.schedule()  # each sample decodes on its own
    assert sorted(c.seq.sample_index for c in out.chunks) == [0, 1, 2]
    assert out.scheduled_ids == {seq.seq_id for seq in [parent, *children]}
    for seq in [parent, *children]:
        s.finish(seq)
    assert s.bm.num_free_blocks == 64 and len(s.free_slots) == 4
    s.bm.check_invariants()


def test_max_tokens_reached_is_not_scheduled_again():
    s = make()
    seq = add(s, range(3), max_tokens=1)
    sample(s.schedule())
    assert s.is_generation_done(seq)
    assert s.schedule().is_empty


def test_finish_all_removes_running_and_waiting_sequences_in_one_pass():
    s = make(num_blocks=64, max_num_seqs=4, budget=64, caching=False)
    seqs = [add(s, range(10 * i, 10 * i + 5), rid=i) for i in range(4)]
    waiting = add(s, range(50, 55), rid=4)  # no slot left: it waits
    s.schedule()
    assert [q.status for q in seqs] == [SeqStatus.RUNNING] * 4
    assert waiting.status is SeqStatus.WAITING
    free_before = s.bm.num_free_blocks
    slots = [seqs[2].slot, seqs[0].slot]
    released = s.finish_all([seqs[2], waiting, seqs[0]])
    assert released == slots
    assert s.running == [seqs[1], seqs[3]]  # the others keep their order
    assert waiting not in s.waiting and not s.waiting
    assert all(q.status is SeqStatus.FINISHED and q.block_table == [] and q.slot == -1
               for q in (seqs[2], waiting, seqs[0]))
    assert s.bm.num_free_blocks == free_before + 4  # two pages each for the running two


def test_admission_room_counts_what_the_waiting_queue_can_fill():
    from concurrent.futures import Future

    s = make(max_num_seqs=4, budget=16, caching=False)
    assert s.admission_room() == (4, 16)
    add(s, range(5))
    add(s, range(3), n=2)
    assert s.admission_room() == (1, 8)  # 3 slots and 8 tokens claimed
    compiling = add(s, range(9))
    compiling.request.grammar = Future()  # its constraint still compiles: passed over
    assert s.admission_room() == (1, 8)
    compiling.request.grammar.set_result(None)
    assert s.admission_room() == (0, -1)
    s.schedule()  # admits all three (the last one's prompt in part): their 4 slots held
    assert not s.waiting and s.admission_room() == (0, 16)
    cached = make(max_num_seqs=4, budget=16, caching=True)
    add(cached, range(40))
    assert cached.admission_room() == (3, float("inf"))  # cached prompts: slots alone
