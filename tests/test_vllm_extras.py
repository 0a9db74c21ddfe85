"""vLLM's request extras in the core and the ingress's converters (issue 31): min_p and min_tokens change
the target's distribution alike for plain and speculative rows (greedy output identical, sampled output
exact: chi-square as tests/test_sampling.py), end ids end rows, and the detokenizer's text options. The
served checks (HTTP and gRPC, /health and the other routes, guidellm's requests) are in
tests/test_openai_api.py and tests/test_serving.py."""

import json
import math

import pytest
import torch

from cluster.detokenizer import Detokenizer, TextOptions
from cluster.openai_api import ChatBody, CompletionBody, HttpError, parse_body
from specdec import CachedLM, SamplingParams, SpecConfig, SpeculativeEngine
from specdec.errors import InvalidArgument
from specdec.processors import hold_back_ends
from specdec.sampling import warp
from test_sampling import M, N_TOKENS, P_MIN, PROMPT, drafter_for, exact_joint, fit, sample_engine

# --- the distribution ---------------------------------------------------------------------------------


def test_min_p_drops_tokens_under_its_share_of_the_likeliest():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.12, 0.08]]))
    p = warp(logits, SamplingParams(temperature=1.0, min_p=0.2))  # under 0.2 * 0.5 = 0.1: dropped
    assert p[0, 3] == 0 and torch.allclose(p[0, :3], torch.tensor([0.5, 0.3, 0.12]) / 0.92)
    assert torch.equal(warp(logits, SamplingParams(temperature=1.0, min_p=0.0)), warp(logits, SamplingParams(temperature=1.0)))
    for bad in (-0.1, 1.5, math.nan):
        with pytest.raises(InvalidArgument, match="min_p"):
            SamplingParams(temperature=1.0, min_p=bad)


def test_end_ids_are_held_back_at_the_nodes_before_min_tokens():
    logits = torch.zeros(3, 5)
    params = SamplingParams(min_tokens=3, end_ids=(1, 4, 99))  # 99: past this vocabulary, ignored
    held = hold_back_ends(logits, params, generated=1, depths=[0, 1, 2])  # next tokens: the 2nd, 3rd, 4th
    assert held[:2, [1, 4]].isinf().all() and not held[2].isinf().any() and not held[:, [0, 2, 3]].isinf().any()
    assert hold_back_ends(logits, params, generated=3, depths=[0, 1, 2]) is logits  # nothing held: no copy
    assert hold_back_ends(logits, SamplingParams(end_ids=(1,)), 0, [0, 1, 2]) is logits


def greedy(small_target, drafter, depth, width, params, eos, n=12):
    engine = SpeculativeEngine(CachedLM(small_target), drafter, SpecConfig(depth=depth), eos_token_ids=eos)
    return [g.token_ids for g in engine.generate([PROMPT, PROMPT[:3]], n, params=params)]


@pytest.mark.parametrize("kind", ["chain", "tree", "merged"])
def test_min_tokens_greedy_speculative_equals_plain(small_target, small_draft, kind):
    """End ids chosen to end the plain greedy runs by their 2nd token: with min_tokens 6 no row ends before
    its 6th token, and speculative rows give plain decoding's tokens exactly."""
    free = greedy(small_target, None, 0, 1, SamplingParams(), set())
    ends = (free[0][1], free[1][1])
    assert max(len(t) for t in greedy(small_target, None, 0, 1, SamplingParams(), set(ends))) <= 2
    params = SamplingParams(min_tokens=6, end_ids=ends)
    plain = greedy(small_target, None, 0, 1, params, set(ends))
    drafter, depth, width = drafter_for(kind, small_draft)
    assert greedy(small_target, drafter, depth, width, params, set(ends)) == plain
    assert all(len(t) >= 6 and not set(t[:6]) & set(ends) for t in plain), plain


@pytest.fixture(scope="module")
def held_params(small_target):
    """min_p and min_tokens 2 over the target's two likeliest first tokens."""
    with torch.inference_mode():
        top = small_target(torch.tensor([PROMPT])).logits[0, -1].topk(2).indices.tolist()
    return SamplingParams(temperature=1.0, min_p=0.05, min_tokens=2, end_ids=tuple(top), seed=4321)


@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_sampling_with_min_p_and_min_tokens_matches_the_held_target(small_target, small_draft, held_params, kind):
    exact = exact_joint(small_target, PROMPT, N_TOKENS, held_params)
    drafter, depth, width = drafter_for(kind, small_draft)
    counts, outs = sample_engine(small_target, drafter, depth, width, held_params)
    joint, margins, tv = fit(counts, exact)
    print(f"{kind} held: joint p={joint:.3g} marginal p={[f'{x:.3g}' for x in margins]} TV={tv:.3f}")
    assert joint > P_MIN and min(margins) > P_MIN, (joint, margins, tv)
    assert not any(set(k[:2]) & set(held_params.end_ids) for k in counts)
    assert sum(o.stats.accepted for o in outs) > 0 and len(outs) == M


# --- the text ------------------------------------------------------------------------------------------


class CharTokenizer:
    """One character per token; id 0 is the special end token "<e>"."""

    all_special_ids = [0]

    def decode(self, ids, skip_special_tokens=True):
        return "".join("" if i == 0 and skip_special_tokens else "<e>" if i == 0 else chr(i) for i in ids)

    def convert_ids_to_tokens(self, token):
        return chr(token) if token else "<e>"


def text_of(ids, stop=(), **options) -> tuple[str, bool]:
    d = Detokenizer(CharTokenizer(), stop, TextOptions(**options))
    out = ""
    for i, token in enumerate(ids):
        kept, new = d.add([token], final=i == len(ids) - 1)
        out += new
        if d.stopped:
            break
    return out, d.stopped


def test_text_options_as_vllm():
    ids = [ord(c) for c in "ab\nc\nd"] + [0]
    assert text_of(ids, ("\n",)) == ("ab", True)
    assert text_of(ids, ("\n",), include_stop=True) == ("ab\n", True)
    assert text_of(ids, ("\n",), min_tokens=4) == ("ab\nc", True)  # the first "\n" is the 3rd token: under min_tokens
    assert text_of(ids) == ("ab\nc\nd", False)
    assert text_of(ids, skip_special_tokens=False) == ("ab\nc\nd<e>", False)
    assert text_of(ids, skip_special_tokens=False, end_ids=frozenset({0})) == ("ab\nc\nd", False)
    assert text_of(ids, skip_special_tokens=False, end_ids=frozenset({0}), include_stop=True) == ("ab\nc\nd<e>", False)


# --- the HTTP bodies -------------------------------------------------------------------------------------


def body(model, **fields):
    return parse_body(json.dumps(fields).encode(), model)


def test_chat_content_parts_join_and_other_parts_are_refused_by_type():
    chat = body(ChatBody, messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                  {"type": "text", "text": "b"}]}])
    assert chat.messages[0].content == "a\nb"
    with pytest.raises(HttpError, match=r"messages.0.content: part 1 is of type 'image_url'") as e:
        body(ChatBody, messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                              {"type": "image_url", "image_url": {"url": "x"}}]}])
    assert e.value.status == 400 and e.value.param == "messages.0.content"


def test_vllm_extras_reach_the_request_and_defaults_of_unserved_ones_pass():
    req = body(CompletionBody, prompt="x", max_completion_tokens=7, max_tokens=3, min_p=0.1, min_tokens=2,
               ignore_eos=True, stop_token_ids=[5, 6], include_stop_str_in_output=True, skip_special_tokens=False,
               repetition_penalty=1.0, presence_penalty=0, frequency_penalty=0.0).request("x", None)
    assert (req.max_new_tokens, req.min_p, req.min_tokens, req.ignore_eos, req.stop_token_ids) == (7, 0.1, 2, True, (5, 6))
    assert req.include_stop_str_in_output and not req.skip_special_tokens
    assert req.end_ids([0, 5]) == (5, 6) and req.sampling([0]).end_ids == (5, 6)
    assert body(CompletionBody, prompt="x", stop_token_ids=[5]).request("x", None).end_ids([0]) == (0, 5)
    penalized = body(CompletionBody, prompt="x", repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=-1,
                     logit_bias={"7": -100, "3": 2.5}, response_format={"type": "json_object"}).request("x", None)
    assert (penalized.repetition_penalty, penalized.presence_penalty, penalized.frequency_penalty) == (1.2, 0.5, -1)
    assert penalized.logit_bias == ((3, 2.5), (7, -100)) and penalized.response_format.type == "json_object"
    assert penalized.sampling([0]).grammar is not None and req.sampling([0]).grammar is None
    stream = body(ChatBody, messages=[{"role": "user", "content": "x"}], stream=True,
                  stream_options={"include_usage": True, "continuous_usage_stats": True})
    assert stream.continuous_usage
