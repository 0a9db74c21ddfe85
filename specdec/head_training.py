"""Training draft heads for a target: EAGLE-3's (specdec.eagle3) and Medusa's (specdec.medusa).

EAGLE-3, with its training-time test: the head is run `ttt_steps` times over each window, each time
reading its own output of the step before in place of the target's features, as it will when it drafts
deeper than one token. Step j's query at position t sees the target-fed keys up to t - j and its own
chain's keys of steps 1..j (one per step), exactly the attention of a chain drafted j deep from position
t - j. The loss at step j (weighted 0.8^j) is KL(p || q) over the draft vocabulary: p the target's
next-token distribution, renormalised there.

Medusa, by self-distillation: head i at position t learns the target's distribution at position t + 1 + i
(KL, weighted 0.8^i), from the target's last hidden state at t; its residual blocks start at zero (each
head starts as the target's LM head) and the LM head is the target's, shared and kept (original_lm_head)."""

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from .cpu_linear import dense_weight
from .device import HOST
from .eagle3 import Eagle3Head, head_config, save_head, spread_aux_layers
from .medusa import MedusaHeads, save_medusa
from .training import Heldout, Totals, TrainConfig, check_corpus, heldout_batches, resume_weights, target_digest, train

STEP_DECAY = 0.8  # EAGLE-3's weight of the j-th step's loss


def frequent_tokens(tokens: torch.Tensor, vocab_size: int, draft_vocab_size: int) -> torch.Tensor:
    """The draft vocabulary: the `draft_vocab_size` ids most frequent in `tokens` (ties to the lower id),
    ascending -> [draft_vocab_size]"""
    counts = torch.bincount(tokens.flatten().cpu(), minlength=vocab_size)[:vocab_size].float()
    counts -= torch.arange(vocab_size, device=HOST) * 1e-9  # a stable order among equal counts
    return counts.topk(draft_vocab_size).indices.sort().values


def new_head(target: PreTrainedModel, draft_ids: torch.Tensor, aux_layers: tuple[int, ...] | None = None) -> Eagle3Head:
    """A fresh head for the target over these draft ids, sharing (and not training) the target's embedding."""
    config = head_config(target.config, draft_ids.numel(), aux_layers or spread_aux_layers(
        target.config.get_text_config().num_hidden_layers))
    config._attn_implementation = "sdpa"
    head = Eagle3Head(config).to(target.device, target.dtype)
    head.d2t.copy_(draft_ids.to(head.d2t.device) - torch.arange(draft_ids.numel(), device=head.d2t.device))
    head.embed_tokens = target.get_input_embeddings()
    head.embed_tokens.requires_grad_(False)
    return head


class _Steps:
    """The keys and values of every step so far, concatenated [B, H, (j+1) T, D] (the head has one layer)."""

    def __init__(self):
        self.k = self.v = None

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.k = key_states if self.k is None else torch.cat([self.k, key_states], dim=2)
        self.v = value_states if self.v is None else torch.cat([self.v, value_states], dim=2)
        return self.k, self.v


def step_mask(T: int, j: int, device) -> torch.Tensor:
    """[T, (j+1) T] bool: step j's query t sees step 0's keys 0..t-j and step i's key t-j+i (1 <= i <= j)."""
    t = torch.arange(T, device=device).view(T, 1)
    k = torch.arange(T, device=device).view(1, T)
    blocks = [k <= t - j] + [k == t - j + i for i in range(1, j + 1)]
    return torch.cat(blocks, dim=1)


def target_features(target: PreTrainedModel, head: Eagle3Head, batch: torch.Tensor):
    """The target on a batch [B, S] -> its hidden states at the head's layers [B, S, 3 Ht] and logits [B, S, V]."""
    with torch.no_grad():
        out = target(input_ids=batch, output_hidden_states=True)
        return torch.cat([out.hidden_states[i] for i in head.aux_layers], dim=-1), out.logits.float()


def unrolled(head: Eagle3Head, batch: torch.Tensor, feats: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """The head's draft-vocabulary logits at each training-time-test step -> steps x [B, S-1, dv]: entry t
    of step j predicts token t + 2 from a chain begun at t - j (valid where t >= j)."""
    B, S = batch.shape
    T = S - 1
    tokens = batch[:, 1:]  # [B, T] x_{t+1}
    positions = torch.arange(T, device=batch.device).unsqueeze(0)
    f = head.fuse(feats[:, :-1])  # [B, T, H]
    cache, out = _Steps(), []
    for j in range(steps):
        mask = step_mask(T, j, batch.device)[None, None]  # [1, 1, T, (j+1) T]
        prenorm = head.layer_output(tokens, f, mask, positions, cache)  # [B, T, H]
        out.append(head.draft_logits(prenorm))
        f = torch.cat([torch.zeros_like(prenorm[:, :1]), prenorm[:, :-1]], dim=1)  # t reads its chain's output at t-1
    return out


def ttt_loss(target: PreTrainedModel, head: Eagle3Head, steps: int):
    """batch [B, S] -> the training-time-test loss (module doc)."""

    def loss(batch: torch.Tensor) -> torch.Tensor:
        feats, p_logits = target_features(target, head, batch)
        logp = F.log_softmax(p_logits[:, 1:][..., head.target_ids()], -1)  # [B, T, dv]
        total = 0.0
        for j, q_logits in enumerate(unrolled(head, batch, feats, steps)):
            logq = F.log_softmax(q_logits.float(), -1)
            kl = (logp.exp() * (logp - logq)).sum(-1)[:, j:]  # [B, T - j]: chains that begin inside the window
            total = total + STEP_DECAY**j * kl.mean()
        return total

    return loss


@torch.no_grad()
def evaluate_head(target, head: Eagle3Head, heldout: Heldout, steps: int) -> dict:
    """On held-out text (or conversations' answers: specdec.training.heldout_batches), per training-time-test step j
    (a token drafted j + 1 deep): greedy alpha (the head's argmax is the target's, over the full vocabulary) and
    KL(p || q) over the draft vocabulary."""
    alpha, kl = [Totals() for _ in range(steps)], [Totals() for _ in range(steps)]
    for batch in heldout_batches(heldout, target.device):
        feats, p_logits = target_features(target, head, batch.tokens)
        want = p_logits[:, 1:].argmax(-1)  # [B, T]: entry t is position t + 1's
        logp = F.log_softmax(p_logits[:, 1:][..., head.target_ids()], -1)
        for j, q_logits in enumerate(unrolled(head, batch.tokens, feats, steps)):
            got = head.target_ids()[q_logits.argmax(-1)]
            alpha[j].add(batch, (got == want)[:, j:].float(), offset=1 + j)  # [B, T - j]: chains begun inside
            logq = F.log_softmax(q_logits.float(), -1)
            kl[j].add(batch, (logp.exp() * (logp - logq)).sum(-1)[:, j:], offset=1 + j)
    return {"greedy_alpha": [a.mean() for a in alpha], "kl": [k.mean() for k in kl]}


def train_head(target: PreTrainedModel, tokenizer, out_dir: str | Path, tokens: torch.Tensor, heldout: Heldout,
               draft_vocab_size: int, cfg: TrainConfig = TrainConfig(), ttt_steps: int = 3, resume: bool = False,
               on_step=None) -> dict:
    """Train an EAGLE-3 head for `target` on a token stream and save it (EAGLE-3's layout, with the tokenizer)
    to out_dir; resumable from out_dir/checkpoint. -> a summary with held-out alpha before and after"""
    if ttt_steps < 1:
        raise ValueError(f"ttt_steps must be >= 1, got {ttt_steps}")
    V = target.config.get_text_config().vocab_size
    if not 1 <= draft_vocab_size <= V:
        raise ValueError(f"draft_vocab_size must be in 1..{V} (the target's vocabulary), got {draft_vocab_size}")
    check_corpus(tokens, heldout, cfg.seq_len)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    target.eval().requires_grad_(False)
    torch.manual_seed(cfg.seed)
    head = new_head(target, frequent_tokens(tokens, V, draft_vocab_size))
    trained_for = {"target": target_digest(target), "kind": "eagle3", "draft_vocab": draft_vocab_size,
                   "aux_layers": list(head.aux_layers)}
    resume_weights(head, out / "checkpoint", resume, trained_for, cfg.steps)
    before = evaluate_head(target, head, heldout, ttt_steps)
    result = train(head, ttt_loss(target, head, ttt_steps), tokens, cfg, out / "checkpoint", resume, "distill-head",
                   on_step, trained_for)
    after = evaluate_head(target, head, heldout, ttt_steps)
    save_head(head, out)
    tokenizer.save_pretrained(out)
    summary = {"out": str(out), **result, "before": before, "after": after, "draft_vocab_size": draft_vocab_size,
               "aux_layers": list(head.aux_layers), "head_params": sum(p.numel() for n, p in head.named_parameters()
                                                                      if not n.startswith("embed_tokens."))}
    (out / "distill_summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def new_medusa(target: PreTrainedModel, num_heads: int, num_layers: int = 1) -> MedusaHeads:
    """Fresh Medusa heads for the target: blocks at zero (each head starts as the target's LM head, which they
    share and do not train)."""
    tc = target.config.get_text_config()
    heads = MedusaHeads(tc.hidden_size, tc.vocab_size, num_heads, num_layers, shared_lm_head=True)
    with torch.no_grad():
        for block in heads.blocks:
            for layer in block.layers:
                layer.weight.zero_()
        heads.lm_heads[0].weight.copy_(dense_weight(target.get_output_embeddings())[: tc.vocab_size])
    heads.lm_heads.requires_grad_(False)
    heads.target_layers = tc.num_hidden_layers
    return heads.to(target.device, target.dtype)


def _medusa_pass(target, heads: MedusaHeads, batch: torch.Tensor):
    """-> the target's log p [B, S, V] and each head's log q [B, S, V] at every position."""
    with torch.no_grad():
        out = target(input_ids=batch, output_hidden_states=True)
        logp = F.log_softmax(out.logits.float(), -1)
    logq = [F.log_softmax(q.float(), -1) for q in heads.head_logits(out.hidden_states[-1])]
    return logp, logq


def medusa_loss(target: PreTrainedModel, heads: MedusaHeads):
    """batch [B, S] -> sum over heads i of 0.8^i KL(p at t + 1 + i || head i at t)."""

    def loss(batch: torch.Tensor) -> torch.Tensor:
        logp, logq = _medusa_pass(target, heads, batch)
        total = 0.0
        for i, q in enumerate(logq):
            p = logp[:, 1 + i :]  # the target's distribution i + 1 positions on
            kl = (p.exp() * (p - q[:, : p.shape[1]])).sum(-1)
            total = total + STEP_DECAY**i * kl.mean()
        return total

    return loss


@torch.no_grad()
def evaluate_medusa(target, heads: MedusaHeads, heldout: Heldout) -> dict:
    """On held-out text (or conversations' answers), per head: greedy alpha (its argmax is the target's argmax i + 1
    positions on) and KL."""
    alpha, kl = [Totals() for _ in range(heads.num_heads)], [Totals() for _ in range(heads.num_heads)]
    for batch in heldout_batches(heldout, target.device):
        logp, logq = _medusa_pass(target, heads, batch.tokens)
        for i, q in enumerate(logq):
            p = logp[:, 1 + i :]  # entry t is position t + 1 + i's
            q = q[:, : p.shape[1]]
            alpha[i].add(batch, (p.argmax(-1) == q.argmax(-1)).float(), offset=1 + i)
            kl[i].add(batch, (p.exp() * (p - q)).sum(-1), offset=1 + i)
    return {"greedy_alpha": [a.mean() for a in alpha], "kl": [k.mean() for k in kl]}


def train_medusa(target: PreTrainedModel, tokenizer, out_dir: str | Path, tokens: torch.Tensor, heldout: Heldout,
                 num_heads: int = 4, num_layers: int = 1, cfg: TrainConfig = TrainConfig(), resume: bool = False,
                 on_step=None) -> dict:
    """Train Medusa heads for `target` on a token stream and save them (vLLM's layout, with the tokenizer) to
    out_dir; resumable. -> a summary with held-out alpha per head before and after"""
    check_corpus(tokens, heldout, cfg.seq_len)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    target.eval().requires_grad_(False)
    torch.manual_seed(cfg.seed)
    heads = new_medusa(target, num_heads, num_layers)
    trained_for = {"target": target_digest(target), "kind": "medusa", "heads": num_heads, "layers": num_layers}
    resume_weights(heads, out / "checkpoint", resume, trained_for, cfg.steps)
    before = evaluate_medusa(target, heads, heldout)
    result = train(heads, medusa_loss(target, heads), tokens, cfg, out / "checkpoint", resume, "distill-medusa", on_step,
                   trained_for)
    after = evaluate_medusa(target, heads, heldout)
    save_medusa(heads, out)
    tokenizer.save_pretrained(out)
    summary = {"out": str(out), **result, "before": before, "after": after, "num_heads": num_heads,
               "head_params": sum(p.numel() for p in heads.blocks.parameters())}
    (out / "distill_summary.json").write_text(json.dumps(summary, indent=2))
    return summary
