"""`specdec bench`: every mode over the same prompts in one process and one run, side by side.

Modes run interleaved prompt by prompt (so drift in machine speed hits all alike), after one
warm-up generation each. Every mode runs the models as specdec serves them (on a CPU, their linear layers
through oneDNN's packed weights: specdec.cpu_linear). `plain` is transformers' own generate() without
speculation; `off` is specdec's own loop without it (what a request served with speculation off gets); `hf-*` are
transformers' assisted modes, the peer. Speedup is tokens/s over plain's, per task type, and over off's where off
ran."""

import contextlib
import json
import re
import signal
import sys
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from .compute import on_compute
from .cpu_linear import serve_draft_linears
from .drafter_factory import draft_runner, make_drafter
from .drafters import logit_columns
from .engine import SpecConfig, SpeculativeEngine
from .kvcache import CachedLM
from .drafter_kinds import HEAD_MODES, MAX_DEPTH, MAX_TREE_WIDTH
from .loading import (check_draft_tokenizer, eos_ids, load_draft, load_model, load_served_model, load_tokenizer,
                      parse_dtype)
from .plain import hf_generate
from .prompts import load_prompts
from .sampling import SamplingParams
from .suffix import TextIndex, read_corpus
from .workload import Conversation, rows_for, turns_of


@dataclass
class Tally:
    tokens: int = 0
    seconds: float = 0.0
    accepted: int = 0
    tried: int = 0
    steps: int = 0
    identical: bool = True

    def add(self, tokens: int, seconds: float, stats, identical: bool) -> None:
        """One generation: its tokens, wall time, speculation stats (None for transformers' modes)."""
        self.tokens += tokens
        self.seconds += seconds
        self.identical &= identical
        if stats is not None:
            self.accepted += stats.accepted
            self.tried += stats.tried_depths
            self.steps += stats.steps

    def merge(self, other: "Tally") -> None:
        self.tokens += other.tokens
        self.seconds += other.seconds
        self.accepted += other.accepted
        self.tried += other.tried
        self.steps += other.steps
        self.identical &= other.identical


@contextlib.contextmanager
def stop_as_interrupt():
    """SIGTERM (what `timeout` sends) raises KeyboardInterrupt in the main thread while the bench runs, so a run
    cut short still prints what it measured."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:  # None: a handler installed outside Python, which Python cannot put back
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


@dataclass
class Mode:
    name: str
    run: callable  # prompt ids -> (new token ids, stats or None)
    tallies: dict = field(default_factory=lambda: defaultdict(Tally))


def engine_mode(name, target, drafter, config, eos, max_new, params):
    engine = SpeculativeEngine(CachedLM(target), drafter, config, eos)

    def run(prompt):
        g = engine.generate([prompt], max_new, params)[0]
        return g.token_ids, g.stats

    return Mode(name, run)


def hf_mode(name, target, eos, max_new, params, **kwargs):
    """transformers' own generate() (specdec.plain): `plain` without kwargs, an assisted mode with them."""
    sampling = {} if params.greedy else {"do_sample": True, "temperature": params.temperature,
                                         "top_k": params.top_k or None, "top_p": params.top_p}

    def run(prompt):
        if not params.greedy:
            torch.manual_seed(params.seed or 0)
        # on the thread the engine's forwards run on (specdec.compute), with the same torch threads
        return on_compute(target.device, hf_generate, target, prompt, max_new, sorted(eos), **sampling, **kwargs), None

    return Mode(name, run)


ENGINE_MODES = ("off", "chain-k4", "tree-2x4", "ngram-k8", "ngram-auto", "suffix-k16", "suffix-auto", "model+suffix-k4",
                "model+ngram-k4", "auto", "model+ngram-auto")  # build_modes' without heads or a corpus
HF_MODES = ("hf-assisted", "hf-prompt-lookup")  # transformers' own assisted decoding, the peer


def assistant_model(path: str, draft, dtype: torch.dtype, device: str, quantization: str):
    """The draft as transformers' assisted generation (hf-assisted) takes it: with logits over the target's whole
    vocabulary. A draft cut to its frequent tokens (specdec.draft_vocab) has logits over those alone, so the peer
    gets the draft loaded again whole, as transformers' users run it, its linear layers as ours (quantization)."""
    if logit_columns(draft) is None:
        return draft
    return on_compute(device, lambda: serve_draft_linears(load_model(path, dtype, device), quantization, device))


def wants(only: set[str] | None, mode: str) -> bool:
    return only is None or mode in only


def build_modes(target, draft, eos, max_new, params, only: set[str] | None, corpus: TextIndex | None = None,
                head=None, assistant=None):
    """assistant: the draft for hf-assisted where the draft's own logits do not cover the whole vocabulary
    (assistant_model)."""
    if wants(only, "hf-assisted") and assistant is None:
        if logit_columns(draft) is not None:
            raise ValueError("hf-assisted needs the draft over the whole vocabulary (assistant_model); this one drafts "
                             "among its frequent tokens")
        assistant = draft

    def dlm():
        return CachedLM(draft)

    def hlm():
        return draft_runner(head)

    def shaped_spec(name: str):
        on_head, width, depth = shaped(name)
        return lambda: (make_drafter("head", hlm(), width) if on_head else make_drafter("model", dlm(), width),
                        SpecConfig(depth=depth))

    specs = {
        "off": lambda: (None, SpecConfig(depth=0)),  # specdec's own plain decoding: its loop, speculation off
        "ngram-k8": lambda: (make_drafter("ngram", None), SpecConfig(depth=8)),
        "ngram-auto": lambda: (make_drafter("ngram", None), SpecConfig(depth=None)),
        "suffix-k16": lambda: (make_drafter("suffix", None), SpecConfig(depth=16)),
        "suffix-auto": lambda: (make_drafter("suffix", None), SpecConfig(depth=None, max_depth=16)),
        "model+suffix-k4": lambda: (make_drafter("model+suffix", dlm(), 1), SpecConfig(depth=4)),
        "model+ngram-k4": lambda: (make_drafter("model+ngram", dlm(), 1), SpecConfig(depth=4)),
        "auto": lambda: (make_drafter("model", dlm(), 1), SpecConfig(depth=None)),
        "model+ngram-auto": lambda: (make_drafter("model+ngram", dlm(), 1), SpecConfig(depth=None)),
    }
    # shaped modes: the defaults, and any other shape asked for by name (a head's where there is a head)
    defaults = ("chain-k4", "tree-2x4", *(("head-k4", "head-tree-2x4") if head is not None else ()))
    specs |= {name: shaped_spec(name) for name in (*defaults, *(only or ()))
              if (shape := shaped(name)) and (head is not None or not shape[0])}
    if head is not None:  # HEAD_MODES: an EAGLE-3 head or Medusa heads
        specs |= {
            "head-auto": lambda: (make_drafter("head", hlm(), 1), SpecConfig(depth=None)),
            "head+suffix-auto": lambda: (make_drafter("head+suffix", hlm(), 1), SpecConfig(depth=None, max_depth=16)),
        }
    if corpus is not None:  # REST: suffix drafts from the corpus too
        specs["rest-auto"] = lambda: (make_drafter("suffix", None, corpus=corpus), SpecConfig(depth=None, max_depth=16))
    hf = {
        "hf-assisted": dict(assistant_model=assistant),
        "hf-prompt-lookup": dict(prompt_lookup_num_tokens=10),
    }
    assert set(ENGINE_MODES) <= set(specs) and set(HF_MODES) == set(hf), "ENGINE_MODES, HF_MODES: every mode named"
    modes = [hf_mode("plain", target, eos, max_new, params)]
    for name, make in specs.items():
        if wants(only, name):
            modes.append(engine_mode(name, target, *make(), eos, max_new, params))
    for name, kw in hf.items():
        if wants(only, name):
            modes.append(hf_mode(name, target, eos, max_new, params, **kw))
    return modes


SHAPED_MODE = re.compile(r"(?:(?P<chain>chain|head)-k(?P<k>\d+)|(?P<head>head-)?tree-(?P<width>\d+)x(?P<depth>\d+))")


def shaped(name: str) -> tuple[bool, int, int] | None:
    """A mode named by its tree's shape -> (drafted by the head, width, depth): chain-kK and tree-WxK with the draft
    model, head-kK and head-tree-WxK with the head (chain-k4, tree-2x4, head-k4, head-tree-2x4 run by default; any
    other shape when named). None for other names."""
    m = SHAPED_MODE.fullmatch(name)
    if m is None:
        return None
    if m["chain"]:
        return m["chain"] == "head", 1, int(m["k"])
    return m["head"] is not None, int(m["width"]), int(m["depth"])


def _bad_shape(name: str, width: int, depth: int) -> str | None:
    """Why a shaped mode cannot run (a width or depth past the served bounds), or None."""
    if not (1 <= width <= MAX_TREE_WIDTH and 1 <= depth <= MAX_DEPTH):
        return f"mode {name}: a tree's width must be in 1..{MAX_TREE_WIDTH} and its depth in 1..{MAX_DEPTH}"
    return None


def modes_asked(args) -> set[str] | None:
    """The modes `--modes` names (None: all), checked before any model loads: ValueError naming each one this
    run cannot run, and why."""
    if not args.modes:
        return None
    only = {m.strip() for m in args.modes.split(",") if m.strip()}
    shapes = {m: shape for m in only if (shape := shaped(m))}
    if bad := [why for m, (_, w, d) in sorted(shapes.items()) if (why := _bad_shape(m, w, d))]:
        raise ValueError("; ".join(bad))
    head_shapes = [m for m, (on_head, _, _) in shapes.items() if on_head]
    needs = {**dict.fromkeys((*HEAD_MODES, *head_shapes), "--head DIR"), "rest-auto": "--corpus PATH"}
    ready = {"plain", *ENGINE_MODES, *HF_MODES, *(HEAD_MODES if args.head else ()),
             *(("rest-auto",) if args.corpus else ()), *(m for m in shapes if args.head or m not in head_shapes)}
    unknown = sorted(m for m in only - ready if m not in needs)
    if unknown:
        raise ValueError(f"unknown modes {', '.join(unknown)}; the modes: {', '.join(sorted(ready | set(needs)))}, "
                         "and any shape as chain-kK, tree-WxK, head-kK, head-tree-WxK")
    if only - ready:
        raise ValueError("; ".join(f"mode {m} needs {needs[m]}" for m in sorted(only - ready)))
    return only


@torch.inference_mode()
def run_bench(args) -> None:
    if args.draft is None:
        raise ValueError("bench compares drafters: give --draft DIR (or neither --target nor --draft: the default pair)")
    params = SamplingParams(temperature=args.temperature, seed=args.seed)
    dtype = parse_dtype(args.dtype)
    tokenizer = load_tokenizer(args.target)
    check_draft_tokenizer(tokenizer, args.draft)
    target = load_served_model(args.target, dtype, args.device)  # every mode runs the models as served
    draft_dtype = parse_dtype(args.draft_dtype or args.dtype)
    q = args.draft_quantization
    draft = load_draft(args.draft, target, draft_dtype, args.device, served=True, quantization=q)
    head = load_draft(args.head, target, draft_dtype, args.device, served=True, quantization=q) if args.head else None
    eos = eos_ids(target.generation_config, tokenizer)
    only = modes_asked(args)
    corpus = None
    if args.corpus:
        corpus = read_corpus(args.corpus, lambda text: tokenizer(text, add_special_tokens=False)["input_ids"],
                             args.corpus_max_tokens)
        only = only | {"rest-auto"} if only is not None else None
    if head is not None and only is not None:
        only |= set(HEAD_MODES)
    assistant = (assistant_model(args.draft, draft, draft_dtype, args.device, q) if wants(only, "hf-assisted")
                 else None)
    modes = build_modes(target, draft, eos, args.max_new_tokens, params, only, corpus, head, assistant)
    rows = rows_for(args.workload, load_prompts(args.prompts, args.limit, tokenizer), tokenizer)
    turns = turns_of(args.workload, args.turns)
    # each mode holds its own conversations: a turn's prompt carries that mode's earlier outputs
    talks = {mode.name: [Conversation.open(r, tokenizer) for r in rows] for mode in modes}

    for mode in modes:  # warm-up (auto K starts measuring costs here), not timed
        mode.run(talks[mode.name][0].ids[:64])
    done = 0
    with tqdm(total=len(rows) * len(modes) * turns, desc="bench", file=sys.stderr) as bar, stop_as_interrupt():
        try:
            for i, row in enumerate(rows):
                measured = {mode.name: Tally() for mode in modes}  # this prompt's, counted once every mode ran it
                for _ in range(turns):
                    reference = None
                    for mode in modes:
                        talk = talks[mode.name][i]
                        t0 = time.perf_counter()
                        tokens, stats = mode.run(talk.ids)
                        reference = tokens if mode.name == "plain" else reference
                        measured[mode.name].add(len(tokens), time.perf_counter() - t0, stats, tokens == reference)
                        talk.answer(tokens, tokenizer)
                        bar.update()
                for mode in modes:
                    mode.tallies[row["task_type"]].merge(measured[mode.name])
                done += 1
        except KeyboardInterrupt:  # Ctrl-C, or SIGTERM from a timeout: report the prompts every mode finished
            if not done:
                raise
            bar.write(f"# stopped: the table holds the first {done} of {len(rows)} prompts, every mode over the "
                      "same ones", file=sys.stderr)

    result = report_rows(modes, params)
    print_table(result, args)
    if args.plot:
        plot(result, args.plot, args)
    if args.json:
        print(json.dumps({"rows": result, "prompts": done, "of": len(rows)}))


def report_rows(modes: list[Mode], params: SamplingParams) -> list[dict]:
    """speedup: over `plain` (transformers' generate()); speedup_over_off: over `off` (specdec's own loop without
    speculation, what a served request gets with speculation off) where `off` ran."""
    plain = modes[0].tallies
    off = next((mode.tallies for mode in modes if mode.name == "off"), {})
    out = []
    for mode in modes:
        for task, t in sorted(mode.tallies.items()):
            tps = t.tokens / t.seconds
            over_off = round(tps / (off[task].tokens / off[task].seconds), 3) if task in off else None
            is_engine = mode.name != "plain" and not mode.name.startswith("hf-")
            out.append({
                "mode": mode.name,
                "task_type": task,
                "tokens_per_s": round(tps, 2),
                "alpha": round(t.accepted / t.tried, 4) if is_engine and t.tried else None,
                "mean_accepted_length": round(t.tokens / t.steps, 3) if is_engine and t.steps else None,
                "speedup": round(tps / (plain[task].tokens / plain[task].seconds), 3),
                "speedup_over_off": over_off,
                "identical_to_plain": t.identical if params.greedy and mode.name != "plain" else None,
            })
    return out


def print_table(rows: list[dict], args) -> None:
    print(f"# specdec bench: {args.target} / {args.draft}, {args.prompts}, workload={args.workload} "
          f"({turns_of(args.workload, args.turns)} turns), max_new_tokens={args.max_new_tokens}, "
          f"temperature={args.temperature}, dtype={args.dtype}, draft dtype={args.draft_dtype or args.dtype}, "
          f"draft quantization={args.draft_quantization}, device={args.device}, "
          f"torch threads={on_compute(args.device, torch.get_num_threads)}")  # the models' thread's
    with_off = any(r["speedup_over_off"] is not None for r in rows)
    print(f"{'mode':<18} {'task':<6} {'tok/s':>8} {'alpha':>6} {'acc.len':>7} {'speedup':>7}"
          f"{' vs off' if with_off else ''} identical")
    for r in rows:
        fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
        over_off = f" {r['speedup_over_off']:>5.2f}x" if with_off else ""
        print(f"{r['mode']:<18} {r['task_type']:<6} {r['tokens_per_s']:>8.1f} {fmt(r['alpha'], '.3f'):>6} "
              f"{fmt(r['mean_accepted_length'], '.2f'):>7} {r['speedup']:>6.2f}x{over_off} {fmt(r['identical_to_plain'], '')}")


def plot(rows: list[dict], path: str, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(dict.fromkeys(r["mode"] for r in rows))
    tasks = list(dict.fromkeys(r["task_type"] for r in rows))
    fig, ax = plt.subplots(figsize=(1.2 * len(modes) + 2, 4))
    width = 0.8 / len(tasks)
    for i, task in enumerate(tasks):
        vals = [next((r["speedup"] for r in rows if r["mode"] == m and r["task_type"] == task), 0) for m in modes]
        ax.bar([x + i * width for x in range(len(modes))], vals, width, label=task)
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_xticks([x + width * (len(tasks) - 1) / 2 for x in range(len(modes))], modes, rotation=30, ha="right")
    ax.set_ylabel("speedup over plain decoding")
    ax.set_title(f"specdec bench, T={args.temperature}, {args.max_new_tokens} new tokens")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
