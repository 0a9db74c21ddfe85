"""The `specdec` command: generate, bench."""

import argparse
import json
import re
import sys

from .sampling import SamplingParams


def parse_depth(text: str) -> int | str:
    """--num-speculative-tokens: an integer K >= 0, or 'auto' (adaptive K)."""
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


def add_model_args(p: argparse.ArgumentParser, draft_required: bool = False) -> None:
    p.add_argument("--target", required=True, help="target model folder (or hub id)")
    p.add_argument("--draft", required=draft_required, help="draft model folder, same tokenizer as the target")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 (default float32)")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda:0 (default cpu)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description="Lossless speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="continue one prompt")
    add_model_args(g)
    g.add_argument("--drafter", choices=["model", "ngram", "model+ngram", "none"], help="default: model with --draft, else ngram")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=int, required=True)
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int)
    g.add_argument("--num-speculative-tokens", type=parse_depth, metavar="K|auto",
                   help="tokens drafted per step (tree depth), or auto for adaptive K (default 4)")
    g.add_argument("--tree", type=parse_tree, metavar="WxD", help="draft a tree W wide and D deep")
    g.add_argument("--max-depth", type=int, default=8, help="ceiling for --num-speculative-tokens auto (default 8)")
    g.add_argument("--num-samples", type=int, default=1, help="independent continuations, each its own random stream")
    g.add_argument("--json", action="store_true", help="print one JSON object")

    b = sub.add_parser("bench", help="side-by-side benchmark against plain decoding and transformers")
    add_model_args(b, draft_required=True)
    b.add_argument("--prompts", required=True, help="JSONL rows with 'prompt' and 'task_type'")
    b.add_argument("--max-new-tokens", type=int, default=64)
    b.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--limit", type=int, help="use only the first N prompts of each task type")
    b.add_argument("--modes", help="comma-separated subset of modes to run (plain always runs)")
    b.add_argument("--json", action="store_true", help="end with one JSON line {'rows': [...]}")
    b.add_argument("--plot", help="write a PNG of speedup per mode and task type")
    return parser


def spec_config(args):
    """--num-speculative-tokens (default 4) and --tree WxD as one SpecConfig."""
    from .engine import SpecConfig

    k = args.num_speculative_tokens
    if args.tree:
        width, depth = args.tree
        if isinstance(k, int):
            raise ValueError(
                "--num-speculative-tokens K and --tree WxD both set the depth: pass one of them, "
                "or --num-speculative-tokens auto with --tree (auto then goes up to the tree's depth)"
            )
        return SpecConfig(depth=None if k == "auto" else depth, width=width, max_depth=depth)
    return SpecConfig(depth=None if k == "auto" else 4 if k is None else k, max_depth=args.max_depth)


def cmd_generate(args) -> None:
    import torch

    from .drafters import make_drafter
    from .engine import SpeculativeEngine
    from .kvcache import CachedLM
    from .loading import check_same_vocabulary, load_model, load_tokenizer, parse_dtype

    if args.num_samples < 1:
        raise ValueError(f"--num-samples must be >= 1, got {args.num_samples}")
    params = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    config = spec_config(args)
    drafter_name = args.drafter or ("model" if args.draft else "ngram")
    dtype = parse_dtype(args.dtype)
    tokenizer = load_tokenizer(args.target)
    target = load_model(args.target, dtype, args.device)
    draft = None
    if args.draft and drafter_name in ("model", "model+ngram"):
        check_same_vocabulary(tokenizer, load_tokenizer(args.draft))
        draft = CachedLM(load_model(args.draft, dtype, args.device))
    engine = SpeculativeEngine(CachedLM(target), make_drafter(drafter_name, draft, config.width), config,
                               eos_ids(target, tokenizer))
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


def eos_ids(model, tokenizer) -> set[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    eos = tokenizer.eos_token_id if eos is None else eos
    return set(eos if isinstance(eos, list) else [] if eos is None else [eos])


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            cmd_generate(args)
        elif args.command == "bench":
            from .bench import run_bench

            run_bench(args)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"specdec: {e}") from None


if __name__ == "__main__":
    main()
