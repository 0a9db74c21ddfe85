"""Distil a small draft from a target: the draft learns the target's next-token distributions by
minimising KL(p_target || q_draft) over corpus text and/or text the target writes itself. The best
drafts agree with *their* target; this makes one for any causal LM with its tokenizer."""

import json
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from .device import HOST
from .draft_vocab import DEFAULT_SIZE, rank_tokens, save_ranking
from .training import (Conversation, Heldout, Totals, TrainConfig, check_corpus, drafted_tokens, heldout_batches,
                       resume_weights, target_digest, train)

TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".json", ".jsonl")


def small_llama_config(vocab_size: int, layers: int, hidden: int, *, max_positions: int, bos_token_id: int | None,
                       eos_token_id: int | list[int] | None, pad_token_id: int | None) -> LlamaConfig:
    """The sizing of the small Llamas made here (the default target, drafts): heads of 64 dims (at least
    one head), an MLP 8/3 as wide as `hidden` rounded up to a multiple of 32, tied embeddings."""
    heads = max(1, hidden // 64)
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=(hidden * 8 // 3 + 31) // 32 * 32,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
    )


def draft_config(target: PreTrainedModel, layers: int, hidden: int) -> LlamaConfig:
    """A small Llama over the target's vocabulary."""
    if layers < 1 or hidden < 16 or hidden % 16:
        raise ValueError(f"draft needs layers >= 1 and hidden a multiple of 16 (>= 16), got {layers}, {hidden}")
    tc = target.config
    return small_llama_config(
        target.get_output_embeddings().out_features, layers, hidden,
        max_positions=getattr(tc, "max_position_embeddings", 2048),
        bos_token_id=tc.bos_token_id, eos_token_id=tc.eos_token_id, pad_token_id=tc.pad_token_id,
    )


def corpus_files(paths: list[str]) -> list[Path]:
    files = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES)
        elif p.is_file():
            files.append(p)
        else:
            raise FileNotFoundError(f"corpus path {str(p)!r} does not exist")
    if not files:
        raise ValueError(f"no text files ({', '.join(TEXT_SUFFIXES)}) under {paths}")
    return files


def encode_texts(texts: list[str], tokenizer) -> torch.Tensor:
    """Texts -> one token stream [N], documents separated by the eos token when there is one."""
    sep = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids: list[int] = []
    for enc in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids += enc + sep
    return torch.tensor(ids, dtype=torch.long, device=HOST)


def generated_corpus(target: PreTrainedModel, tokenizer, num_tokens: int, seed: int, seq_len: int = 256) -> torch.Tensor:
    """Text the target writes itself (sampled at temperature 1), as a token stream [>= num_tokens]."""
    from .engine import SpeculativeEngine
    from .kvcache import CachedLM
    from .sampling import SamplingParams

    start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else (tokenizer.eos_token_id or 0)
    engine = SpeculativeEngine(CachedLM(target), None)
    batch = 8
    chunks = []
    for round_ in range((num_tokens + batch * seq_len - 1) // (batch * seq_len)):
        outs = engine.generate([[start]] * batch, seq_len, SamplingParams(temperature=1.0, seed=seed + round_),
                               streams=list(range(batch)))
        chunks += [torch.tensor([start] + o.token_ids, device=HOST) for o in outs]
    return torch.cat(chunks)


def kl_loss(target: PreTrainedModel, draft: PreTrainedModel):
    """batch [B, S] -> mean over positions of KL(p_target || q_draft) (the target runs on every batch)."""

    def loss(batch: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            logp = F.log_softmax(target(input_ids=batch).logits.float(), -1)  # [B, S, V]
        logq = F.log_softmax(draft(input_ids=batch).logits.float(), -1)
        V = min(logp.shape[-1], logq.shape[-1])
        return F.kl_div(logq[..., :V].flatten(0, 1), logp[..., :V].flatten(0, 1), log_target=True, reduction="batchmean")

    return loss


def sampled_text_loss(target: PreTrainedModel, draft: PreTrainedModel):
    """batch [B, S] of text the target sampled at temperature 1 -> the draft's cross-entropy on it. Its
    expectation over p's samples is H(p) + KL(p || q), so minimising it distils p without running the target
    on each batch (sequence-level distillation: Kim and Rush, 2016)."""

    def loss(batch: torch.Tensor) -> torch.Tensor:
        return draft(input_ids=batch, labels=batch).loss

    return loss


@torch.no_grad()
def init_embedding(draft: PreTrainedModel, target: PreTrainedModel) -> None:
    """The draft's (tied) embedding starts as the target's, projected on its top principal directions when
    the draft is narrower: E_d [V, h] = E_t [V, H] @ W [H, h]. Tokens the target treats alike start alike."""
    e_t = target.get_input_embeddings().weight.float()  # [V, H]
    e_d = draft.get_input_embeddings().weight  # [V, h]
    rows, h = min(e_t.shape[0], e_d.shape[0]), e_d.shape[1]
    if h >= e_t.shape[1]:
        e_d[:rows, : e_t.shape[1]] = e_t[:rows].to(e_d.dtype)
        return
    _, _, w = torch.pca_lowrank(e_t, q=h, center=False)  # w [H, h]
    proj = e_t[:rows] @ w
    e_d[:rows] = (proj * (e_d[:rows].norm(dim=1).mean() / proj.norm(dim=1).mean())).to(e_d.dtype)


@torch.no_grad()
def evaluate(target, draft, heldout: Heldout) -> dict:
    """On held-out text (or conversations' answers: specdec.training.heldout_batches): KL(p || q); greedy alpha
    (draft argmax == target argmax, per position); and sampled alpha sum(min(p, q)) at temperature 1 (the chance a
    draft sample is accepted)."""
    kl, greedy, sampled = Totals(), Totals(), Totals()
    for batch in heldout_batches(heldout, target.device):
        p_logits = target(input_ids=batch.tokens).logits.float()
        q_logits = draft(input_ids=batch.tokens).logits.float()
        V = min(p_logits.shape[-1], q_logits.shape[-1])
        logp, logq = F.log_softmax(p_logits[..., :V], -1), F.log_softmax(q_logits[..., :V], -1)
        kl.add(batch, (logp.exp() * (logp - logq)).sum(-1))
        greedy.add(batch, (logp.argmax(-1) == logq.argmax(-1)).float())
        sampled.add(batch, torch.minimum(logp.exp(), logq.exp()).sum(-1))
    return {"kl": kl.mean(), "greedy_alpha": greedy.mean(), "sampled_alpha": sampled.mean()}


def distill(
    target: PreTrainedModel,
    tokenizer,
    out_dir: str | Path,
    tokens: torch.Tensor,  # [N] training text as one token stream
    heldout: Heldout,  # held-out text [M], or conversations judged on their answers
    layers: int = 1,
    hidden: int = 256,
    cfg: TrainConfig = TrainConfig(),
    resume: bool = False,
    on_step=None,
    objective=kl_loss,  # (target, draft) -> (batch -> loss): kl_loss, or sampled_text_loss on the target's samples
    embedding_from_target: bool = False,  # init_embedding: start from the target's (projected) embedding
    draft_vocab: int = DEFAULT_SIZE,  # it drafts among this many of the training text's most frequent tokens
) -> dict:
    """Train a draft for `target` and save it (with the tokenizer, and its tokens ranked by their frequency in
    `tokens`: specdec.draft_vocab) to out_dir; returns a summary."""
    check_corpus(tokens, heldout, cfg.seq_len)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    target.eval().requires_grad_(False)
    torch.manual_seed(cfg.seed)
    draft = LlamaForCausalLM(draft_config(target, layers, hidden)).to(target.device)
    if embedding_from_target:
        init_embedding(draft, target)
    trained_for = {"target": target_digest(target), "kind": "draft", "layers": layers, "hidden": hidden,
                   "vocab": draft.config.vocab_size}
    resume_weights(draft, out / "checkpoint", resume, trained_for, cfg.steps)
    before = evaluate(target, draft, heldout)
    result = train(draft, objective(target, draft), tokens, cfg, out / "checkpoint", resume, "distill", on_step,
                   trained_for)
    after = evaluate(target, draft, heldout)
    draft.save_pretrained(out)
    tokenizer.save_pretrained(out)
    ranking = rank_tokens(tokens, draft.get_output_embeddings().out_features, draft_vocab)
    save_ranking(out, ranking)
    summary = {"out": str(out), **result, "before": before, "after": after,
               "draft_params": sum(p.numel() for p in draft.parameters()), "draft_vocab": ranking.size,
               "heldout_kept": round(float(torch.isin(drafted_tokens(heldout), ranking.kept()).float().mean()), 4)}
    (out / "distill_summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def split_heldout(tokens: torch.Tensor, fraction: float = 0.05) -> tuple[torch.Tensor, torch.Tensor]:
    cut = int(tokens.numel() * (1 - fraction))
    return tokens[:cut], tokens[cut:]


def split_conversations(chats: list[Conversation], fraction: float = 0.05) -> tuple[torch.Tensor, list[Conversation]]:
    """-> (the first conversations as one training stream [N], the last `fraction` of them (at least one) held out,
    to judge a drafter on their answers)"""
    if len(chats) < 2:
        raise ValueError(f"{len(chats)} conversation: at least 2 are needed, one to hold out")
    cut = min(len(chats) - 1, int(len(chats) * (1 - fraction)))
    return torch.tensor([t for c in chats[:cut] for t in c.tokens], dtype=torch.long, device=HOST), chats[cut:]


def remove_checkpoint(out_dir: str | Path) -> None:
    shutil.rmtree(Path(out_dir) / "checkpoint", ignore_errors=True)
