"""Penalties, logit_bias and response_format grammars change the target's distribution as a function of the
tokens before each one; under speculation every tree node's logits come from its own path
(specdec/processors.py, specdec/grammar.py). Greedy speculative output equals plain decoding with the same
settings, and transformers' generate() where it has the knob (repetition_penalty); sampled output passes
the chi-square test against the penalised distribution, and fails it when nodes take the root's history
(the test has teeth); JSON-schema outputs parse, validate, and equal the same constraint decoded plainly.
The served checks (HTTP and gRPC) are in tests/test_constraints_served.py."""

import json
import random

import jsonschema
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

import specdec.processors
from conftest import make_prompts
from specdec import CachedLM, SamplingParams, SpecConfig, SpeculativeEngine
from specdec.errors import InvalidArgument
from specdec.grammar import Grammars, ResponseFormat, grammar_of
from specdec.loading import load_model
from specdec.plain import hf_generate
from specdec.processors import History, process
from specdec.sampling import warp
from specdec.tree import TokenTree
from test_sampling import M, N_TOKENS, P_MIN, PROMPT, drafter_for, fit, sample_engine

PENALIZED = SamplingParams(repetition_penalty=1.6, presence_penalty=0.8, frequency_penalty=0.5,
                           logit_bias=((3, 1.5), (11, -2.0)))

# --- the processors, by hand -----------------------------------------------------------------------------


def test_each_node_is_penalised_by_its_own_path():
    """Root (the row's last token, 2) with children 4 and 5, and 4's child 4: the logits after each node
    see the prompt [1, 2] and output [2] (root), then the node's own path."""
    tree = TokenTree.root(2)
    a = tree.add(0, 4)
    b = tree.add(0, 5)
    c = tree.add(a, 4)
    logits = torch.tensor([[2.0, -1.0, 3.0, 0.5, 1.0, -2.0]]).repeat(4, 1)  # [N=4, V=6]
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.25, frequency_penalty=0.5,
                            logit_bias=((0, 1.0),))
    out = process(logits, params, History([1, 2, 2], prompt_len=2), tree)

    def expected(output: list[int]) -> list[float]:
        row = [2.0 + 1.0, -1.0, 3.0, 0.5, 1.0, -2.0]  # the bias first (vLLM's order), then the penalties
        for t in set([1, 2] + output):
            row[t] = row[t] / 2.0 if row[t] > 0 else row[t] * 2.0
        for t in set(output):
            row[t] -= 0.5 * output.count(t) + 0.25
        return row

    for node, output in [(0, [2]), (a, [2, 4]), (b, [2, 5]), (c, [2, 4, 4])]:
        assert out[node].tolist() == pytest.approx(expected(output)), node
    plain = SamplingParams()
    assert process(logits, plain, History([1, 2, 2], 2), tree) is logits  # nothing asked: not even copied


def test_out_of_range_settings_are_refused_naming_the_field():
    for fields, name in [({"repetition_penalty": 0}, "repetition_penalty"), ({"repetition_penalty": float("nan")},
                         "repetition_penalty"), ({"presence_penalty": 2.5}, "presence_penalty"),
                         ({"frequency_penalty": -2.01}, "frequency_penalty"), ({"logit_bias": ((1, 101.0),)}, "logit_bias"),
                         ({"logit_bias": ((1, 1.0), (1, 2.0))}, "logit_bias"), ({"logit_bias": ((-1, 1.0),)}, "logit_bias"),
                         ({"logit_bias": tuple((i, 1.0) for i in range(301))}, "logit_bias"),
                         ({"grammar": "x" * (256 * 1024 + 1)}, "response_format")]:
        with pytest.raises(InvalidArgument) as e:
            SamplingParams(**fields)
        assert e.value.field == name, fields


# --- greedy: speculative == plain == the references ---------------------------------------------------


def greedy(target, drafter, depth, width, params, prompts, n=16, **engine):
    e = SpeculativeEngine(CachedLM(target), drafter, SpecConfig(depth=depth), eos_token_ids=set(), **engine)
    return [g.token_ids for g in e.generate(prompts, n, params=params)]


def penalised_reference(model, prompt: list[int], n: int, params: SamplingParams) -> list[int]:
    """Plain greedy decoding with the penalties written out: the whole sequence through the model each
    step, the bias, repetition over prompt and output, frequency and presence over the output."""
    seq = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            row = model(torch.tensor([seq])).logits[0, -1].float().clone()
            for t, b in params.logit_bias:
                row[t] += b
            output = seq[len(prompt):]
            for t in set(seq):
                row[t] = row[t] / params.repetition_penalty if row[t] > 0 else row[t] * params.repetition_penalty
            for t in set(output):
                row[t] -= params.frequency_penalty * output.count(t) + params.presence_penalty
            seq.append(int(row.argmax()))
    return seq[len(prompt):]


@pytest.fixture(scope="module")
def penalised_prompts():
    return [[5], [17, 42, 17]] + make_prompts(seed=3, count=6)


@pytest.mark.parametrize("kind", ["chain", "tree", "merged", "ngram"])
def test_greedy_with_penalties_speculative_equals_plain_and_the_written_out_reference(target, draft, penalised_prompts,
                                                                                       kind):
    from specdec.drafter_factory import make_drafter

    depth, width, drafter_kind = {"chain": (4, 1, "model"), "tree": (3, 3, "model"), "merged": (3, 2, "model+ngram"),
                                  "ngram": (4, 1, "ngram")}[kind]
    drafter = make_drafter(drafter_kind, CachedLM(draft), width)
    plain = greedy(target, None, 0, 1, PENALIZED, penalised_prompts)
    assert greedy(target, drafter, depth, width, PENALIZED, penalised_prompts) == plain
    if kind == "chain":
        unpenalised = greedy(target, None, 0, 1, SamplingParams(), penalised_prompts)
        assert plain != unpenalised  # the penalties do change the output
        for prompt, tokens in zip(penalised_prompts[:4], plain):
            assert tokens == penalised_reference(target, prompt, 16, PENALIZED)


def test_greedy_repetition_penalty_equals_transformers_generate(target, draft, penalised_prompts):
    from specdec.drafter_factory import make_drafter

    params = SamplingParams(repetition_penalty=1.3)
    speculative = greedy(target, make_drafter("model", CachedLM(draft), 2), 3, 2, params, penalised_prompts)
    for prompt, tokens in zip(penalised_prompts, speculative):
        assert tokens == hf_generate(target, prompt, 16, repetition_penalty=1.3, do_sample=False)


# --- sampling: the penalised distribution, exactly -------------------------------------------------------


@torch.inference_mode()
def exact_penalised(model, prompt: list[int], n: int, params: SamplingParams) -> dict[tuple[int, ...], float]:
    """P(x_1..x_n | prompt) under the penalised, warped distribution, by enumeration."""
    probs = {(): 1.0}
    for _ in range(n):
        nxt = {}
        for pre, pr in probs.items():
            row = model(torch.tensor([prompt + list(pre)])).logits[0, -1].float().clone()
            for t, b in params.logit_bias:
                row[t] += b
            for t in set(prompt + list(pre)):
                row[t] = row[t] / params.repetition_penalty if row[t] > 0 else row[t] * params.repetition_penalty
            for t in set(pre):
                row[t] -= params.frequency_penalty * pre.count(t) + params.presence_penalty
            dist = warp(row[None], params)[0].double()
            nxt |= {pre + (x,): pr * float(dist[x]) for x in range(dist.shape[-1]) if dist[x] > 0}
        probs = nxt
    return probs


SAMPLED = SamplingParams(temperature=1.0, seed=2024, repetition_penalty=1.8, presence_penalty=0.9,
                         frequency_penalty=0.6, logit_bias=((3, 1.0),))


@pytest.fixture(scope="module")
def exact_sampled(small_target):
    exact = exact_penalised(small_target, PROMPT, N_TOKENS, SAMPLED)
    assert sum(exact.values()) == pytest.approx(1.0, abs=1e-5)
    return exact


@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_sampling_with_penalties_matches_the_penalised_target(small_target, small_draft, exact_sampled, kind):
    drafter, depth, width = drafter_for(kind, small_draft)
    counts, outs = sample_engine(small_target, drafter, depth, width, SAMPLED)
    joint, margins, tv = fit(counts, exact_sampled)
    print(f"{kind} penalised: joint p={joint:.3g} marginal p={[f'{x:.3g}' for x in margins]} TV={tv:.3f}")
    assert joint > P_MIN and min(margins) > P_MIN, (joint, margins, tv)
    assert 0 < sum(o.stats.accepted for o in outs) and len(outs) == M


def test_a_target_that_gives_every_node_the_roots_history_fails_the_test(small_target, small_draft, exact_sampled,
                                                                         monkeypatch):
    """The bound has teeth: with the path left out of each node's history, the output drifts from the
    penalised distribution (the tree's deeper nodes are not penalised for their own ancestors)."""
    monkeypatch.setattr(specdec.processors, "path_tokens", lambda tree: [])
    drafter, depth, width = drafter_for("tree", small_draft)
    counts, _ = sample_engine(small_target, drafter, depth, width, SAMPLED)
    joint, _, tv = fit(counts, exact_sampled)
    assert joint < P_MIN, (joint, tv)


# --- response_format: JSON that validates, the same under speculation ----------------------------------

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}


def json_tokenizer(seed: int = 0) -> PreTrainedTokenizerFast:
    """A byte-level BPE of 400 tokens trained on JSON records and some prose (any text encodes)."""
    rng = random.Random(seed)
    corpus = [json.dumps({"name": "".join(rng.choice("abcdefgh") for _ in range(rng.randint(1, 8))),
                          "age": rng.randrange(120), "tags": ["red", "green", "blue"][: rng.randrange(4)],
                          "ok": rng.random() < 0.5}) for _ in range(300)]
    corpus += ["Describe a person as JSON, with their name and age. The quick brown fox. "] * 20
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=["<|end|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}assistant: {% endif %}")
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>", chat_template=template)


def save_json_pair(root) -> tuple[str, str]:
    """A tiny Llama target over json_tokenizer (vocabulary padded to 416, as real models pad theirs) and a
    noisy copy as its draft, saved and with the tokenizer beside each."""
    tokenizer = json_tokenizer()
    torch.manual_seed(5)
    config = LlamaConfig(vocab_size=416, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None, pad_token_id=None)
    target = LlamaForCausalLM(config).eval()
    draft = LlamaForCausalLM(config).eval()
    draft.load_state_dict(target.state_dict())
    with torch.no_grad():
        target.lm_head.weight.mul_(3.0)
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.1 * p.std())
    paths = []
    for name, model in (("json_target", target), ("json_draft", draft)):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        paths.append(str(root / name))
    return paths[0], paths[1]


@pytest.fixture(scope="module")
def json_pair(tmp_path_factory):
    target_dir, draft_dir = save_json_pair(tmp_path_factory.mktemp("json"))
    tokenizer = PreTrainedTokenizerFast.from_pretrained(target_dir)
    return load_model(target_dir), load_model(draft_dir), tokenizer


def grammar_engine(json_pair, drafter_kind: str | None, depth: int, width: int) -> SpeculativeEngine:
    from specdec.drafter_factory import make_drafter

    target, draft, tokenizer = json_pair
    drafter = make_drafter(drafter_kind, CachedLM(draft), width) if drafter_kind else None
    eos = {tokenizer.eos_token_id}
    return SpeculativeEngine(CachedLM(target), drafter, SpecConfig(depth=depth), eos_token_ids=eos,
                             grammars=Grammars(tokenizer, target.config.vocab_size, sorted(eos)))


def test_grammar_masks_leave_the_matcher_where_it_was(json_pair):
    _, _, tokenizer = json_pair
    grammars = Grammars(tokenizer, 416, [tokenizer.eos_token_id])
    row = grammars.matcher(grammar_of(ResponseFormat("json_schema", SCHEMA)))
    start = tokenizer.encode('{"name": "ab')
    tree = TokenTree.root(7)
    a = tree.add(0, start[0])
    b = tree.add(a, start[1])
    bad = tree.add(0, tokenizer.encode("x")[0])
    under_bad = tree.add(bad, start[0])
    first = row.allowed(tree)  # [5, 416]
    assert first[0, start[0]] and not first[0, tokenizer.encode("x")[0]] and first[a, start[1]]
    assert first[bad].all() and first[under_bad].all()  # under a forbidden node: never accepted, unmasked
    assert not first[:, 400:].any(dim=1)[[0, a, b]].any()  # the padded ids past the tokenizer: never allowed
    assert torch.equal(row.allowed(tree), first)  # rolled back: the same masks again
    row.commit(start[:2])
    assert torch.equal(row.allowed(TokenTree.root(start[1]))[0], first[b])


@pytest.mark.parametrize("schema", [{"type": "integer", "minimum": 5, "maximum": 7}, {"type": "integer"},
                                    {"enum": ["5"]}], ids=["bounded integer", "integer", "enum"])
def test_a_tree_with_the_end_after_a_finished_output_leaves_the_end_committable(json_pair, schema):
    """Once "5" finishes a bounded integer, the end is all the grammar allows and llguidance's (1.9) matcher has
    already stopped: it consumes the end as no token, so the walk's rollback of the end undid "5" itself. The
    matcher then refused the end when the target committed it, and the request failed with an internal error. The walk does not consume ends: they and
    the nodes under them get what a finished matcher allows (the end again), and the committed end is taken."""
    _, _, tokenizer = json_pair
    end = tokenizer.eos_token_id
    grammars = Grammars(tokenizer, 416, [end])
    row = grammars.matcher(grammar_of(ResponseFormat("json_schema", schema)))
    five = tokenizer.encode("5" if schema.get("type") else '"5"')
    row.commit(five)
    tree = TokenTree.root(five[-1])
    ended = tree.add(0, end)
    again = tree.add(ended, end)
    tree.add(ended, five[0])
    masks = row.allowed(tree)  # [4, 416]
    finished = masks[ended]
    assert masks[0, end] and finished[end] and finished.sum() == 1, finished.nonzero()  # after the end: the end
    assert torch.equal(masks[again], finished) and masks[3].all()  # under it the same; under a forbidden node: free
    row.commit([end])  # raised "the grammar refused committed token"
    assert row.m.is_stopped() and not row.m.is_error()
    assert torch.equal(row.allowed(TokenTree.root(end))[0], finished)  # as the committed end's next verify masks


def test_json_schema_outputs_validate_and_speculation_equals_plain_on_50_prompts(json_pair):
    _, _, tokenizer = json_pair
    params = SamplingParams(grammar=grammar_of(ResponseFormat("json_schema", SCHEMA)),
                            end_ids=(tokenizer.eos_token_id,))
    rng = random.Random(7)
    prompts = [tokenizer.encode(f"Person {i}: ") + [rng.randrange(400) for _ in range(rng.randint(0, 12))]
               for i in range(50)]
    plain = grammar_engine(json_pair, None, 0, 1).generate(prompts, 96, params=params)
    speculative = grammar_engine(json_pair, "model", 3, 2).generate(prompts, 96, params=params)
    assert [g.token_ids for g in speculative] == [g.token_ids for g in plain]
    for g in plain:
        assert g.token_ids[-1] == tokenizer.eos_token_id, tokenizer.decode(g.token_ids)  # complete, then ended
        jsonschema.validate(json.loads(tokenizer.decode(g.token_ids[:-1])), SCHEMA)
    drafted = sum(g.stats.drafted for g in speculative)
    accepted = sum(g.stats.accepted for g in speculative)
    print(f"json_schema under speculation: accepted {accepted} of {drafted} drafted")
    assert 0 < accepted < drafted


def test_a_bounded_integer_under_speculation_ends_as_plain_decoding_does(json_pair):
    """The served failure above, end to end: trees that draft past a finished number."""
    _, _, tokenizer = json_pair
    schema = {"type": "integer", "minimum": 5, "maximum": 7}
    params = SamplingParams(grammar=grammar_of(ResponseFormat("json_schema", schema)), end_ids=(tokenizer.eos_token_id,))
    prompts = [tokenizer.encode(f"Person {i}: ") for i in range(12)]
    plain = grammar_engine(json_pair, None, 0, 1).generate(prompts, 8, params=params)
    engine = grammar_engine(json_pair, "model+suffix", 4, 2)  # suffix guesses the end after a number it has seen
    for _ in range(2):
        speculative = engine.generate(prompts, 8, params=params)
        assert [g.token_ids for g in speculative] == [g.token_ids for g in plain]
    for g in plain:
        assert g.token_ids[-1] == tokenizer.eos_token_id and 5 <= json.loads(tokenizer.decode(g.token_ids[:-1])) <= 7


def test_sampled_json_object_outputs_are_json_objects(json_pair):
    _, _, tokenizer = json_pair
    params = SamplingParams(temperature=1.0, seed=3, grammar=grammar_of(ResponseFormat("json_object")),
                            end_ids=(tokenizer.eos_token_id,))
    outs = grammar_engine(json_pair, "model", 3, 2).generate([tokenizer.encode("Person: ")] * 8, 64, params=params,
                                                             streams=list(range(8)))
    for g in outs:
        text = tokenizer.decode(g.token_ids[:-1] if g.token_ids[-1] == tokenizer.eos_token_id else g.token_ids)
        assert text.startswith("{"), text
        if g.token_ids[-1] == tokenizer.eos_token_id:
            assert isinstance(json.loads(text), dict), text


def test_a_bad_schema_or_format_is_refused_naming_response_format(json_pair):
    _, _, tokenizer = json_pair
    grammars = Grammars(tokenizer, 416, [tokenizer.eos_token_id])
    with pytest.raises(InvalidArgument, match="response_format: the grammar does not compile"):
        grammars.check(grammar_of(ResponseFormat("json_schema", {"type": "nonsense"})))
    with pytest.raises(InvalidArgument, match="response_format: type must be"):
        grammar_of(ResponseFormat("yaml"))
    with pytest.raises(InvalidArgument, match="json_schema needs a schema"):
        grammar_of(ResponseFormat("json_schema"))
    assert grammar_of(ResponseFormat("text")) is None and grammar_of(ResponseFormat("")) is None



def test_a_grammar_that_cannot_go_on_fails_its_request_alone_naming_it(json_pair):
    """A matcher past its limits (llguidance's lexer on a pattern like ((a|b){1,500}){1,500}c) allowed only the end
    from there: the output ended unfinished, as "stop", not held to its schema. Its request fails instead, naming
    response_format; the rows beside it in the forward step on."""
    from specdec.errors import InvalidArgument
    from specdec.target import TargetWorker

    target, _, tokenizer = json_pair
    worker = TargetWorker(CachedLM(target), Grammars(tokenizer, target.config.vocab_size, [tokenizer.eos_token_id]))
    held = SamplingParams(grammar=grammar_of(ResponseFormat("json_object")), end_ids=(tokenizer.eos_token_id,))
    prompt = tokenizer.encode("Person: ")
    worker.add([("held", prompt, held, 0), ("free", prompt, SamplingParams(), 0)])
    matcher = worker.requests["held"].grammar.m

    class Stuck:  # the matcher, in its error state
        def __getattr__(self, name):
            return getattr(matcher, name)

        def is_error(self):
            return True

        def get_error(self):
            return "too many expressions constructed"

    worker.requests["held"].grammar.m = Stuck()
    before = list(worker.requests["held"].seq)
    outcomes, _ = worker.verify({rid: TokenTree.root(worker.last_token(rid)) for rid in ("held", "free")})
    assert isinstance(outcomes["held"], InvalidArgument) and outcomes["held"].field == "response_format"
    assert "too many expressions" in str(outcomes["held"]) and worker.requests["held"].seq == before
    assert not isinstance(outcomes["free"], Exception) and len(worker.requests["free"].seq) == len(prompt) + 1
