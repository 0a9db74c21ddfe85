"""What drafters learn from (specdec.training's TrainData): conversations from their first token, learned on their
answers only, and the losses that read which positions are learned."""

import pytest
import torch
import torch.nn.functional as F

from conftest import VOCAB
from specdec.distill import draft_config, kl_loss
from specdec.head_training import medusa_loss, new_head, new_medusa, target_features, ttt_loss, unrolled
from specdec.loading import load_model
from specdec.training import Conversation, Conversations, Mixture, TokenStream, TrainBatch, evaluation_batches


def conversations(n: int, seed: int = 0) -> list[Conversation]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        prompt, answer = (int(x) for x in torch.randint(2, 30, (2,), generator=g))
        out.append(Conversation(torch.randint(0, VOCAB, (prompt + answer,), generator=g).tolist(), prompt))
    return out


@pytest.fixture(scope="module")
def model(model_dirs):
    return load_model(model_dirs.target)


def which(data: Conversations, row: torch.Tensor) -> int:
    """The conversation (its index in length order) a row holds from its first token, padding after it."""
    found = [i for i, c in enumerate(data.conversations)
             if row[: len(c.tokens)].tolist() == c.tokens and not row[len(c.tokens):].any()]
    assert len(found) == 1, "a row is one conversation from its first token, then padding"
    return found[0]


def test_a_row_is_a_whole_conversation_padded_after_it_and_learned_on_its_answer():
    data = Conversations(conversations(40))
    batch = data.sample(6, 128, torch.Generator().manual_seed(3))
    picked = [which(data, row) for row in batch.tokens]
    for i, learned in zip(picked, batch.learned):
        c = data.conversations[i]
        # a drafter proposes from the answer's second token: the distributions at answer_start .. len - 2
        assert learned.nonzero().flatten().tolist() == list(range(c.answer_start, len(c.tokens) - 1))
    assert sorted(picked) == list(range(min(picked), min(picked) + 6)), "a batch's rows have neighbouring lengths"


def test_every_conversation_is_drawn_and_the_held_out_ones_are_not_trained_on():
    data = Conversations(conversations(50))
    train, held = data.split(0.1)
    assert len(held.conversations) == 5 and len(train.conversations) == 45
    assert not {tuple(c.tokens) for c in held.conversations} & {tuple(c.tokens) for c in train.conversations}
    g = torch.Generator().manual_seed(0)
    seen = {which(train, row) for _ in range(200) for row in train.sample(4, 0, g).tokens}
    assert seen == set(range(45))  # the shortest and the longest too
    with pytest.raises(ValueError, match="at least 2"):
        Conversations(conversations(1)).split()
    with pytest.raises(ValueError, match="answer must start inside"):
        Conversation([1, 2, 3], 3)


def test_a_mixture_is_judged_on_its_conversations_and_drafts_their_answers():
    chats = Conversations(conversations(30))
    stream = TokenStream(torch.arange(500) % VOCAB)
    mixed = Mixture([stream, chats])
    batches = evaluation_batches(mixed, torch.device("cpu"))
    assert all(b.learned is not None for b in batches)
    assert sum(b.tokens.shape[0] for b in batches) == 30  # every held-out conversation, 8 a batch
    answers = sum(len(c.tokens) - c.answer_start for c in chats.conversations)
    assert mixed.drafted().numel() == 500 + answers
    picks = {mixed.sample(2, 16, torch.Generator().manual_seed(s)).learned is None for s in range(40)}
    assert picks == {True, False}  # both sources are drawn from


def one_position(batch: TrainBatch, s: int) -> TrainBatch:
    learned = torch.zeros_like(batch.tokens, dtype=torch.bool)
    learned[0, s] = True
    return TrainBatch(batch.tokens, learned)


def kl(logp: torch.Tensor, logq: torch.Tensor) -> float:
    return float((logp.exp() * (logp - logq)).sum())


@torch.no_grad()
def test_each_loss_reads_the_learned_positions_distribution(model):
    """A loss learned at one position s alone is the KL of the target's distribution at s (of token s + 1) and
    the drafter's guess of it: caught if a mask is a position off."""
    batch = Conversations(conversations(4, seed=2)).rows([3, 0, 1, 2])  # row 0 the longest
    s = int(batch.learned[0].nonzero()[2])
    at_s = one_position(batch, s)
    logp = F.log_softmax(model(input_ids=batch.tokens).logits.float(), -1)  # [B, S, V]

    torch.manual_seed(0)
    draft = type(model)(draft_config(model, 1, 32))
    logq = F.log_softmax(draft(input_ids=batch.tokens).logits.float(), -1)
    assert float(kl_loss(model, draft)(at_s)) == pytest.approx(kl(logp[0, s], logq[0, s]), rel=1e-4)

    head = new_head(model, torch.arange(VOCAB))
    feats, _ = target_features(model, head, batch.tokens)
    q = unrolled(head, batch.tokens, feats, 2)  # step j's entry t: position t + 1's distribution
    want = kl(logp[0, s], F.log_softmax(q[0][0, s - 1].float(), -1))
    want += 0.8 * kl(logp[0, s], F.log_softmax(q[1][0, s - 1].float(), -1))
    assert float(ttt_loss(model, head, 2)(at_s)) == pytest.approx(want, rel=1e-4)

    heads = new_medusa(model, 2)
    hidden = model(input_ids=batch.tokens, output_hidden_states=True).hidden_states[-1]
    q = [F.log_softmax(x.float(), -1) for x in heads.head_logits(hidden)]  # head i at t: position t + 1 + i's
    want = kl(logp[0, s], q[0][0, s - 1]) + 0.8 * kl(logp[0, s], q[1][0, s - 2])
    assert float(medusa_loss(model, heads)(at_s)) == pytest.approx(want, rel=1e-4)


@torch.no_grad()
def test_padding_after_a_conversation_changes_none_of_its_loss(model):
    """Rows of different lengths batched together: each row's positions are what they are alone."""
    data = Conversations(conversations(2, seed=7))
    head = new_head(model, torch.arange(VOCAB))
    loss = ttt_loss(model, head, 3)
    together = data.rows([0, 1])
    alone = [data.rows([i]) for i in (0, 1)]
    assert len(data.conversations[0].tokens) != len(data.conversations[1].tokens)
    for i, single in enumerate(alone):
        row_i = TrainBatch(together.tokens, together.learned & (torch.arange(2)[:, None] == i))
        assert float(loss(row_i)) == pytest.approx(float(loss(single)), rel=1e-4)
