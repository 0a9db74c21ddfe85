"""The fast pair: a toy target and draft built in minutes, offline, from the Python interpreter's own
standard-library source (present wherever this project runs): a byte-level BPE tokenizer, a small Llama
target trained from scratch, and a draft distilled from it. The tests and the quick benchmarks use it (the
served default is the real model of specdec.default_models). Deterministic for a seed; cached under the
user's cache directory (XDG), keyed by everything that shapes the result."""

import hashlib
import json
import shutil
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from .cache_dir import cache_root, publish
from .distill import distill, encode_texts, remove_checkpoint, small_llama_config
from .training import TrainConfig, train

FORMAT = 2  # bump when the build changes in a way the spec does not capture (2: the chat template)
EOT = "<|endoftext|>"
# The pair knows only Python source, so a chat is rendered as Python comments, one per line, and the
# assistant's turn is the code that follows them.
CHAT_TEMPLATE = (
    "{% for m in messages %}# {{ m['role'] }}: {{ m['content'] | replace('\n', '\n# ') }}\n{% endfor %}"
    "{% if add_generation_prompt %}# assistant:\n{% endif %}"
)
HELD_OUT = ("json", "email")  # standard-library packages kept out of training, for evaluation
SKIP_DIRS = {"site-packages", "test", "tests", "idlelib", "__pycache__", "lib2to3", "turtledemo"}


@dataclass(frozen=True)
class FastSpec:
    seed: int = 0
    vocab_size: int = 4096
    target_layers: int = 3
    target_hidden: int = 192
    target_steps: int = 450
    draft_layers: int = 1
    draft_hidden: int = 128
    draft_steps: int = 250
    batch_size: int = 16
    seq_len: int = 128
    tokenizer_chars: int = 2_000_000  # source text the tokenizer is trained on
    max_files: int | None = None  # use only this many source files (reduced builds, tests)

    def key(self) -> str:
        blob = json.dumps({**asdict(self), "format": FORMAT, "python": sys.version.split()[0]}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


def fast_pair(spec: FastSpec = FastSpec(), rebuild: bool = False, root: Path | None = None, log=print) -> dict:
    """{"target": DIR, "draft": DIR}, building the pair first if it is not cached (or rebuild)."""
    out = (root or cache_root()) / f"fast-{spec.key()}"
    if rebuild:
        shutil.rmtree(out, ignore_errors=True)
    if not (out / "build.json").exists():
        log(f"specdec: building the fast model pair (once) into {out}")
        build(spec, out, log)
    else:
        log(f"specdec: fast model pair at {out}")
    return {"target": str(out / "target"), "draft": str(out / "draft")}


def stdlib_sources(max_files: int | None = None) -> tuple[list[Path], list[Path]]:
    """(training files, held-out files) of the standard library's Python source, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p for p in root.rglob("*.py")
        if not SKIP_DIRS & set(p.relative_to(root).parts[:-1])
    )
    if not files:
        raise FileNotFoundError(f"no Python standard-library source under {root}: the fast pair is built from it")
    held = [p for p in files if p.relative_to(root).parts[0] in HELD_OUT]
    train_files = [p for p in files if p not in set(held)]
    if max_files is not None:
        train_files, held = train_files[:max_files], held[: max(1, max_files // 10)]
    return train_files, held


def read_texts(files: list[Path]) -> list[str]:
    return [f.read_text(encoding="utf-8", errors="replace") for f in files]


def train_tokenizer(texts: list[str], vocab_size: int, max_chars: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE with <|endoftext|> = 0 (bos = eos), trained on the first max_chars of text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    sample, n = [], 0
    for t in texts:
        if n >= max_chars:
            break
        sample.append(t)
        n += len(t)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(sample, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOT, eos_token=EOT, chat_template=CHAT_TEMPLATE)


def target_config(spec: FastSpec, vocab: int) -> LlamaConfig:
    """The fast target: a small Llama whose bos and eos are <|endoftext|> (id 0)."""
    return small_llama_config(vocab, spec.target_layers, spec.target_hidden, max_positions=2048,
                              bos_token_id=0, eos_token_id=0, pad_token_id=None)


def build(spec: FastSpec, out: Path, log=print) -> dict:
    """Build the pair into `out` (atomically: a half-built pair is never left there)."""
    t0 = time.perf_counter()
    tmp = out.with_name(out.name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    train_files, held_files = stdlib_sources(spec.max_files)
    train_texts, held_texts = read_texts(train_files), read_texts(held_files)
    log(f"specdec: {len(train_files)} training files, {len(held_files)} held out ({', '.join(HELD_OUT)})")
    tokenizer = train_tokenizer(train_texts, spec.vocab_size, spec.tokenizer_chars)
    tokens, heldout = encode_texts(train_texts, tokenizer), encode_texts(held_texts, tokenizer)
    log(f"specdec: tokenizer {len(tokenizer)} tokens; {tokens.numel()} training tokens, {heldout.numel()} held out")

    torch.manual_seed(spec.seed)
    target = LlamaForCausalLM(target_config(spec, len(tokenizer)))
    cfg = TrainConfig(steps=spec.target_steps, batch_size=spec.batch_size, seq_len=spec.seq_len, lr=3e-3,
                      seed=spec.seed, checkpoint_every=10**9)
    pre = train(target, lambda b: target(input_ids=b, labels=b).loss, tokens, cfg, desc="target")
    target.save_pretrained(tmp / "target")
    tokenizer.save_pretrained(tmp / "target")

    dcfg = TrainConfig(steps=spec.draft_steps, batch_size=spec.batch_size, seq_len=spec.seq_len, lr=3e-3,
                       seed=spec.seed + 1, checkpoint_every=10**9)
    summary = distill(target, tokenizer, tmp / "draft", tokens, heldout, spec.draft_layers, spec.draft_hidden, dcfg)
    remove_checkpoint(tmp / "draft")
    report = {
        "spec": asdict(spec),
        "seconds": round(time.perf_counter() - t0, 1),
        "target": {"params": sum(p.numel() for p in target.parameters()), "train_loss": pre["loss"],
                   "tokens": pre["tokens"]},
        "draft": {"params": summary["draft_params"], "tokens": summary["tokens"]},
        "heldout": {"before_distillation": summary["before"], "after_distillation": summary["after"]},
    }
    publish(tmp, out, report)
    log(f"specdec: built in {report['seconds']} s; held-out greedy alpha "
        f"{summary['after']['greedy_alpha']:.3f}, sampled alpha {summary['after']['sampled_alpha']:.3f}")
    return report


__all__ = ["FastSpec", "fast_pair", "build"]
