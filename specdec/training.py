"""A small training loop shared by distillation and the default target's pretraining: random
windows of a token stream, AdamW with warm-up and cosine decay, resumable checkpoints (weights,
optimizer, step, the data sampler's random state and what they were trained for), a progress bar
with loss and tokens/s."""

import hashlib
import json
import logging
import math
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from .device import HOST
from tqdm import tqdm

CHECKPOINT = "checkpoint.pt"
REMEDY = "delete it or drop --resume"
log = logging.getLogger(__name__)


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


def sample_windows(tokens: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
    """tokens [N] -> batch [batch_size, seq_len] of random contiguous windows."""
    if tokens.numel() <= seq_len:
        raise ValueError(f"the corpus has {tokens.numel()} tokens: it needs more than seq_len={seq_len}")
    starts = torch.randint(0, tokens.numel() - seq_len, (batch_size,), generator=generator, device=HOST)
    return torch.stack([tokens[s : s + seq_len] for s in starts.tolist()])


@dataclass
class Conversation:
    """A prompt and the target's answer, as one token list; the answer begins at `answer_start`."""

    tokens: list[int]
    answer_start: int

    def __post_init__(self):
        if not 1 <= self.answer_start < len(self.tokens):
            raise ValueError(f"an answer must start inside its conversation of {len(self.tokens)} tokens, "
                             f"got answer_start={self.answer_start}")


@dataclass
class JudgedBatch:
    """Held-out rows, and the positions whose next-token distribution a drafter is judged on."""

    tokens: torch.Tensor  # [B, S]
    judged: torch.Tensor | None = None  # [B, S] bool: position s's distribution (of token s + 1); None: every one

    def sum(self, values: torch.Tensor, offset: int = 0) -> tuple[float, int]:
        """-> (the sum of per-position values [B, S'] over judged positions, how many); entry t is position t + offset"""
        if self.judged is None:
            return float(values.sum()), values.numel()
        mask = self.judged[:, offset : offset + values.shape[1]]
        return float((values * mask.to(values.dtype)).sum()), int(mask.sum())


Heldout = torch.Tensor | list[Conversation]  # text [M], judged everywhere; or conversations, judged on their answers


def drafted_tokens(heldout: Heldout) -> torch.Tensor:
    """The held-out tokens a drafter would propose [N]: the text, or the conversations' answers."""
    if isinstance(heldout, torch.Tensor):
        return heldout.cpu()
    return torch.tensor([t for c in heldout for t in c.tokens[c.answer_start :]], dtype=torch.long, device=HOST)


def heldout_batches(heldout: Heldout, device: torch.device, windows: int = 16, seq_len: int = 128,
                    conversations: int = 64, seed: int = 1234) -> list[JudgedBatch]:
    """Fixed held-out batches, the same before and after training. Text: `windows` random windows. Conversations:
    up to `conversations` of them spread over every length, 8 of neighbouring lengths a batch, each from its first
    token (the target's features see the whole prompt, as served) and right-padded (a causal model's positions
    never see the padding after them), judged on its answer from the second token on: what a drafter proposes
    when served (the first comes from the target's prefill)."""
    if isinstance(heldout, torch.Tensor):
        batch = sample_windows(heldout, windows, min(seq_len, heldout.numel() - 1),
                               torch.Generator(device=HOST).manual_seed(seed))
        return [JudgedBatch(batch.to(device))]
    chats = sorted(heldout, key=lambda c: len(c.tokens))
    chats = chats[:: max(1, len(chats) // conversations)][:conversations]
    return [_padded(chats[i : i + 8], device) for i in range(0, len(chats), 8)]


def _padded(chats: list[Conversation], device: torch.device) -> JudgedBatch:
    S = max(len(c.tokens) for c in chats)
    tokens = torch.zeros(len(chats), S, dtype=torch.long, device=HOST)
    judged = torch.zeros(len(chats), S, dtype=torch.bool, device=HOST)
    for b, c in enumerate(chats):
        tokens[b, : len(c.tokens)] = torch.tensor(c.tokens, dtype=torch.long, device=HOST)
        judged[b, c.answer_start : len(c.tokens) - 1] = True  # the next token is the answer's, from its second
    return JudgedBatch(tokens.to(device), judged.to(device))


class Totals:
    """Per-position values summed over several batches' judged positions, for their mean."""

    def __init__(self):
        self.total, self.count = 0.0, 0

    def add(self, batch: JudgedBatch, values: torch.Tensor, offset: int = 0) -> None:
        total, count = batch.sum(values, offset)
        self.total += total
        self.count += count

    def mean(self) -> float:
        return self.total / max(self.count, 1)


def check_corpus(tokens: torch.Tensor, heldout: Heldout, seq_len: int) -> None:
    """Refuse text too short to train on (more than seq_len tokens) or to judge on (at least 2 held out)."""
    train_n, held_n = tokens.numel(), drafted_tokens(heldout).numel()
    if train_n <= seq_len or held_n < 2:
        raise ValueError(f"the training text (--corpus) has {train_n} tokens and {held_n} are held out: training "
                         f"needs more than --seq-len={seq_len} and at least 2 held out; give a larger --corpus or a "
                         "smaller --seq-len")


def target_digest(target: torch.nn.Module) -> str:
    """A short digest of a target: its config (less where it was read from, its dtype and the transformers version)
    and 16 of its embedding rows rounded to bfloat16 (the same target in another dtype keeps its digest)."""
    config = json.dumps(_lasting(target.config.to_dict()), sort_keys=True, default=str)
    weight = target.get_input_embeddings().weight
    rows = weight[torch.linspace(0, weight.shape[0] - 1, 16, device=weight.device).long()]
    sample = rows.detach().to(HOST, torch.bfloat16).float().numpy().tobytes()
    return hashlib.sha256(config.encode() + sample).hexdigest()[:16]


def _lasting(config: dict) -> dict:
    volatile = ("_name_or_path", "dtype", "torch_dtype", "transformers_version")
    return {k: _lasting(v) if isinstance(v, dict) else v for k, v in config.items() if k not in volatile}


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    warm = max(1, int(cfg.warmup * total))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warm) / max(1, total - warm))))


@torch.enable_grad()
def train(
    model: torch.nn.Module,
    loss_fn: Callable[[torch.Tensor], torch.Tensor],  # batch [B, S] -> scalar loss
    tokens: torch.Tensor,  # [N] training token stream
    cfg: TrainConfig,
    checkpoint_dir: str | Path | None = None,
    resume: bool = False,
    desc: str = "train",
    on_step: Callable[[int], None] | None = None,
    trained_for: dict | None = None,  # saved in the checkpoint; a resumed one must match (read_checkpoint)
) -> dict:
    """Train `model` in place; returns {"steps", "loss", "tokens", "seconds"}."""
    gen = torch.Generator(device=HOST).manual_seed(cfg.seed)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(0.9, 0.95))
    step, ckpt = 0, Path(checkpoint_dir) / CHECKPOINT if checkpoint_dir else None
    if resume and ckpt is not None and ckpt.exists():
        state = read_checkpoint(ckpt, trained_for, cfg.steps)
        load_weights(model, state, ckpt)
        opt.load_state_dict(state["optimizer"])
        gen.set_state(state["generator"])
        step = state["step"]
    total = cfg.steps or 10**9
    deadline = time.monotonic() + cfg.minutes * 60 if cfg.minutes else None
    model.train()
    t0, seen, loss_ema, first = time.perf_counter(), 0, None, step
    bar = tqdm(total=cfg.steps, initial=step, desc=desc, unit="step", mininterval=1.0)
    while step < total and (deadline is None or time.monotonic() < deadline):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg.steps or estimated_steps(step, step - first, t0, deadline), cfg)
        batch = sample_windows(tokens, cfg.batch_size, cfg.seq_len, gen)
        with torch.autocast(batch.device.type, dtype=torch.bfloat16, enabled=cfg.bf16):
            loss = loss_fn(batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        seen += batch.numel()
        loss_ema = loss.item() if loss_ema is None else 0.9 * loss_ema + 0.1 * loss.item()
        bar.update()
        bar.set_postfix(loss=f"{loss_ema:.3f}", tok_s=f"{seen / (time.perf_counter() - t0):.0f}")
        if ckpt is not None and (step % cfg.checkpoint_every == 0 or step == total):
            save_checkpoint(ckpt, model, opt, gen, step, trained_for)
        if on_step is not None:
            on_step(step)
    bar.close()
    if ckpt is not None:
        save_checkpoint(ckpt, model, opt, gen, step, trained_for)
    model.eval()
    return {"steps": step, "loss": loss_ema, "tokens": seen, "seconds": time.perf_counter() - t0}


def resume_weights(model: torch.nn.Module, checkpoint_dir: str | Path, resume: bool, trained_for: dict | None = None,
                   steps: int | None = None) -> None:
    """Where a run resumes from a checkpoint, its weights into `model` now, so that what the run judges before it
    trains on (the summary's "before") is what it resumes from, not a fresh model. train() loads the checkpoint
    again, with its optimizer and sampler."""
    ckpt = Path(checkpoint_dir) / CHECKPOINT
    if resume and ckpt.exists():
        load_weights(model, read_checkpoint(ckpt, trained_for, steps), ckpt)


def read_checkpoint(ckpt: Path, trained_for: dict | None, steps: int | None) -> dict:
    """A checkpoint to resume, read as tensors and plain values only (a planted pickle runs nothing); refused if it
    was trained for another `trained_for` (another target or draft shape) or already reaches `steps` (None: a time
    budget, which a resumed run spends again)."""
    try:
        state = torch.load(ckpt, weights_only=True)
    except pickle.UnpicklingError as e:
        raise ValueError(f"{ckpt} holds more than tensors and plain values, so it is not specdec's checkpoint: "
                         f"{REMEDY}") from e
    made_for = state.get("trained_for")
    if trained_for is not None and made_for is None:
        log.warning("%s does not say what it was trained for (written by an older specdec): resuming it unchecked",
                    ckpt)
    elif trained_for is not None and made_for != trained_for:
        keys = sorted(k for k in made_for.keys() | trained_for.keys() if made_for.get(k) != trained_for.get(k))
        was, now = (", ".join(f"{k}={d.get(k)}" for k in keys) for d in (made_for, trained_for))
        what = " (target: a digest of the target's config and embedding)" if "target" in keys else ""
        raise ValueError(f"{ckpt} was trained for {was}, but this run is for {now}{what}: {REMEDY}")
    if steps is not None and state["step"] >= steps:
        raise ValueError(f"{ckpt} is at step {state['step']}, which already reaches --steps {steps}: raise --steps "
                         f"past it to train on, or {REMEDY}")
    return state


def load_weights(model: torch.nn.Module, state: dict, ckpt: Path) -> None:
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as e:
        raise ValueError(f"{ckpt} does not fit this model ({REMEDY}): {e}") from e


def estimated_steps(step: int, done: int, t0: float, deadline: float) -> int:
    """For a time budget: the total step count the current pace reaches (sets the LR schedule). `done` steps of
    `step` ran since t0 (the rest before a resume), so they set the pace."""
    elapsed = time.perf_counter() - t0
    if done == 0 or elapsed <= 0:
        return 10**6
    return step + int((deadline - time.monotonic()) / (elapsed / done))


def save_checkpoint(path: Path, model, opt, gen: torch.Generator, step: int, trained_for: dict | None = None) -> None:
    """Tensors and plain values only, so that read_checkpoint reads it with weights_only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "generator": gen.get_state(),
                "step": step, "trained_for": trained_for}, tmp)
    tmp.replace(path)  # atomic: an interrupted save leaves the previous checkpoint
