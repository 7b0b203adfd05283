"""StepTimer's gap report (the host clocks only: no device needed)."""

from actors.engine.step_timer import _Step, host_phases, largest_gaps


def _step(host_start, host_end, gpu_start=None, wait_s=0.0, num_seqs=8):
    step = _Step(num_tokens=num_seqs, num_seqs=num_seqs, host_start=host_start,
                 host_end=host_end, wait_s=wait_s)
    if gpu_start is not None:
        step.host_marks["gpu_start"] = gpu_start
    return step


def test_largest_gaps_are_sorted_and_say_where_the_host_was():
    steps = [_step(0.000, 0.002, 0.001, wait_s=0.004),
             _step(0.010, 0.013, 0.012, wait_s=0.001, num_seqs=6),
             _step(0.300, 0.303, 0.302, num_seqs=5),
             _step(0.310, 0.312)]
    gaps = largest_gaps(steps, [(0, 1.5), (1, 280.0), (2, 0.0)], count=2)
    assert [g["step"] for g in gaps] == [1, 0]
    first = gaps[0]
    assert first["gap_ms"] == 280.0 and first["num_seqs"] == 5
    assert abs(first["waited_ms"] - 1.0) < 1e-9
    assert abs(first["host_between_ms"] - 287.0) < 1e-6  # 0.013 -> 0.300
    assert abs(first["prepare_ms"] - 2.0) < 1e-6         # 0.300 -> 0.302
    assert abs(gaps[1]["host_between_ms"] - 8.0) < 1e-6 and gaps[1]["num_seqs"] == 6
    # a step without a gpu_start mark reports no prepare time
    assert largest_gaps(steps, [(2, 3.0)])[0]["prepare_ms"] == 0.0


def test_host_phases_split_each_step_at_its_marks():
    steps = []
    for k in range(4):  # launch 0..3 ms after its start, then 2 ms of outputs + schedule
        t = k * 0.010
        step = _step(t, t + 0.003, t + 0.0005, wait_s=0.005)
        step.host_marks["sample"] = t + 0.0015
        steps.append(step)
    phases = host_phases(steps, [0, 1, 2])
    assert set(phases) == {"prepare", "forward", "sampler", "outside_launch"}
    assert abs(phases["prepare"] - 0.5) < 1e-6
    assert abs(phases["forward"] - 1.0) < 1e-6
    assert abs(phases["sampler"] - 1.5) < 1e-6
    assert abs(phases["outside_launch"] - 2.0) < 1e-6  # 7 ms between launches, 5 of them waiting
    # a step that sampled nothing has no sampler mark: only the time outside its launch counts
    del steps[1].host_marks["sample"]
    assert len(host_phases(steps, [1])) == 1


class _HostEvent:
    """A stand-in for ``torch.cuda.Event`` on the CPU: recording does nothing."""

    def __init__(self, enable_timing: bool = False) -> None:
        pass

    def record(self) -> None:
        pass


def test_attach_marks_every_step_in_order_and_detach_restores_the_executor(
        tiny_llama, monkeypatch):
    from actors.engine.step_timer import StepTimer
    from sampler import SamplingParams
    from tests.actors.helpers import make_engine, random_prompts

    monkeypatch.setattr("actors.engine.step_timer.torch.cuda.Event", _HostEvent)
    engine = make_engine(tiny_llama)
    executor = engine.executor
    try:
        timer = StepTimer().attach(engine)
        prompts = random_prompts([5, 9, 7], 512, seed=3)
        engine.generate([(i, p, SamplingParams(max_tokens=6, seed=i, ignore_eos=True))
                         for i, p in enumerate(prompts)])
        timer.detach()
        assert not {"launch_model", "forward", "sample"} & set(vars(executor))
        assert len(timer.steps) >= 6  # a prefill, then a decode step a token
        for step in timer.steps:
            marks = step.host_marks
            # the step's inputs prepared, then the forward, the sampler, the end
            assert list(marks) == ["gpu_start", "sample", "end"], list(marks)
            assert step.host_start <= marks["gpu_start"] <= marks["sample"] <= marks["end"]
            assert step.host_end >= marks["end"]
    finally:
        engine.close()
