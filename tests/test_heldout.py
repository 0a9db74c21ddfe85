"""Judging a drafter on held-out conversations (specdec.training.heldout_batches): each read from its first token,
judged on its answer from the second token on, the positions a served drafter proposes."""

import pytest
import torch
import torch.nn.functional as F

from conftest import VOCAB
from specdec.distill import draft_config, evaluate, split_conversations
from specdec.head_training import evaluate_head, evaluate_medusa, new_head, new_medusa, target_features, unrolled
from specdec.loading import load_model
from specdec.training import Conversation, heldout_batches

CPU = torch.device("cpu")


def conversations(n: int, seed: int = 0) -> list[Conversation]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        prompt, answer = (int(x) for x in torch.randint(3, 30, (2,), generator=g))
        out.append(Conversation(torch.randint(0, VOCAB, (prompt + answer,), generator=g).tolist(), prompt))
    return out


@pytest.fixture(scope="module")
def model(model_dirs):
    return load_model(model_dirs.target)


def test_each_row_is_a_conversation_from_its_first_token_judged_on_its_answer():
    chats = conversations(20)
    batches = heldout_batches(chats, CPU)
    assert [b.tokens.shape[0] for b in batches] == [8, 8, 4]  # all 20, 8 of neighbouring lengths a batch
    rows = [(t, j) for b in batches for t, j in zip(b.tokens, b.judged)]
    for c in chats:
        [(row, judged)] = [(t, j) for t, j in rows if t[: len(c.tokens)].tolist() == c.tokens]
        assert not row[len(c.tokens):].any()  # padding after it
        # a served drafter proposes from the answer's second token: the distributions at answer_start .. len - 2
        assert judged.nonzero().flatten().tolist() == list(range(c.answer_start, len(c.tokens) - 1))
    assert sum(b.tokens.shape[0] for b in heldout_batches(conversations(300), CPU)) == 64  # spread, at most 64
    with pytest.raises(ValueError, match="answer must start inside"):
        Conversation([1, 2, 3], 3)


def test_the_last_conversations_are_held_out_and_the_rest_is_the_training_stream():
    chats = conversations(40)
    stream, held = split_conversations(chats)
    assert held == chats[38:]
    assert stream.tolist() == [t for c in chats[:38] for t in c.tokens]
    assert split_conversations(chats[:3])[1] == chats[2:3]  # at least one held out
    with pytest.raises(ValueError, match="at least 2"):
        split_conversations(chats[:1])


def last_token_only(c: Conversation) -> Conversation:
    """The same tokens, judged at one position: the one whose next token is the last."""
    return Conversation(c.tokens, len(c.tokens) - 2)


def kl(logp: torch.Tensor, logq: torch.Tensor) -> float:
    return float((logp.exp() * (logp - logq)).sum())


@torch.no_grad()
def test_each_evaluation_judges_the_distribution_of_the_judged_position(model):
    """Judged at one position s, each drafter's KL is that of the target's distribution at s (of token s + 1) and
    its guess of it: caught if a position is off by one."""
    c = last_token_only(conversations(1, seed=2)[0])
    s, tokens = c.answer_start, torch.tensor([c.tokens])
    logp = F.log_softmax(model(input_ids=tokens).logits.float()[0], -1)  # [S, V]

    torch.manual_seed(0)
    draft = type(model)(draft_config(model, 1, 32))
    logq = F.log_softmax(draft(input_ids=tokens).logits.float()[0], -1)
    assert evaluate(model, draft, [c])["kl"] == pytest.approx(kl(logp[s], logq[s]), rel=1e-4)

    head = new_head(model, torch.arange(VOCAB))
    feats, _ = target_features(model, head, tokens)
    q = unrolled(head, tokens, feats, 2)  # step j's entry t: position t + 1's distribution
    got = evaluate_head(model, head, [c], 2)
    assert got["kl"] == pytest.approx([kl(logp[s], F.log_softmax(q[j][0, s - 1].float(), -1)) for j in (0, 1)],
                                      rel=1e-4)
    assert got["greedy_alpha"][0] == float(q[0][0, s - 1].argmax() == logp[s].argmax())

    heads = new_medusa(model, 2)
    hidden = model(input_ids=tokens, output_hidden_states=True).hidden_states[-1]
    q = [F.log_softmax(x.float()[0], -1) for x in heads.head_logits(hidden)]  # head i at t: position t + 1 + i's
    assert evaluate_medusa(model, heads, [c])["kl"] == pytest.approx(
        [kl(logp[s], q[0][s - 1]), kl(logp[s], q[1][s - 2])], rel=1e-4)


@torch.no_grad()
def test_a_conversation_is_judged_alike_alone_and_padded_beside_a_longer_one(model):
    a, b = sorted(conversations(2, seed=7), key=lambda c: len(c.tokens))
    assert len(a.tokens) < len(b.tokens)
    head = new_head(model, torch.arange(VOCAB))
    together, alone = evaluate_head(model, head, [a, b], 2), [evaluate_head(model, head, [c], 2) for c in (a, b)]
    n = [len(c.tokens) - 1 - c.answer_start for c in (a, b)]  # judged positions of each (every step's: answer_start >= 3)
    for j in (0, 1):
        assert together["kl"][j] == pytest.approx((alone[0]["kl"][j] * n[0] + alone[1]["kl"][j] * n[1]) / sum(n),
                                                  rel=1e-4)
