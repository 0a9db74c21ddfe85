"""The target's loop waits for speculating rows' next trees while plain rows are ready (TreeGather), where that
costs the ready rows less than the forward the late rows would miss; without it a row whose tree comes back a
hop after its verdict is verified only every other forward beside plain rows."""

import threading
import time

import pytest

from specdec.kvcache import CachedLM
from specdec.sampling import SamplingParams
from specdec.scheduler import GATHER_GRACE, TargetScheduler, TreeGather
from specdec.target import TargetWorker
from specdec.tree import TokenTree
from scheduling import Collect, wait_until_empty

GREEDY = SamplingParams()


def measured(return_s: float, forward_s: float) -> TreeGather:
    gather = TreeGather()
    gather.sent(["x"], 0.0)
    gather.arrived("x", return_s)
    gather.forward(forward_s)
    return gather


def test_nothing_is_waited_for_before_a_return_and_a_forward_are_measured():
    gather = TreeGather()
    gather.sent(["a"], 0.0)
    assert gather.until(ready=1, now=0.001) is None  # no return time measured
    gather.arrived("a", 0.02)
    assert gather.return_s == pytest.approx(0.02) and gather.until(ready=1, now=0.03) is None  # nothing out
    gather.sent(["a"], 0.03)
    assert gather.until(ready=1, now=0.031) is None  # no forward measured
    gather.forward(0.1)
    assert gather.until(ready=1, now=0.031) == pytest.approx(0.03 + GATHER_GRACE * 0.02)  # w* = 0.05: the grace first
    assert gather.until(ready=0, now=0.031) is None  # nothing ready: the loop waits for any row anyway


def test_the_loop_waits_only_for_trees_expected_before_the_wait_stops_paying():
    gather = measured(return_s=0.02, forward_s=0.1)
    gather.sent(["a"], 1.0)
    assert gather.until(ready=3, now=1.0) == pytest.approx(1.0 + 0.1 * 1 / 4)  # w* = F out / (ready + out) = 0.025
    assert gather.until(ready=5, now=1.0) is None  # w* = 0.0167: the tree is expected after it
    assert gather.until(ready=5, now=1.01) == pytest.approx(1.01 + 0.1 / 6)  # later, sooner expected: worth it
    gather.sent(["b", "c", "d"], 1.0)
    assert gather.until(ready=1, now=1.0) == pytest.approx(1.0 + GATHER_GRACE * 0.02)  # w* = 0.08: the grace bounds it
    cheap = measured(return_s=0.02, forward_s=0.01)
    cheap.sent(["a"], 1.0)
    assert cheap.until(ready=1, now=1.0) is None  # a forward dearer to miss than to wait for: never here


def test_rows_leaving_or_past_their_grace_are_not_waited_for():
    gather = measured(return_s=0.02, forward_s=0.1)
    gather.sent(["a", "b"], 1.0)
    assert gather.awaited(1.01) == 2 and gather.awaited(1.01, leaving={"a"}) == 1
    assert gather.until(ready=1, now=1.01, leaving={"a", "b"}) is None
    assert gather.awaited(1.0 + GATHER_GRACE * 0.02 + 1e-6) == 0  # taken as not coming
    assert gather.until(ready=1, now=1.05) is None
    gather.forget(["a"])
    assert set(gather.out) == {"b"}


def test_return_and_forward_times_are_smoothed():
    gather = measured(return_s=0.02, forward_s=0.1)
    gather.sent(["a"], 1.0)
    gather.arrived("a", 1.12)
    gather.forward(0.2)
    assert 0.02 < gather.return_s < 0.12 and 0.1 < gather.forward_s < 0.2
    gather.arrived("a", 5.0)  # not out: no sample
    assert gather.return_s < 0.12


def slowed(worker: TargetWorker, seconds: float) -> TargetWorker:
    """Each forward of the worker takes `seconds` more: a target whose forward is dear next to the hop."""
    verify = worker.verify

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return verify(*args, **kwargs)

    worker.verify = slow
    return worker


def spec_steps_beside_a_plain_row(target, gather: bool) -> tuple[int, int, list[int], list[int]]:
    """A plain row decodes while one speculative row sends a one-node tree 10 ms after each verdict, on a target
    whose forward takes 50 ms -> (forwards run while both rows were in, the speculative row's steps then, its
    tokens, the plain row's tokens)."""
    scheduler = TargetScheduler(slowed(TargetWorker(CachedLM(target)), 0.05), idle_timeout_s=None,
                                gather_trees=gather)
    try:
        spec_tokens, spec_steps = [], [0]
        first = scheduler.open("s", [5, 6, 7], GREEDY, 0, 64).first
        spec_tokens += first.tokens
        plain = Collect()
        scheduler.decode("p", [9, 8, 7, 6], GREEDY, 30, set(), plain)
        start = scheduler.forwards

        def replica():
            while not plain.done.is_set():
                time.sleep(0.01)  # the hop and the draft
                verdict = scheduler.verify({"s": TokenTree.root(spec_tokens[-1])})["s"]
                spec_tokens.extend(verdict.tokens)
                spec_steps[0] += 1

        thread = threading.Thread(target=replica)
        thread.start()
        plain_tokens = plain.wait()[0]
        forwards = scheduler.forwards - start
        thread.join()
        scheduler.close(["s"])
        wait_until_empty(scheduler)
        return forwards, spec_steps[0], spec_tokens, plain_tokens
    finally:
        scheduler.stop()


def test_a_speculating_row_beside_a_plain_one_is_verified_every_forward_and_outputs_are_unchanged(target):
    forwards, steps, spec, plain = spec_steps_beside_a_plain_row(target, gather=True)
    forwards_off, steps_off, spec_off, plain_off = spec_steps_beside_a_plain_row(target, gather=False)
    assert steps >= 0.8 * forwards, (steps, forwards)  # each forward, but the first ones (no return measured yet)
    assert steps_off <= 0.65 * forwards_off, (steps_off, forwards_off)  # every other forward
    assert plain == plain_off  # the plain row decodes the same either way
    n = min(len(spec), len(spec_off))
    assert n > 10 and spec[:n] == spec_off[:n]  # and the speculative row, as far as both got
