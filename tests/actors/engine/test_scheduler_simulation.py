"""The scheduler driven the way the engine drives it (one step in flight, tokens known a step
late, finishes and preemptions in between), on random workloads with a tight KV pool: page
ref counts, slots and queues stay consistent and every request finishes."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from actors.engine.block_manager import BlockManager
from actors.engine.scheduler import Scheduler
from actors.engine.sequence import PENDING, Request, Sequence, SeqStatus
from sampler.params import SamplingParams


def check(sched: Scheduler, live: list[Sequence]) -> None:
    refs: Counter = Counter()
    for seq in live:
        refs.update(seq.block_table)
        if seq.status is SeqStatus.RUNNING:
            assert seq in sched.running and seq not in sched.waiting
            assert seq.num_computed_tokens <= seq.num_tokens
            assert len(seq.block_table) * sched.block_size >= seq.num_computed_tokens
        elif seq.status is SeqStatus.WAITING:
            assert seq.block_table == []
    bm = sched.bm
    for block in range(bm.num_blocks):
        assert bm.ref_counts[block] == refs[block], block
    bm.check_invariants()
    slots = [s.slot for s in sched.running] + [x for s in sched.running
                                               for x in s.reserved_slots]
    assert len(slots) == len(set(slots)) and -1 not in slots
    assert len(slots) + len(sched.free_slots) == sched.max_num_seqs


def simulate(seed: int, steady: bool = True) -> list[tuple]:
    """Drives a random workload to its end; returns each step's schedule (sequence ids,
    starts, lengths, samples, changed tables, copies, preemptions). ``steady=False`` turns
    the scheduler's check-free decodes off (every decode takes the checked path)."""
    rng = random.Random(seed)
    bs = rng.choice([2, 4])
    num_blocks = 48 // bs + rng.randint(1, 8)  # one max-length sequence plus a little
    sched = Scheduler(BlockManager(num_blocks, bs, enable_prefix_caching=seed % 2 == 0),
                      max_num_seqs=rng.randint(4, 8), max_num_batched_tokens=rng.randint(8, 32),
                      max_model_len=48)
    if not steady:
        sched._steady_bound = lambda seq: 0
    requests, live = [], []
    trace = []
    shared = [rng.randrange(50) for _ in range(12)]
    for i in range(rng.randint(10, 16)):
        n = rng.choice([1, 1, 2, 3])
        n = min(n, sched.max_num_seqs)
        prompt = (shared if rng.random() < 0.5 else []) + \
            [rng.randrange(50) for _ in range(rng.randint(1, 14))]
        req = Request(i, prompt, SamplingParams(n=n, max_tokens=rng.randint(1, 30)), seed=0,
                      arrival=i, num_unfinished=n)
        seq = Sequence(req, 0, list(prompt), fanout=n)
        req.sequences.append(seq)
        requests.append(req)
        live.append(seq)
        sched.add(seq)

    inflight: list[tuple[Sequence, int]] = []
    finished = 0
    for _ in range(2000):
        out = sched.schedule()
        trace.append(([(s.request.request_id, s.sample_index) for s in out.seqs], out.starts,
                      out.num_new, [(s.request.request_id, s.sample_index)
                                    for s in out.sample_seqs], out.sample_chunks,
                      [(s.request.request_id, s.sample_index) for s in out.table_seqs],
                      out.copies, [s.request.request_id for s in out.preempted]))
        live += [s for s in out.admitted if s not in live]
        launched = []
        for row, seq in enumerate(out.sample_seqs):
            seq.token_ids.append(PENDING)
            seq.num_pending += 1
            seq.pending_row = row
            launched.append((seq, len(seq.token_ids) - 1))
        for seq, pos in inflight:  # the previous step's tokens arrive
            if seq.is_finished:
                continue
            seq.token_ids[pos] = rng.randrange(50)
            seq.num_pending -= 1
            params = seq.request.params
            if seq.num_output_tokens - seq.num_pending >= params.max_tokens \
                    or pos + 1 >= sched.max_model_len or rng.random() < 0.02:
                del seq.token_ids[pos + 1:]
                seq.num_pending = 0
                sched.finish(seq)
                finished += 1
        inflight = launched
        check(sched, [s for s in live if not s.is_finished])
        if not sched.has_unfinished() and not inflight:
            break
    assert finished == sum(r.params.n for r in requests)
    assert sched.bm.num_free_blocks == sched.bm.num_blocks
    assert sched.stats.num_preemptions > 0  # the pool was tight enough to matter
    return trace


@pytest.mark.parametrize("seed", range(6))
def test_random_workload_with_async_steps(seed):
    simulate(seed)


@pytest.mark.parametrize("seed", range(4))
def test_check_free_decodes_schedule_what_the_checks_would(seed):
    assert simulate(seed) == simulate(seed, steady=False)
