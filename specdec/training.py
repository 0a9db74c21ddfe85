"""A small training loop shared by distillation and the default target's pretraining: random
windows of a token stream, AdamW with warm-up and cosine decay, resumable checkpoints (weights,
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


def sample_windows(tokens: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
    """tokens [N] -> batch [batch_size, seq_len] of random contiguous windows."""
    if tokens.numel() <= seq_len:
        raise ValueError(f"the corpus has {tokens.numel()} tokens: it needs more than seq_len={seq_len}")
    starts = torch.randint(0, tokens.numel() - seq_len, (batch_size,), generator=generator, device=HOST)
    return torch.stack([tokens[s : s + seq_len] for s in starts.tolist()])


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
    t0, seen, loss_ema = time.perf_counter(), 0, None
    bar = tqdm(total=cfg.steps, initial=step, desc=desc, unit="step", mininterval=1.0)
    while step < total and (deadline is None or time.monotonic() < deadline):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg.steps or _estimated_steps(step, t0, deadline), cfg)
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
