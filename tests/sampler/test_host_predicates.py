"""Host-side predicates: a step skips what its batch does not need, without a device sync.

Issue 2 asks for "host-side predicates that skip unused steps without a device sync". On a GPU
that is a claim about device-to-host reads; these tests make it checkable on CPU (see
:class:`HostReadMonitor` for what counts as a read of device values there), and check that the
skipped steps really do not run.
"""

from __future__ import annotations

import weakref

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import sampler.ops.gumbel as gumbel
import sampler.pipeline as pipeline
from sampler import Sampler, SamplingParams, sample_logits

from tests.sampler.helpers import assert_same_output, random_logits

# Tensor methods that hand a tensor's values to Python / numpy (a device sync on CUDA).
_READ_METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy",
                 "__array__", "cpu")
# Dispatched ops that read values on the host, or whose output shape depends on the values
# (CUDA must sync to size the result): a Python-level patch cannot see the C++ callers of
# ``.item()`` (e.g. a tensor passed where an int is expected), the dispatcher does.
_READ_OPS = {
    "aten._local_scalar_dense", "aten.item", "aten.is_nonzero", "aten.equal", "aten.allclose",
    "aten.nonzero", "aten.masked_select", "aten.unique_dim", "aten._unique", "aten._unique2",
    "aten.unique_consecutive", "aten.repeat_interleave", "aten.bincount",
}
_MISSING = object()


class HostReadMonitor(TorchDispatchMode):
    """Records every read of *device* tensor values on the host while it is active.

    On CPU all tensors live in host memory, so "a device sync" has to be defined. Here a
    tensor is **host data** when the sampler built it from host (numpy) data: the result of
    ``torch.from_numpy`` (the staging tensors of ``to_device`` and ``SamplerState._upload``,
    which on CUDA are pinned host buffers copied to the device without blocking) and what is
    computed from host data only. Every other tensor stands for device memory: the logits,
    the per-slot state tables (allocated with ``device=``), everything computed from them,
    tensors made by factory ops (``torch.zeros(..., device=...)``), the destination of a
    ``copy_`` from host data (an upload) and the result of ``.to(device)`` of host data (the
    upload of ``to_device``: on CPU it returns the staging tensor itself, which from then on
    stands for the device copy). A read is any of

    - the Tensor methods ``item``, ``tolist``, ``__bool__`` (``if t:``), ``__int__``,
      ``__float__``, ``__index__``, ``numpy``, ``__array__``, ``cpu``, and ``to`` with a
      device argument, called on a device tensor (``to(dtype)`` stays on the device; on CPU
      a ``.to(device)`` between two device tensors cannot be told from a copy to the host,
      so it counts too: stricter than CUDA);
    - a dispatched op that reads values on the host or sizes its output from the values
      (``_local_scalar_dense`` – what ``.item()`` and C++ int conversions become –,
      ``is_nonzero``, ``equal``, ``nonzero``, ``masked_select``, boolean-mask indexing,
      ``unique``, ``repeat_interleave``, ...) with a device tensor among its inputs;
    - ``copy_`` of a device tensor into a host tensor.

    Host-side work on host data (numpy mirrors, the plan, staging tensors) is allowed: it
    is exactly what the predicates are made of. Reads are recorded with the sampler source
    line that made them, not raised, so a product ``try`` cannot hide one.
    """

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []
        self._host: dict[int, weakref.ref] = {}
        self._saved: dict[str, object] = {}

    # host-data bookkeeping (ids + weakrefs: tensors must not be compared or hashed by value)
    def mark_host(self, tensor: torch.Tensor) -> torch.Tensor:
        self._host[id(tensor)] = weakref.ref(tensor)
        return tensor

    def unmark(self, tensor: torch.Tensor) -> None:
        self._host.pop(id(tensor), None)

    def is_host(self, tensor: torch.Tensor) -> bool:
        ref = self._host.get(id(tensor))
        return ref is not None and ref() is tensor

    def _record(self, what: str) -> None:
        import traceback

        frames = [f for f in traceback.extract_stack()[:-2]
                  if "/sampler/" in f.filename and "/tests/" not in f.filename]
        where = f"{frames[-1].filename.split('/sampler/')[-1]}:{frames[-1].lineno}" \
            if frames else "outside sampler/"
        self.reads.append(f"{what} at {where}")

    # Python-level reads
    def _patch(self) -> None:
        monitor = self
        for name in _READ_METHODS:
            original = getattr(torch.Tensor, name)
            self._saved[name] = torch.Tensor.__dict__.get(name, _MISSING)

            def read(tensor, *args, _name=name, _original=original, **kwargs):
                if not monitor.is_host(tensor):
                    monitor._record(f"Tensor.{_name}")
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, name, read)
        original_to = torch.Tensor.to
        self._saved["to"] = torch.Tensor.__dict__.get("to", _MISSING)

        def to(tensor, *args, **kwargs):
            parse_kwargs = {k: v for k, v in kwargs.items() if k != "copy"}
            device = torch._C._nn._parse_to(*args, **parse_kwargs)[0]
            if device is not None and not monitor.is_host(tensor):
                monitor._record(f"Tensor.to({device.type})")  # device -> host
            out = original_to(tensor, *args, **kwargs)
            if device is not None:
                monitor.unmark(out)  # host -> device: an upload (the sampler's device)
            return out

        torch.Tensor.to = to
        original_from_numpy = torch.from_numpy
        self._saved["from_numpy"] = original_from_numpy
        torch.from_numpy = lambda array: monitor.mark_host(original_from_numpy(array))

    def _unpatch(self) -> None:
        torch.from_numpy = self._saved.pop("from_numpy")
        for name, original in self._saved.items():
            if original is _MISSING:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, original)
        self._saved.clear()

    def __enter__(self):
        self._patch()
        try:
            return super().__enter__()
        except BaseException:
            self._unpatch()
            raise

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._unpatch()

    # dispatched reads
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = str(func.overloadpacket)
        flat = torch.utils._pytree.tree_leaves((args, kwargs))
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        all_host = bool(tensors) and all(self.is_host(t) for t in tensors)
        if not all_host:
            if name in _READ_OPS:
                self._record(name)
            elif name in ("aten.index", "aten.index_put", "aten.index_put_") and any(
                isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)
                for t in args[1]
            ):
                self._record(f"{name} with a boolean mask")
            elif name == "aten.copy_" and self.is_host(args[0]) and not self.is_host(args[1]):
                self._record("copy_ of a device tensor into a host tensor")
        else:  # host work on host data gives host data
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.mark_host(t)
        return out


def test_the_monitor_sees_every_kind_of_read():
    """The monitor can fail: each kind of read of a device tensor is recorded; host-side
    work on host data is not, and an upload turns host data into device data."""
    device_t = torch.tensor([1.5, 0.0, 2.0])  # made by a factory: device data
    patched = (*_READ_METHODS, "to")
    originals = {n: torch.Tensor.__dict__.get(n) for n in patched}, torch.from_numpy
    monitor = HostReadMonitor()
    with monitor:
        host_t = torch.from_numpy(np.array([1.5, 0.0, 2.0], dtype=np.float32))
        staged = host_t.clone()
        staged.tolist(), staged.numpy(), bool(staged[0]), host_t[host_t > 1], int(host_t[2])
        assert monitor.reads == []
        uploaded = staged.to("cpu")  # stands for the device copy from now on
        uploaded.tolist()
        assert len(monitor.reads) == 1
        reads = [
            lambda: device_t[0].item(), lambda: device_t.tolist(), lambda: bool(device_t[0]),
            lambda: int(device_t[0]), lambda: float(device_t[2]),
            lambda: [0, 1][device_t.long()[1]], lambda: device_t.numpy(),
            lambda: np.asarray(device_t), lambda: device_t.cpu(), lambda: device_t.to("cpu"),
            lambda: device_t[device_t > 1], lambda: torch.nonzero(device_t),
            lambda: torch.arange(device_t[2]), lambda: torch.equal(device_t, device_t),
            lambda: torch.unique(device_t), lambda: host_t.copy_(device_t),
            lambda: (device_t * 2).sum().item(),
        ]
        for i, read in enumerate(reads):
            before = len(monitor.reads)
            read()
            assert len(monitor.reads) > before, f"read {i} was not seen"
    assert ({n: torch.Tensor.__dict__.get(n) for n in patched}, torch.from_numpy) == originals


# Requests of the multi-step test: every pipeline step, every logprobs mode, greedy and random.
VOCAB = 333
EOS = [0, 7]
REQUESTS = {
    "greedy-penalties": dict(
        params=SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.4,
                              presence_penalty=-0.5, logprobs=3, seed=11),
        prompt=[1, 2, 3, 50]),
    "filters-masks": dict(
        params=SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.02, min_tokens=2,
                              stop_token_ids=[9], logit_bias={4: 2.0, 300: -1.0}, seed=12,
                              logprobs=0, logprobs_mode="temperature_logprobs"),
        prompt=[5], bad_words=[[6], [10, 11], [12, 13, 14]]),
    "allowed": dict(
        params=SamplingParams(temperature=1.1, allowed_token_ids=list(range(20, 120, 3)),
                              logprobs=-1, logprobs_mode="processed_logprobs", seed=13),
        prompt=[]),
    "plain-random": dict(params=SamplingParams(seed=14), prompt=[2]),
    "greedy": dict(params=SamplingParams(temperature=0.0, seed=15), prompt=[3]),
    "readmitted": dict(
        params=SamplingParams(temperature=0.8, top_k=5, frequency_penalty=0.3, logprobs=2,
                              logprobs_mode="raw_logits", seed=16),
        prompt=[8, 8], output=[30, -1, 31]),
    "processed-logits": dict(
        params=SamplingParams(temperature=0.5, top_p=0.5, logprobs=4,
                              logprobs_mode="processed_logits", seed=17),
        prompt=[1]),
}
# (dtype, slots of the batch, admissions before the step {slot: request}, removals)
SCRIPT = [
    (torch.float32, [0, 1, 2, 3], {0: "greedy-penalties", 1: "filters-masks", 2: "allowed",
                                   3: "plain-random"}, []),
    (torch.bfloat16, [3, 0, 1], {}, []),
    (torch.float32, [2, 4, 1, 5], {4: "greedy", 5: "readmitted"}, []),
    (torch.float32, [4, 0], {}, []),                     # all greedy
    (torch.bfloat16, [3], {}, []),                       # all random, nothing to mask
    (torch.float32, [0, 1, 3, 5], {0: "processed-logits"}, [2, 4]),  # slot 0 reused
    (torch.bfloat16, [5, 1, 0], {}, [3]),
]


def test_sampler_steps_read_no_device_values_on_the_host():
    """Sampler.sample over mixed batches (fp32 and bf16; admissions, re-admission, slot
    reuse, removals between steps) reads no device value on the host; the results equal
    ``sample_logits`` on the same inputs (so the monitored steps did the real work)."""
    s = Sampler(6, VOCAB, device="cpu", eos_token_ids=EOS, max_logprobs=VOCAB)
    monitor = HostReadMonitor()
    steps = []  # (logits copy, slots, requests of the rows, output)
    in_slot: dict[int, str] = {}
    with monitor:
        for step, (dtype, slots, admit, remove) in enumerate(SCRIPT):
            for slot in remove:
                s.remove_request(slot)
                in_slot.pop(slot)
            for slot, name in admit.items():
                req = REQUESTS[name]
                s.add_request(slot, req["params"], req["prompt"], seed=req["params"].seed,
                              output_token_ids=req.get("output", ()),
                              bad_words_token_ids=req.get("bad_words", ()))
                in_slot[slot] = name
            logits = random_logits(len(slots), VOCAB, 40 + step, ties=step % 2 == 1).to(dtype)
            steps.append((logits.clone(), list(slots), [in_slot[sl] for sl in slots],
                          s.sample(logits, slots)))
    assert monitor.reads == [], "device values read on the host:\n" + "\n".join(monitor.reads)

    # replay with the stateless entry point (outside the monitor)
    history: dict[int, list[int]] = {}
    owner: dict[int, str] = {}
    for step, ((logits, slots, names, out), (_, _, admit, _)) in enumerate(zip(steps, SCRIPT)):
        for slot, name in admit.items():
            history[slot] = list(REQUESTS[name].get("output", ()))
            owner[slot] = name
        want = sample_logits(
            logits, [REQUESTS[n]["params"] for n in names],
            prompt_token_ids=[REQUESTS[n]["prompt"] for n in names],
            output_token_ids=[history[sl] for sl in slots], eos_token_ids=EOS,
            bad_words_token_ids=[REQUESTS[n].get("bad_words", []) for n in names],
        )
        assert_same_output(out, want)
        for slot, token in zip(slots, out.token_ids.tolist()):
            history[slot].append(token)


def test_a_sync_inside_the_step_would_be_seen(monkeypatch):
    """The step test can fail: reads planted inside the pipeline and the state update
    (the kind a host-side predicate computed from device values would make) are recorded."""
    real_penalties = pipeline.apply_penalties

    def penalties_with_a_sync(logits, *args):
        if (logits > 0).any():  # Tensor.__bool__ of a device tensor
            real_penalties(logits, *args)

    monkeypatch.setattr(pipeline, "apply_penalties", penalties_with_a_sync)
    s = Sampler(2, VOCAB, device="cpu", eos_token_ids=EOS)
    s.add_request(1, REQUESTS["greedy-penalties"]["params"], [1, 2], seed=1)
    monitor = HostReadMonitor()
    with monitor:
        s.sample(random_logits(1, VOCAB, 0), [1])
        s.state.positions[1].item()
    # each read is seen twice: the Tensor method and the dispatched _local_scalar_dense
    assert [r.split(" at ")[0] for r in monitor.reads] == [
        "Tensor.__bool__", "aten._local_scalar_dense", "Tensor.item", "aten._local_scalar_dense"]
    assert monitor.reads[0].startswith("Tensor.__bool__ at pipeline.py:")  # the sampler line


# -- skipped steps are not run ---------------------------------------------------------------
OPS = ("apply_allowed_token_ids", "apply_bad_words", "apply_min_tokens", "apply_logit_bias",
       "apply_penalties", "apply_temperature", "apply_min_p", "apply_top_k_top_p",
       "compute_logprob_outputs")


@pytest.fixture
def op_calls(monkeypatch):
    """Counts the calls of every pipeline op (and of the Gumbel noise) by name."""
    calls: list[str] = []

    def spy(name, real):
        def wrapper(*args, **kwargs):
            calls.append(name)
            if name == "apply_top_k_top_p":
                calls.append(f"top_k={kwargs['do_top_k']},top_p={kwargs['do_top_p']}")
            return real(*args, **kwargs)
        return wrapper

    for name in OPS:
        monkeypatch.setattr(pipeline, name, spy(name, getattr(pipeline, name)))
    monkeypatch.setattr(gumbel, "compute_gumbel_noise",
                        spy("noise", gumbel.compute_gumbel_noise))
    return calls


# one request per case: the ops it (and only it) needs
SKIP_CASES = {
    "greedy": (dict(temperature=0.0), []),
    "random T=1": (dict(), ["noise"]),
    "allowed ids": (dict(temperature=0.0, allowed_token_ids=[3, 4]),
                    ["apply_allowed_token_ids"]),
    "bad words": (dict(temperature=0.0), ["apply_bad_words"]),
    "min_tokens": (dict(temperature=0.0, min_tokens=1), ["apply_min_tokens"]),
    "logit bias": (dict(temperature=0.0, logit_bias={5: 1.0}), ["apply_logit_bias"]),
    "repetition": (dict(temperature=0.0, repetition_penalty=1.2), ["apply_penalties"]),
    "frequency": (dict(temperature=0.0, frequency_penalty=0.5), ["apply_penalties"]),
    "temperature": (dict(temperature=0.5), ["apply_temperature", "noise"]),
    "min_p": (dict(min_p=0.1), ["apply_min_p", "noise"]),
    "top_k": (dict(top_k=3), ["apply_top_k_top_p", "top_k=True,top_p=False", "noise"]),
    "top_p": (dict(top_p=0.5), ["apply_top_k_top_p", "top_k=False,top_p=True", "noise"]),
    "logprobs": (dict(temperature=0.0, logprobs=0), ["compute_logprob_outputs"]),
}


@pytest.mark.parametrize("case", list(SKIP_CASES))
def test_a_batch_runs_only_the_steps_its_rows_need(case, op_calls):
    """Slot 1 holds a request that needs every step, but is not in the batch: the plan
    looks at the batch's rows only. Slot 2 is a plain greedy row in every batch."""
    kwargs, expected = SKIP_CASES[case]
    vocab = 50
    s = Sampler(3, vocab, device="cpu", eos_token_ids=[0], max_logprobs=5)
    everything = SamplingParams(temperature=0.7, top_k=4, top_p=0.9, min_p=0.05, min_tokens=3,
                                allowed_token_ids=list(range(1, 40)), logit_bias={2: 1.0},
                                repetition_penalty=1.1, frequency_penalty=0.2,
                                presence_penalty=0.1, logprobs=2)
    s.add_request(1, everything, [1, 2], seed=1, bad_words_token_ids=[[3], [4, 5]])
    s.add_request(2, SamplingParams(temperature=0.0), [1], seed=2)
    s.add_request(0, SamplingParams(**kwargs), [1, 2], seed=3,
                  bad_words_token_ids=[[6]] if case == "bad words" else ())
    s.sample(random_logits(2, vocab, 1), [2, 0])
    assert op_calls == expected
    op_calls.clear()
    s.sample(random_logits(1, vocab, 2), [2])  # the plain greedy row alone: nothing
    assert op_calls == []
    s.sample(random_logits(3, vocab, 3), [0, 1, 2])  # with slot 1: every step
    assert set(OPS) | {"noise"} <= set(op_calls)


def test_min_tokens_step_stops_once_every_row_reached_it(op_calls):
    """The min_tokens predicate follows the output position on the host mirror: the mask
    runs for the first two steps of a min_tokens=2 request, then no more (also after a
    re-admission with one output token, for one step)."""
    s = Sampler(2, 30, device="cpu", eos_token_ids=[0])
    s.add_request(1, SamplingParams(temperature=0.0, min_tokens=2), [1], seed=0)
    ran = []
    for step in range(4):
        op_calls.clear()
        s.sample(random_logits(1, 30, step), [1])
        ran.append("apply_min_tokens" in op_calls)
    assert ran == [True, True, False, False]
    s.add_request(1, SamplingParams(temperature=0.0, min_tokens=2), [1], seed=0,
                  output_token_ids=[5])
    ran = []
    for step in range(2):
        op_calls.clear()
        s.sample(random_logits(1, 30, step), [1])
        ran.append("apply_min_tokens" in op_calls)
    assert ran == [True, False]


def test_tables_are_not_allocated_for_a_batch_that_does_not_need_them():
    """No penalty counts, allowed mask or bad-words window exists (nor is updated after a
    step) until a request needs it."""
    s = Sampler(4, 100, device="cpu", eos_token_ids=[0])
    s.add_request(0, SamplingParams(temperature=0.7, top_k=5, logprobs=1), [1, 2], seed=1)
    s.add_request(1, SamplingParams(temperature=0.0, min_tokens=2, logit_bias={3: 1.0}), [], seed=2)
    for step in range(3):
        s.sample(random_logits(2, 100, step), [0, 1])
    assert s.state.output_counts is None and s.state.penalty_bits is None
    assert s.state.allowed_mask is None and s.state.recent_tokens is None
