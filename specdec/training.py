"""A small training loop shared by distillation and the default target's pretraining: batches of
random windows of a token stream or of whole conversations learned on their answers (TrainData), AdamW with warm-up and cosine decay, resumable checkpoints (weights,
optimizer, step and the data sampler's random state), a progress bar with loss and tokens/s."""

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from .device import HOST
from tqdm import tqdm

CHECKPOINT = "checkpoint.pt"


@dataclass
class TrainConfig:
    steps: int | None = 200  # fixed step count (deterministic); or None with `minutes`
    minutes: float | None = None  # stop after this long (the step count then depends on the machine)
    batch_size: int = 16
    seq_len: int = 128
    lr: float = 3e-3
    warmup: float = 0.05  # fraction of steps
    weight_decay: float = 0.01
    checkpoint_every: int = 50
    seed: int = 0
    bf16: bool = False  # forward under bfloat16 autocast (much faster where the CPU has AMX; slower elsewhere)

    def __post_init__(self):
        if (self.steps is None) == (self.minutes is None):
            raise ValueError("give exactly one of steps and minutes")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.minutes is not None and self.minutes <= 0:
            raise ValueError(f"minutes must be > 0, got {self.minutes}")
        if self.batch_size < 1 or self.seq_len < 2:
            raise ValueError(f"batch_size must be >= 1 and seq_len >= 2, got {self.batch_size}, {self.seq_len}")


@dataclass
class TrainBatch:
    """What a loss reads: token rows, and which positions' next-token distributions it learns."""

    tokens: torch.Tensor  # [B, S]
    learned: torch.Tensor | None = None  # [B, S] bool: position s's distribution (of token s + 1) is learned; None: all

    def to(self, device: torch.device) -> "TrainBatch":
        """On the models' device (batches are built on the host)."""
        learned = None if self.learned is None else self.learned.to(device)
        return TrainBatch(self.tokens.to(device), learned)

    def mean(self, values: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """The mean of per-position values [B, S'] (entry t belongs to position t + offset) over learned positions."""
        total, count = self.sum(values, offset)
        return total / max(count, 1)

    def sum(self, values: torch.Tensor, offset: int = 0) -> tuple[torch.Tensor, int]:
        """-> (the sum of per-position values [B, S'] over learned positions, how many there are)"""
        if self.learned is None:
            return values.sum(), values.numel()
        mask = self.learned[:, offset : offset + values.shape[1]]
        return (values * mask.to(values.dtype)).sum(), int(mask.sum())


class TokenStream:
    """Training text as one token stream; a batch is random contiguous windows of it, every position learned."""

    def __init__(self, tokens: torch.Tensor):
        self.tokens = tokens  # [N]

    def sample(self, rows: int, seq_len: int, generator: torch.Generator) -> TrainBatch:
        return TrainBatch(sample_windows(self.tokens, rows, seq_len, generator))

    def split(self, fraction: float = 0.05) -> tuple["TokenStream", "TokenStream"]:
        """-> (training, held out: the last `fraction` of the stream)"""
        cut = int(self.tokens.numel() * (1 - fraction))
        return TokenStream(self.tokens[:cut]), TokenStream(self.tokens[cut:])

    def drafted(self) -> torch.Tensor:
        """The tokens a drafter learns to propose here [N] (their frequencies choose a draft vocabulary)."""
        return self.tokens

    def learned_tokens(self) -> int:
        return self.tokens.numel()


@dataclass
class Conversation:
    """A prompt and the target's answer, as one token list; the answer begins at `answer_start`."""

    tokens: list[int]
    answer_start: int

    def __post_init__(self):
        if not 1 <= self.answer_start < len(self.tokens):
            raise ValueError(f"an answer must start inside its conversation of {len(self.tokens)} tokens, "
                             f"got answer_start={self.answer_start}")


class Conversations:
    """Chat as it is served: a row is one conversation from its first token (the target's features read its whole
    context, as when serving), right-padded, and only the answer's positions are learned: a drafter proposes from
    the answer's second token on (the first comes from the target's prefill). A batch's rows have neighbouring
    lengths, so little of it is padding. Conversations longer than `max_len` are cut there."""

    def __init__(self, conversations: list[Conversation], max_len: int = 1024):
        if not conversations:
            raise ValueError("no conversations to train on")
        self.conversations = sorted(conversations, key=lambda c: len(c.tokens))  # by length: neighbours batch together
        self.max_len = max_len

    def sample(self, rows: int, seq_len: int, generator: torch.Generator) -> TrainBatch:
        """`rows` conversations of neighbouring lengths (seq_len is the windows'; unused here)."""
        n = len(self.conversations)
        i, offset = (int(x) for x in torch.randint(0, 2**31, (2,), generator=generator, device=HOST))
        first = min(max(0, i % n - offset % rows), max(0, n - rows))  # a run of `rows` holding the drawn one
        return self.rows(range(first, min(first + rows, n)))

    def rows(self, indices) -> TrainBatch:
        """These conversations (by index in length order) as a batch: each from its first token, right-padded (a
        causal model's real positions never see the padding after them), its answer's positions learned."""
        picked = [self.conversations[i] for i in indices]
        S = min(self.max_len, max(len(c.tokens) for c in picked))
        tokens = torch.zeros(len(picked), S, dtype=torch.long, device=HOST)
        learned = torch.zeros(len(picked), S, dtype=torch.bool, device=HOST)
        for b, c in enumerate(picked):
            row = c.tokens[:S]
            tokens[b, : len(row)] = torch.tensor(row, dtype=torch.long, device=HOST)
            learned[b, c.answer_start : len(row) - 1] = True  # positions whose next token is an answer's, from its 2nd
        return TrainBatch(tokens, learned)

    def split(self, fraction: float = 0.05) -> tuple["Conversations", "Conversations"]:
        """-> (training, held out: every 1/fraction-th conversation by length, so both span every length)"""
        if len(self.conversations) < 2:
            raise ValueError(f"{len(self.conversations)} conversation: at least 2 are needed, one to hold out")
        every = max(2, min(round(1 / fraction), len(self.conversations)))
        held = self.conversations[every - 1 :: every]
        kept = [c for i, c in enumerate(self.conversations) if i % every != every - 1]
        return Conversations(kept, self.max_len), Conversations(held, self.max_len)

    def drafted(self) -> torch.Tensor:
        """The answers' tokens [N]: what a drafter proposes here."""
        return torch.tensor([t for c in self.conversations for t in c.tokens[c.answer_start :]], dtype=torch.long,
                            device=HOST)

    def learned_tokens(self) -> int:
        return sum(len(c.tokens) - c.answer_start for c in self.conversations)


class Mixture:
    """Several sources (say chat and source code): each step's batch comes from one, chosen in proportion to the
    tokens each has to learn."""

    def __init__(self, sources: list):
        if not sources:
            raise ValueError("no training data")
        self.sources = sources
        self.weights = torch.tensor([float(s.learned_tokens()) for s in sources], device=HOST)

    def sample(self, rows: int, seq_len: int, generator: torch.Generator) -> TrainBatch:
        if len(self.sources) == 1:
            return self.sources[0].sample(rows, seq_len, generator)
        pick = int(torch.multinomial(self.weights, 1, generator=generator))
        return self.sources[pick].sample(rows, seq_len, generator)

    def split(self, fraction: float = 0.05) -> tuple["Mixture", "Mixture"]:
        parts = [s.split(fraction) for s in self.sources]
        return Mixture([p[0] for p in parts]), Mixture([p[1] for p in parts])

    def drafted(self) -> torch.Tensor:
        return torch.cat([s.drafted() for s in self.sources])

    def learned_tokens(self) -> int:
        return sum(s.learned_tokens() for s in self.sources)


TrainData = TokenStream | Conversations | Mixture


def sample_windows(tokens: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
    """tokens [N] -> batch [batch_size, seq_len] of random contiguous windows."""
    if tokens.numel() <= seq_len:
        raise ValueError(f"the corpus has {tokens.numel()} tokens: it needs more than seq_len={seq_len}")
    starts = torch.randint(0, tokens.numel() - seq_len, (batch_size,), generator=generator, device=HOST)
    return torch.stack([tokens[s : s + seq_len] for s in starts.tolist()])


def evaluation_batches(data: TrainData, device: torch.device, windows: int = 16, seq_len: int = 128,
                       conversations: int = 64, seed: int = 1234) -> list[TrainBatch]:
    """Fixed held-out batches to judge a drafter on, the same before and after training: a stream's `windows`
    random windows, or up to `conversations` conversations spread over every length (8 of neighbouring lengths a
    batch). From a mixture, its conversations when it has any (what is served), else its first source."""
    if isinstance(data, Mixture):
        chats = [s for s in data.sources if isinstance(s, Conversations)]
        data = chats[0] if chats else data.sources[0]
    if isinstance(data, TokenStream):
        seq_len = min(seq_len, data.tokens.numel() - 1)
        return [data.sample(windows, seq_len, torch.Generator(device=HOST).manual_seed(seed)).to(device)]
    every = max(1, len(data.conversations) // conversations)
    picked = Conversations(data.conversations[::every][:conversations], data.max_len)
    return [picked.rows(range(i, min(i + 8, len(picked.conversations)))).to(device)
            for i in range(0, len(picked.conversations), 8)]


class Totals:
    """Per-position values summed over several batches' learned positions, for their mean."""

    def __init__(self):
        self.total, self.count = 0.0, 0

    def add(self, batch: TrainBatch, values: torch.Tensor, offset: int = 0) -> None:
        total, count = batch.sum(values, offset)
        self.total += float(total)
        self.count += count

    def mean(self) -> float:
        return self.total / max(self.count, 1)


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    warm = max(1, int(cfg.warmup * total))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warm) / max(1, total - warm))))


@torch.enable_grad()
def train(
    model: torch.nn.Module,
    loss_fn: Callable[[TrainBatch], torch.Tensor],  # a batch -> scalar loss
    data: TrainData,
    cfg: TrainConfig,
    checkpoint_dir: str | Path | None = None,
    resume: bool = False,
    desc: str = "train",
    on_step: Callable[[int], None] | None = None,
) -> dict:
    """Train `model` in place; returns {"steps", "loss", "tokens", "seconds"}."""
    gen = torch.Generator(device=HOST).manual_seed(cfg.seed)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(0.9, 0.95))
    step, ckpt = 0, Path(checkpoint_dir) / CHECKPOINT if checkpoint_dir else None
    if resume and ckpt is not None and ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        gen.set_state(state["generator"])
        step = state["step"]
    total = cfg.steps or 10**9
    deadline = time.monotonic() + cfg.minutes * 60 if cfg.minutes else None
    model.train()
    device = next(model.parameters()).device
    t0, seen, loss_ema = time.perf_counter(), 0, None
    bar = tqdm(total=cfg.steps, initial=step, desc=desc, unit="step", mininterval=1.0)
    while step < total and (deadline is None or time.monotonic() < deadline):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg.steps or _estimated_steps(step, t0, deadline), cfg)
        batch = data.sample(cfg.batch_size, cfg.seq_len, gen).to(device)
        with torch.autocast(batch.tokens.device.type, dtype=torch.bfloat16, enabled=cfg.bf16):
            loss = loss_fn(batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        seen += batch.tokens.numel()
        loss_ema = loss.item() if loss_ema is None else 0.9 * loss_ema + 0.1 * loss.item()
        bar.update()
        bar.set_postfix(loss=f"{loss_ema:.3f}", tok_s=f"{seen / (time.perf_counter() - t0):.0f}")
        if ckpt is not None and (step % cfg.checkpoint_every == 0 or step == total):
            save_checkpoint(ckpt, model, opt, gen, step)
        if on_step is not None:
            on_step(step)
    bar.close()
    if ckpt is not None:
        save_checkpoint(ckpt, model, opt, gen, step)
    model.eval()
    return {"steps": step, "loss": loss_ema, "tokens": seen, "seconds": time.perf_counter() - t0}


def _estimated_steps(step: int, t0: float, deadline: float) -> int:
    """For a time budget: the total step count the current pace reaches (sets the LR schedule)."""
    elapsed = time.perf_counter() - t0
    if step == 0 or elapsed <= 0:
        return 10**6
    return step + int((deadline - time.monotonic()) / (elapsed / step))


def save_checkpoint(path: Path, model, opt, gen: torch.Generator, step: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "generator": gen.get_state(),
                "step": step}, tmp)
    tmp.replace(path)  # atomic: an interrupted save leaves the previous checkpoint
