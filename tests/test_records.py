"""The typed records between the actors and the ingress, and the one bounded record of early closes."""

import json

import pytest

from specdec.closed import RecentlyClosed
from actors.records import StepUpdate
from specdec.scheduler import HELD, TargetStats
from specdec.generation import FinishReason, Generation
from specdec.logprobs import TokenLogprob


def test_finish_reasons_are_the_wire_and_http_strings():
    assert [reason.value for reason in FinishReason] == ["stop", "length"]
    assert FinishReason.STOP == "stop" and json.dumps({"r": FinishReason.LENGTH}) == '{"r": "length"}'


def test_a_step_update_is_a_copy_of_what_the_loop_goes_on_changing():
    out = Generation([5, 6, 7], FinishReason.STOP, logprobs=[TokenLogprob(t, -1.0, []) for t in (5, 6, 7)])
    out.stats.steps, out.stats.accepted = 2, 1
    step = StepUpdate.of([6, 7], out, finished=False)
    out.stats.steps += 1
    assert (step.tokens, step.stats.steps, step.finished) == ([6, 7], 2, False)
    assert [e.token for e in step.logprobs] == [6, 7]
    last = StepUpdate.of([], out, finished=True)
    assert last.finish_reason is FinishReason.STOP and last.logprobs == []


def test_target_stats_name_what_the_target_holds():
    stats = TargetStats(open_requests=2, waiting=1, kv_tokens_reserved=300, largest_batch=4, idle_rows_closed=0)
    assert list(stats.held()) == list(HELD) and stats.held()["kv_tokens_reserved"] == 300


def test_recently_closed_is_bounded_and_refuses_once():
    closed = RecentlyClosed(kept=2)
    for rid in ("a", "b", "c"):
        closed.add(rid)
    assert "a" not in closed and "b" in closed  # the oldest is forgotten
    assert closed.take("b") and not closed.take("b") and not closed.take("zzz")


@pytest.mark.parametrize("speculation", [0, 1, 2])
def test_the_grpc_converter_reads_optional_fields_as_their_defaults(speculation):
    from cluster.grpc_api import request_from_proto
    from cluster.router import Speculation
    from protos import specdec_api_pb2 as api

    req = request_from_proto(api.GenerateRequest(prompt="p", max_new_tokens=3, speculation=speculation))
    assert (req.top_p, req.seed, req.logprobs, req.n) == (1.0, None, None, 1)
    assert req.speculation == list(Speculation)[speculation]
    assert request_from_proto(api.GenerateRequest(prompt="p", top_p=0.5, seed=0, logprobs=0)).sampling().seed == 0
