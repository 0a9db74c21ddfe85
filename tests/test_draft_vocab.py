"""A draft model drafting among its most frequent tokens (specdec/draft_vocab.py): the ranking counted, saved,
read back and refused when it is not one; the cut LM head equal to the whole one on the kept ids; a draft folder
with a ranking loaded that way (packed when served), on a real vocabulary's size; greedy output identical to
plain decoding with a draft that cannot draft some of the target's tokens (sampling: tests/test_sampling.py,
"kept" cases); and the ranking written by `specdec draft-vocab` and `specdec distill`."""

import json
import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import NEW_TOKENS, VOCAB
from specdec import CachedLM, SpecConfig, SpeculativeEngine
from specdec.cpu_linear import PackedLinear, pack_linears
from specdec.draft_vocab import (RANKING_FILE, KeptTokensHead, Ranking, keep_frequent_tokens, rank_tokens,
                                 read_ranking, save_ranking)
from specdec.drafter_factory import make_drafter
from specdec.drafters import logit_columns
from specdec.loading import load_draft, load_model


def test_tokens_rank_by_count_then_id_and_unseen_ones_last():
    tokens = torch.tensor([3, 5, 5, 1, 3, 5, 7])
    ranking = rank_tokens(tokens, 8, size=3)
    assert ranking.ids == (5, 3, 1, 7, 0, 2, 4, 6) and ranking.size == 3 and ranking.counted == 7
    assert ranking.kept().tolist() == [1, 3, 5]
    assert rank_tokens(tokens, 8, size=100).size == 8  # never more than the vocabulary
    with pytest.raises(ValueError, match="outside the vocabulary's 0..7"):
        rank_tokens(torch.tensor([1, 8]), 8)


@pytest.mark.parametrize("ids, size, message", [
    ((0, 1, 1, 3), 2, "each of the vocabulary's 4 ids once"),
    ((0, 1, 2), 0, "size must be in 1..3"),
    ((2, 1, 0), 4, "size must be in 1..3"),
])
def test_a_ranking_that_is_not_one_is_refused(ids, size, message):
    with pytest.raises(ValueError, match=message):
        Ranking(ids, size, 0)


def test_a_ranking_is_read_back_and_a_bad_file_is_named(tmp_path):
    assert read_ranking(tmp_path, 8) is None  # no file: the whole vocabulary
    saved = rank_tokens(torch.tensor([2, 2, 6]), 8, size=2)
    save_ranking(tmp_path, saved)
    assert read_ranking(tmp_path, 8) == saved
    with pytest.raises(ValueError, match=f"{RANKING_FILE} ranks 8 tokens, but the draft's vocabulary has 16"):
        read_ranking(tmp_path, 16)
    (tmp_path / RANKING_FILE).write_text(json.dumps({"size": 2, "ids": [0, 0, 1]}))
    with pytest.raises(ValueError, match=f"{RANKING_FILE}: not a draft vocabulary"):
        read_ranking(tmp_path, 3)
    (tmp_path / RANKING_FILE).write_text("{")
    with pytest.raises(ValueError, match="not a draft vocabulary"):
        read_ranking(tmp_path, 3)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_the_cut_heads_columns_are_the_whole_ones_at_the_kept_ids(bias, packed):
    torch.manual_seed(0)
    head = torch.nn.Linear(32, 100, bias=bias)
    kept = torch.tensor([0, 3, 17, 42, 99])
    cut = KeptTokensHead(head, kept)
    if packed:
        pack_linears(cut)
        assert isinstance(cut.proj, PackedLinear)
    hidden = torch.randn(2, 3, 32)
    with torch.inference_mode():
        whole, logits = head(hidden), cut(hidden)  # [2, 3, 100], [2, 3, 5]
    assert logits.shape == (2, 3, 5) and torch.equal(cut.logit_columns(), kept)
    torch.testing.assert_close(logits, whole[..., kept], rtol=1e-5, atol=1e-5)


def real_vocab_draft(path, vocab: int = 32_000):
    """A one-layer Llama over a real vocabulary's size, saved the real way."""
    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.mark.parametrize("served", [False, True])
def test_a_draft_folder_with_a_ranking_loads_drafting_among_its_kept_tokens(tmp_path, served):
    path = real_vocab_draft(tmp_path / "draft")
    whole = load_draft(str(path), target=None)
    assert isinstance(whole.get_output_embeddings(), torch.nn.Linear)  # no ranking: every token
    rng = random.Random(0)
    save_ranking(path, rank_tokens(torch.tensor([rng.randrange(4000) for _ in range(20_000)]), 32_000, size=4096))
    cut = load_draft(str(path), target=None, served=served, quantization="none")  # float: its logits compared
    head = cut.get_output_embeddings()
    assert isinstance(head, KeptTokensHead) and head.kept.numel() == 4096
    assert isinstance(head.proj, PackedLinear if served else torch.nn.Linear)
    if served:  # a draft replica loads it so too (it drafted over the whole vocabulary before)
        from actors.draft_replica import load_replica_draft
        replicas = load_replica_draft(str(path), None, torch.float32, "cpu", "none").get_output_embeddings()
        assert isinstance(replicas, KeptTokensHead) and torch.equal(replicas.kept, head.kept)
    assert torch.equal(logit_columns(cut), head.kept) and logit_columns(whole) is None
    ids = torch.tensor([[5, 100, 3999]])
    with torch.inference_mode():
        full, some = whole(ids).logits[0], cut(ids).logits[0]  # [3, 32000], [3, 4096]
    assert some.shape == (3, 4096)
    torch.testing.assert_close(some, full[:, head.kept], rtol=1e-4, atol=1e-4)


def test_transformers_assisted_generation_gets_the_draft_over_the_whole_vocabulary(tmp_path):
    """hf-assisted, the peer, runs transformers' assisted generation, which reads the draft's logits as the target's
    vocabulary: a draft cut to its frequent tokens is loaded again whole for it, and without that build_modes says so."""
    from specdec.bench import assistant_model, build_modes
    from specdec.sampling import SamplingParams

    path = real_vocab_draft(tmp_path / "draft")
    whole = load_draft(str(path), target=None, served=True)
    assert assistant_model(str(path), whole, torch.float32, "cpu", "none") is whole  # nothing cut: the draft itself
    save_ranking(path, rank_tokens(torch.arange(4000), 32_000, size=4096))
    cut = load_draft(str(path), target=None, served=True)
    assistant = assistant_model(str(path), cut, torch.float32, "cpu", "none")
    assert logit_columns(assistant) is None and isinstance(assistant.get_output_embeddings(), PackedLinear)
    with torch.inference_mode():
        assert assistant(torch.tensor([[5, 6]])).logits.shape == (1, 2, 32_000)
    with pytest.raises(ValueError, match="hf-assisted needs the draft over the whole vocabulary"):
        build_modes(None, cut, set(), 4, SamplingParams(), {"hf-assisted"})


def test_greedy_with_a_draft_that_cannot_draft_every_token_equals_plain_decoding(target, model_dirs, reference):
    """The draft (as served: packed) keeps 24 of the 64 tokens: the target's other tokens are never drafted, and
    every output is still the target's greedy one; the kept tokens still get accepted."""
    counts = torch.bincount(torch.tensor([t for c in reference.continuations for t in c]), minlength=VOCAB)
    ranking = rank_tokens(torch.repeat_interleave(torch.arange(VOCAB), counts), VOCAB, size=24)
    cut = pack_linears(keep_frequent_tokens(load_model(model_dirs.draft), ranking))
    engine = SpeculativeEngine(CachedLM(target), make_drafter("model", CachedLM(cut), 2), SpecConfig(depth=3),
                               eos_token_ids=set())
    outs = engine.generate(reference.prompts, NEW_TOKENS)
    assert [o.token_ids for o in outs] == reference.continuations
    outside = sum(t not in set(ranking.kept().tolist()) for c in reference.continuations for t in c)
    assert outside > 0  # some of the target's tokens were not draftable
    assert sum(o.stats.accepted for o in outs) > 0


def test_draft_vocab_command_ranks_a_corpus_into_the_draft_folder(tmp_path, model_dirs):
    from specdec.cli import main
    from specdec.loading import load_tokenizer
    from test_cli import _with_tokenizer  # a word-level tokenizer over "w0", "w1", ...

    path = tmp_path / "draft"
    _with_tokenizer(model_dirs.draft, path)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(f"w{i % 10}" for i in range(500)))
    main(["draft-vocab", "--draft", str(path), "--corpus", str(corpus), "--size", "12"])
    ranking = read_ranking(path, VOCAB)
    words = load_tokenizer(str(path)).convert_tokens_to_ids([f"w{i}" for i in range(10)])
    assert ranking.size == 12 and set(ranking.ids[:10]) == set(words)
    head = load_draft(str(path), target=None).get_output_embeddings()
    assert isinstance(head, KeptTokensHead) and head.kept.numel() == 12
    with pytest.raises(SystemExit, match="--size must be >= 1"):
        main(["draft-vocab", "--draft", str(path), "--corpus", str(corpus), "--size", "0"])
