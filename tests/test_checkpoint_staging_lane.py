"""Asynchronous staging of accelerator tensors (issue 19.5), on the CPU: ``Stager`` with a
``DeferredLane`` (tests/_lanes.py) whose copies run only when the host or the current stream
waits for them, as on a side stream.

What these prove: ``stage`` returns with the copies only enqueued; the side stream waits for the
current stream first; the current stream waits for the copies before any later kernel (the
training loop's in-place update, run through ``on_current``), so the staged values are those at
the call; the sources stay referenced until ``wait``; the background's ``wait`` completes every
copy; buffers are reused.
"""

from __future__ import annotations

import torch
from _lanes import DeferredLane
from hypothesis import given, settings
from hypothesis import strategies as st

from fprep.checkpoint.asynchronous.staging import Stager
from fprep.devices import Lane


def _stager() -> tuple[Stager, DeferredLane]:
    lane = DeferredLane()
    return Stager(lane_for=lambda device: lane), lane


@settings(max_examples=30, deadline=None)
@given(
    shapes=st.lists(st.lists(st.integers(0, 6), max_size=3), min_size=1, max_size=5),
    seed=st.integers(0, 2**16),
    steps=st.integers(1, 3),
)
def test_later_in_place_writes_on_the_current_stream_do_not_reach_the_copies(
    shapes: list[list[int]], seed: int, steps: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    live = {f"k{i}": torch.randn(s, generator=g) for i, s in enumerate(shapes)}
    stager, lane = _stager()
    for _ in range(steps):  # several saves: buffers reused, each holding its own call's values
        at_call = {k: v.clone() for k, v in live.items()}
        staged = stager.stage(live)
        assert lane.queue, "stage returned with the copies enqueued, not done"
        for t in live.values():  # the next optimizer step, on the current stream
            lane.on_current(lambda t=t: t.mul_(-3.0).add_(1.0))
        stager.wait()  # the background thread, before hashing or writing
        assert lane.queue == []
        for key, copy in staged.items():
            assert torch.equal(copy, at_call[key]), key


def test_the_streams_are_ordered_around_the_copy() -> None:
    stager, lane = _stager()
    stager.stage({"a": torch.ones(3), "b": torch.zeros(2, 2)})
    # side waits for current, the copies (one foreach), the event, current waits for it
    assert lane.log == ["after_current", "copy", "mark", "current_waits"]
    assert lane.current_after == lane.marks
    stager.wait()
    assert lane.log[-1] == "wait"


def test_sources_stay_referenced_until_the_copies_are_done() -> None:
    stager, _ = _stager()
    source = torch.arange(5.0)
    pointer = source.data_ptr()
    staged = stager.stage({"x": source})
    del source  # the loop drops its last reference (an optimizer state replaced, say)
    # its storage is still held (the allocator cannot give its memory away before the copy)
    assert [t.data_ptr() for t in stager._sources] == [pointer]
    stager.wait()
    assert stager._sources == []
    assert torch.equal(staged["x"], torch.arange(5.0))


def test_a_stage_never_waited_for_is_waited_for_by_the_next() -> None:
    stager, lane = _stager()
    first = stager.stage({"x": torch.full((4,), 1.0)})
    pointer = first["x"].data_ptr()
    second = stager.stage({"x": torch.full((4,), 2.0)})  # a save that failed before its thread
    assert second["x"].data_ptr() == pointer  # the buffer reused...
    # ...after the first copy was done
    assert lane.log[:6] == [
        "after_current",
        "copy",
        "mark",
        "current_waits",
        "wait",
        "after_current",
    ]
    stager.wait()
    assert torch.equal(second["x"], torch.full((4,), 2.0))
    assert lane.host_buffers == 1


def test_host_tensors_use_no_lane_and_are_copied_at_once() -> None:
    stager = Stager()
    source = torch.arange(4.0)
    staged = stager.stage({"x": source})
    source.zero_()
    assert torch.equal(staged["x"], torch.arange(4.0))
    assert stager._lane_for(torch.device("cpu")) is None


def test_the_cpu_lane_is_synchronous() -> None:
    lane = Lane(torch.device("cpu"))
    assert lane.stream is None and not lane.pin
    dst, src = torch.empty(3, dtype=torch.float32), torch.arange(3, dtype=torch.bfloat16)
    lane.after_current()
    lane.copy([dst], [src])
    mark = lane.mark()
    assert mark is None and torch.equal(dst, torch.arange(3.0))
    lane.wait(mark)
    lane.current_waits(mark)
