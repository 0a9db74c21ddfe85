"""The core's commands: generate, bench, distill, draft-vocab, models (serve, client: cluster/commands.py; the `specdec`
command with all of them: tools/commands.py). Parsing imports no torch; a command imports it when it runs."""

import argparse
import json
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from .drafter_kinds import DRAFT_QUANTIZATIONS, HEAD_MODES, DrafterKind
from .workload import DEFAULT_TURNS, Workload

if TYPE_CHECKING:  # torch loads when a command runs, not to parse one
    from .training import Conversation


def parse_depth(text: str) -> int | str:
    """--num-speculative-tokens: an integer K >= 0, or 'auto' (K from what is measured, as the router chooses it)."""
    if text == "auto":
        return text
    try:
        k = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer K >= 0 or 'auto', got {text!r}") from None
    if k < 0:
        raise argparse.ArgumentTypeError(f"K must be >= 0, got {k}")
    return k


def parse_tree(text: str) -> tuple[int, int]:
    """--tree WxD: width W >= 1, depth D >= 1."""
    m = re.fullmatch(r"(\d+)x(\d+)", text)
    if not m or int(m[1]) < 1 or int(m[2]) < 1:
        raise argparse.ArgumentTypeError(f"expected WxD with W, D >= 1 (e.g. 2x4), got {text!r}")
    return int(m[1]), int(m[2])


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", help="target model folder (or hub id); default: the embedded default pair")
    p.add_argument("--draft", help="draft model folder, same tokenizer as the target, or an EAGLE-3 head's folder")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 (default float32)")
    p.add_argument("--draft-dtype", default=None, help="the draft's or heads' dtype (default: --dtype); greedy "
                   "output is the target's whatever it is")
    p.add_argument("--draft-quantization", choices=DRAFT_QUANTIZATIONS, default="auto",
                   help="the draft's or heads' linear layers on a CPU: int8 weights, none (their dtype), or auto "
                        "(int8 where this torch runs it; default), as models.draft_quantization")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda:0 (default cpu)")


def build_parser() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    """The core's commands (generate, bench, distill, models); the serving commands are added by
    cluster/commands.py and the tools' by tools/commands.py, which the `specdec` console script runs.
    -> (parser, its subcommands)"""
    parser = argparse.ArgumentParser(prog="specdec", description="Lossless speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="continue one prompt")
    add_model_args(g)
    g.add_argument("--drafter", choices=[k.value for k in DrafterKind], help="default: model+ngram with a draft, else ngram; "
                   "head and head+suffix draft with --head (docs/usage.md)")
    g.add_argument("--head", help="a draft head's folder for the target (EAGLE-3 or Medusa), for --drafter head or "
                   "head+suffix; default pair: its head, built on first use (about an hour)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=int, required=True)
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int)
    g.add_argument("--num-speculative-tokens", type=parse_depth, metavar="K|auto",
                   help="tokens drafted per step (tree depth), or auto: K from the alpha and costs measured so far "
                        "(default: auto; 4 for sampling with --seed, which only a fixed K reproduces)")
    g.add_argument("--tree", type=parse_tree, metavar="WxD", help="draft a tree W wide and D deep")
    g.add_argument("--max-depth", type=int, default=8, help="ceiling for --num-speculative-tokens auto (default 8)")
    g.add_argument("--num-samples", type=int, default=1, help="independent continuations, each its own random stream")
    g.add_argument("--json", action="store_true", help="print one JSON object")

    b = sub.add_parser("bench", help="side-by-side benchmark against plain decoding and transformers")
    add_model_args(b)
    b.add_argument("--prompts", required=True, help="JSONL rows with 'task_type' and 'prompt' text or chat 'messages' "
                        "(rendered by the target's chat template)")
    b.add_argument("--max-new-tokens", type=int, default=64)
    b.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--limit", type=int, help="use only the first N prompts of each task type")
    b.add_argument("--modes", help="comma-separated subset of modes to run (plain always runs); any tree shape by "
                   "name too: chain-kK, tree-WxK, head-kK, head-tree-WxK")
    b.add_argument("--workload", choices=[w.value for w in Workload], default=Workload.SINGLE.value,
                   help="single: each prompt once; shared-prefix: each prompt once after one shared system prompt; "
                        "multi-turn: each prompt opens a conversation whose every turn resends the last prompt, its "
                        "output and a follow-up (docs/usage.md)")
    b.add_argument("--turns", type=int, default=DEFAULT_TURNS, help=f"turns per conversation of multi-turn "
                   f"(default {DEFAULT_TURNS})")
    b.add_argument("--head", help="draft heads' folder for the target (EAGLE-3 or Medusa): adds the modes "
                   + ", ".join(HEAD_MODES))
    b.add_argument("--corpus", help="a text file or folder: adds the mode rest-auto, suffix drafts that also draw "
                        "from it (REST)")
    b.add_argument("--corpus-max-tokens", type=int, default=1_000_000, help="read at most this many tokens of it")
    b.add_argument("--json", action="store_true",
                   help="end with one JSON line {'rows': [...], 'prompts': N, 'of': M} (N < M: stopped midway)")
    b.add_argument("--plot", help="write a PNG of speedup per mode and task type")

    d = sub.add_parser("distill", help="train a draft (or an EAGLE-3 head) for a target by knowledge distillation")
    d.add_argument("--target", required=True, help="target model folder")
    d.add_argument("--out", required=True, help="where to save the draft (save_pretrained), or the head (EAGLE-3's layout)")
    d.add_argument("--head", choices=["eagle3", "medusa"], help="train draft heads instead of a draft model, which "
                   "draft from the target's hidden states: an EAGLE-3 head (with EAGLE-3's training-time test) or "
                   "Medusa heads")
    d.add_argument("--draft-vocab", type=int, help="the draft vocabulary: it drafts among this many of the training "
                   "text's most frequent tokens (default 16384 for a draft model, 32000 for an EAGLE-3 head; at most the "
                   "target's vocabulary)")
    d.add_argument("--ttt-steps", type=int, default=3, help="--head eagle3: steps of the training-time test (default 3)")
    d.add_argument("--medusa-heads", type=int, default=4, help="--head medusa: heads, tokens drafted at most (default 4)")
    d.add_argument("--medusa-layers", type=int, default=1, help="--head medusa: residual layers per head (default 1)")
    d.add_argument("--corpus", nargs="*", default=[], help="text files or folders; none (and no --chat): text the "
                   "target generates")
    written = d.add_mutually_exclusive_group()
    written.add_argument("--chat", type=int, metavar="N", help="learn (also) from the target's greedy answers to N "
                         "chat prompts: instructions over the standard library and questions it poses itself "
                         "(specdec.chat_corpus); written once into --out/chat-corpus.json and read from there again. "
                         "The last 5%% are held out: the held-out alpha is then measured on their answers, each read "
                         "from its first token")
    written.add_argument("--continuations", type=int, metavar="N", help="learn from the target's greedy "
                         "continuations of N windows of --corpus (32-256 tokens each) instead of the corpus itself: for "
                         "a target without a chat template; written once into --out/continuations.json. The last 5%% "
                         "are held out and judged on their continuations, as --chat's answers")
    d.add_argument("--chat-tokens", type=int, default=192, help="--chat, --continuations: at most this many tokens "
                   "an answer")
    d.add_argument("--layers", type=int, default=1)
    d.add_argument("--hidden", type=int, default=256)
    budget = d.add_mutually_exclusive_group()
    budget.add_argument("--steps", type=int, help="training steps (deterministic; default 300)")
    budget.add_argument("--minutes", type=float, help="train for this long instead")
    d.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    d.add_argument("--batch-size", type=int, default=16)
    d.add_argument("--seq-len", type=int, default=128)
    d.add_argument("--lr", type=float, default=3e-3)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--generated-tokens", type=int, default=200_000, help="target-written tokens when no --corpus")
    d.add_argument("--dtype", default="float32")
    d.add_argument("--device", default="cpu")
    d.add_argument("--json", action="store_true", help="end with the summary as one JSON line")

    v = sub.add_parser("draft-vocab", help="rank a draft model's tokens by their frequency in a corpus: it drafts "
                       "among the most frequent only (its LM head reads that share of its rows)")
    v.add_argument("--draft", required=True, help="draft model folder; the ranking is written into it "
                   "(draft_vocab.json; delete it to draft over the whole vocabulary again)")
    v.add_argument("--corpus", nargs="+", required=True, help="text files or folders of the text it will draft")
    v.add_argument("--size", type=int, default=16384, help="tokens it drafts among (default 16384)")
    v.add_argument("--max-tokens", type=int, default=5_000_000, help="count at most this many tokens of the corpus")
    v.add_argument("--json", action="store_true", help="end with one JSON line")

    m = sub.add_parser("models", help="the embedded model pairs")
    msub = m.add_subparsers(dest="models_command", required=True)
    for name, what in (("default", "the default pair: SmolLM2-135M-Instruct and a draft distilled from it"),
                       ("fast", "the fast pair: a toy target and draft trained on Python's own source (tests)")):
        md = msub.add_parser(name, help=f"build (once) and locate {what}")
        md.add_argument("--rebuild", action="store_true", help="rebuild the draft (the fast pair: both)")
        md.add_argument("--seed", type=int, default=0)
        md.add_argument("--json", action="store_true", help='end with {"target": DIR, "draft": DIR}')
        if name == "default":
            md.add_argument("--head", action="store_true",
                            help="also build (once) and locate the target's EAGLE-3 head, about an hour on 2 CPU cores")

    return parser, sub


def log(msg: str) -> None:
    print(msg, file=sys.stderr)


def resolve_models(args) -> None:
    """No --target: use the embedded default pair (built on first use)."""
    if args.target is None:
        if args.draft is not None:
            raise ValueError("--draft without --target: give both, or neither for the default pair")
        from .default_models import default_pair

        drafter = getattr(args, "drafter", None)
        head = drafter is not None and DrafterKind(drafter).uses_head and not getattr(args, "head", None)
        pair = default_pair(log=log, needs=("draft", "head") if head else ("draft",))
        args.target, args.draft = pair["target"], pair["draft"]
        if head:
            args.head = pair["head"]


def spec_config(args):
    """--num-speculative-tokens and --tree WxD -> (SpecConfig, tree width). The default is auto K, except for
    seeded sampling: auto K follows live timings, and another K draws other random numbers, so only a
    fixed K makes a seeded sample reproducible (greedy output never depends on K)."""
    from .engine import SpecConfig

    k = args.num_speculative_tokens
    if k is None and not args.tree:
        k = 4 if args.temperature > 0 and args.seed is not None else "auto"
    if args.tree:
        width, depth = args.tree
        if isinstance(k, int):
            raise ValueError(
                "--num-speculative-tokens K and --tree WxD both set the depth: pass one of them, "
                "or --num-speculative-tokens auto with --tree (auto then goes up to the tree's depth)"
            )
        return SpecConfig(depth=depth if k is None else None, max_depth=depth), width
    return SpecConfig(depth=None if k == "auto" else k, max_depth=args.max_depth), 1


def cmd_generate(args) -> None:
    import torch

    from .compute import single_threaded
    from .drafter_factory import draft_runner, make_drafter
    from .engine import SpeculativeEngine
    from .kvcache import CachedLM
    from .loading import check_draft_tokenizer, eos_ids, load_draft, load_served_model, load_tokenizer, parse_dtype
    from .sampling import SamplingParams

    if args.num_samples < 1:
        raise ValueError(f"--num-samples must be >= 1, got {args.num_samples}")
    params = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    config, width = spec_config(args)
    resolve_models(args)  # may build the default pair first, with every thread
    single_threaded()  # the models run on the compute thread (specdec.compute), all of torch's threads theirs
    drafter_name = args.drafter or ("model+ngram" if args.draft else "ngram")
    dtype = parse_dtype(args.dtype)
    tokenizer = load_tokenizer(args.target)
    target = load_served_model(args.target, dtype, args.device)
    draft, kind = None, DrafterKind(drafter_name)
    path = args.head if kind.uses_head else args.draft if kind.uses_model else None
    if path:
        if kind.uses_model:
            check_draft_tokenizer(tokenizer, path)
        draft = draft_runner(load_draft(path, target, parse_dtype(args.draft_dtype or args.dtype), args.device,
                                        served=True, quantization=args.draft_quantization))
    engine = SpeculativeEngine(CachedLM(target), make_drafter(drafter_name, draft, width), config,
                               eos_ids(target.generation_config, tokenizer))
    prompt = tokenizer(args.prompt)["input_ids"]
    if not prompt:
        raise ValueError("--prompt is empty: it needs at least one token")
    M = args.num_samples
    with torch.inference_mode():
        gens = engine.generate([prompt] * M, args.max_new_tokens, params, streams=list(range(M)))
    first = gens[0]
    text = tokenizer.decode(first.token_ids, skip_special_tokens=True)
    if not args.json:
        print(text)
        print(json.dumps(first.stats.to_dict()), file=sys.stderr)
        return
    result = {"text": text, "token_ids": first.token_ids, "finish_reason": first.finish_reason,
              "stats": first.stats.to_dict()}
    if M > 1:
        result["samples"] = [
            {"text": tokenizer.decode(g.token_ids, skip_special_tokens=True), "token_ids": g.token_ids,
             "finish_reason": g.finish_reason, "stats": g.stats.to_dict()}
            for g in gens
        ]
    print(json.dumps(result))


def cmd_distill(args) -> None:
    import torch

    from .distill import corpus_files, distill, encode_texts, generated_corpus, split_conversations, split_heldout
    from .draft_vocab import DEFAULT_SIZE
    from .loading import load_model, load_tokenizer, parse_dtype
    from .training import TrainConfig

    cfg = TrainConfig(steps=None if args.minutes else (args.steps or 300), minutes=args.minutes,
                      batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr, seed=args.seed)
    tokenizer = load_tokenizer(args.target)
    parts, heldout = [], None
    if args.chat is not None:  # the target as served writes them, first; the last ones held out, judged on answers
        chat_stream, heldout = split_conversations(chat_conversations(args, tokenizer))
        parts.append(chat_stream)
    if args.corpus:
        files = corpus_files(args.corpus)
        parts.append(encode_texts([f.read_text(encoding="utf-8", errors="replace") for f in files], tokenizer))
        log(f"specdec: {len(files)} corpus files, {parts[-1].numel()} tokens")
    if args.continuations is not None:  # after the corpus they are cut from; the last ones held out
        if not args.corpus:
            raise SystemExit("specdec distill: --continuations continues windows of --corpus: name the corpus")
        continued, heldout = split_conversations(continued_corpus(args, tokenizer, parts.pop()))
        parts.append(continued)  # in the corpus's place: the windows are in it, continued as the target would
    target = load_model(args.target, parse_dtype(args.dtype), args.device)
    if parts:
        tokens = torch.cat(parts)
    else:
        log(f"specdec: no --corpus: the target writes {args.generated_tokens} tokens to learn from")
        tokens = generated_corpus(target, tokenizer, args.generated_tokens, args.seed)
    if heldout is None:
        train_tokens, heldout = split_heldout(tokens.to(target.device))
    else:
        train_tokens = tokens.to(target.device)
    if args.head:
        distill_head(args, target, tokenizer, train_tokens, heldout, cfg)
        return
    summary = distill(target, tokenizer, args.out, train_tokens, heldout, args.layers, args.hidden, cfg, args.resume,
                      draft_vocab=args.draft_vocab or DEFAULT_SIZE)
    b, a = summary["before"], summary["after"]
    log(f"specdec: draft saved to {args.out}; held-out KL {b['kl']:.3f} -> {a['kl']:.3f}, "
        f"greedy alpha {b['greedy_alpha']:.3f} -> {a['greedy_alpha']:.3f}, "
        f"sampled alpha {b['sampled_alpha']:.3f} -> {a['sampled_alpha']:.3f}")
    if args.json:
        print(json.dumps(summary))


def chat_conversations(args, tokenizer) -> "list[Conversation]":
    """--chat's training text: the target's greedy answers (specdec.chat_corpus) with their prompts, read from
    --out/chat-corpus.json when it holds the same request, else written there."""
    from .chat_corpus import chat_corpus
    from .loading import load_served_model

    if args.chat < 1 or args.chat_tokens < 1:
        raise SystemExit(f"specdec distill: --chat and --chat-tokens must be positive, got {args.chat} and "
                         f"{args.chat_tokens}")
    asked = {"target": str(Path(args.target).resolve()), "conversations": args.chat, "seed": args.seed,
             "max_tokens": args.chat_tokens}

    def write():
        log(f"specdec: the target answers {args.chat} chat prompts (greedy, at most {args.chat_tokens} tokens each)")
        return chat_corpus(load_served_model(args.target, device=args.device), tokenizer, args.chat, args.seed,
                           args.chat_tokens)

    chats = written_once(Path(args.out) / "chat-corpus.json", asked, write)
    answers = sum(len(c.tokens) - c.answer_start for c in chats)
    log(f"specdec: {len(chats)} chat answers, {answers} answer tokens ({sum(len(c.tokens) for c in chats)} with their "
        "prompts)")
    return chats


def written_once(path: Path, asked: dict, write) -> "list[Conversation]":
    """The conversations saved at `path` for the same `asked` request, else write() -> saved there."""
    from .cache_dir import write_json
    from .training import Conversation

    cached = json.loads(path.read_text()) if path.is_file() else {}
    if cached.get("asked") == asked and "answer_starts" in cached:
        return [Conversation(t, a) for t, a in zip(cached["texts"], cached["answer_starts"], strict=True)]
    texts = write()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, {"asked": asked, "texts": [c.tokens for c in texts], "answer_starts": [c.answer_start for c in texts]})
    return texts


def continued_corpus(args, tokenizer, stream) -> "list[Conversation]":
    """--continuations' training text: the target's greedy continuations of windows of the corpus's token stream
    [N], read from --out/continuations.json when it holds the same request, else written there."""
    from .chat_corpus import continuations
    from .loading import load_served_model

    if args.continuations < 2 or args.chat_tokens < 1:
        raise SystemExit(f"specdec distill: --continuations must be at least 2 (one is held out) and --chat-tokens "
                         f"positive, got {args.continuations} and {args.chat_tokens}")
    asked = {"target": str(Path(args.target).resolve()), "corpus": sorted(str(Path(c).resolve()) for c in args.corpus),
             "corpus_tokens": stream.numel(), "continuations": args.continuations, "seed": args.seed,
             "max_tokens": args.chat_tokens}

    def write():
        log(f"specdec: the target continues {args.continuations} windows of the corpus (greedy, at most "
            f"{args.chat_tokens} tokens each)")
        return continuations(load_served_model(args.target, device=args.device), tokenizer, stream, args.continuations,
                             args.seed, args.chat_tokens)

    texts = written_once(Path(args.out) / "continuations.json", asked, write)
    log(f"specdec: {sum(len(c.tokens) - c.answer_start for c in texts)} continuation tokens")
    return texts


def distill_head(args, target, tokenizer, tokens, heldout, cfg) -> None:
    from .head_training import train_head, train_medusa

    if args.head == "medusa":
        summary = train_medusa(target, tokenizer, args.out, tokens, heldout, args.medusa_heads, args.medusa_layers,
                               cfg, args.resume)
    else:
        vocab = min(args.draft_vocab or 32000, target.config.get_text_config().vocab_size)
        summary = train_head(target, tokenizer, args.out, tokens, heldout, vocab, cfg, args.ttt_steps, args.resume)
    b, a = summary["before"]["greedy_alpha"], summary["after"]["greedy_alpha"]
    fmt = lambda alphas: "/".join(f"{x:.3f}" for x in alphas)  # noqa: E731
    log(f"specdec: heads saved to {args.out}; held-out greedy alpha by depth {fmt(b)} -> {fmt(a)}")
    if args.json:
        print(json.dumps(summary))


def cmd_draft_vocab(args) -> None:
    import torch

    from .distill import corpus_files, encode_texts
    from .draft_vocab import rank_tokens, save_ranking
    from .loading import check_model, load_tokenizer, local_folder

    if args.size < 1:
        raise ValueError(f"--size must be >= 1, got {args.size}")
    config = check_model(args.draft)
    vocab = config.get_text_config().vocab_size
    files = corpus_files(args.corpus)
    tokenizer = load_tokenizer(args.draft)
    texts, chars = [], 0
    for f in files:  # the corpus's first files, up to about max_tokens (4 characters a token, read generously)
        texts.append(f.read_text(encoding="utf-8", errors="replace"))
        chars += len(texts[-1])
        if chars > 8 * args.max_tokens:
            break
    tokens = encode_texts(texts, tokenizer)[: args.max_tokens]
    ranking = rank_tokens(tokens, vocab, args.size)
    path = save_ranking(local_folder(args.draft), ranking)
    covered = float(torch.isin(tokens, ranking.kept()).float().mean()) if tokens.numel() else 0.0
    log(f"specdec: {path}: the draft ({config.model_type}, {vocab} tokens) drafts among the {ranking.size} most "
        f"frequent of {tokens.numel()} corpus tokens, which cover {covered:.1%} of them")
    if args.json:
        print(json.dumps({"path": str(path), "size": ranking.size, "vocab": vocab, "counted_tokens": tokens.numel(),
                          "covered": round(covered, 4)}))


def cmd_models(args) -> None:
    if args.models_command == "fast":
        from .fast_pair import FastSpec, fast_pair

        pair = fast_pair(FastSpec(seed=args.seed), rebuild=args.rebuild, log=log)
    else:
        from .default_models import HeadSpec, default_head, default_pair, default_spec

        pair = default_pair(default_spec(seed=args.seed), rebuild=args.rebuild, log=log)
        if args.head:
            pair["head"] = default_head(HeadSpec(seed=args.seed), rebuild=args.rebuild, log=log)
    print(json.dumps(pair) if args.json else "\n".join(f"{k + ':':7} {v}" for k, v in pair.items()))


def cmd_bench(args) -> None:
    from .bench import modes_asked, run_bench
    from .compute import single_threaded

    modes_asked(args)  # a mistyped mode is named before the default pair may be built
    resolve_models(args)  # may build the default pair first, with every thread
    single_threaded()  # the models run on the compute thread (specdec.compute), all of torch's threads theirs
    run_bench(args)


COMMANDS = {"generate": cmd_generate, "bench": cmd_bench, "distill": cmd_distill, "draft-vocab": cmd_draft_vocab,
            "models": cmd_models}


def main(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None,
         commands: dict | None = None) -> None:
    """Parse, run the command, and turn a user's error into a one-line exit naming what is wrong.
    `python -m specdec` runs the core's commands; the `specdec` script passes the serving ones too."""
    args = (parser or build_parser()[0]).parse_args(argv)
    try:
        (commands or COMMANDS)[args.command](args)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"specdec: {e}") from None


if __name__ == "__main__":
    main()
