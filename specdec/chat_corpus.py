"""Chat text a target writes itself, to train a drafter for the conversations it will serve.

A drafter learns what its target says in the context it says it: EAGLE's heads are trained on the target's own
answers to chat prompts (ShareGPT, UltraChat), not on arbitrary text. With no dataset at hand, the prompts come
from two sources every machine has:
- instructions over the Python standard library: its short functions' source (explain, annotate, rewrite, test
  them), its docstrings' paragraphs (summarise, rewrite, correct them) and its modules (ask about them);
- questions the target poses itself: the chat template's user-turn prefix, sampled at temperature 1 until the
  turn ends (Magpie, arXiv 2406.08464), so the general chat a user brings is covered too.
The target then answers every prompt greedily, as it answers a greedy request when served.

A target without a chat template (a code model, a base model) is served continuations instead: `continuations`
cuts prompts out of a corpus and lets the target continue each greedily, so its drafter learns the text the target
writes after the text users send, not the corpus's own next tokens."""

import ast
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from .training import Conversation


CODE_TASKS = (
    "Explain what this code does:\n{x}",
    "Explain this function step by step:\n{x}",
    "Add type hints to this function:\n{x}",
    "Add a docstring to this function and return it:\n{x}",
    "Rewrite this function to be shorter and clearer:\n{x}",
    "Make this code more readable:\n{x}",
    "Write two unit tests for this function:\n{x}",
    "Is there a bug in this code? Explain.\n{x}",
    "What does this function return? Give an example call.\n{x}",
    "Rename the variables in this code to be more descriptive:\n{x}",
)
PROSE_TASKS = (
    "Summarize this text:\n{x}",
    "Summarize in one sentence:\n{x}",
    "Rewrite this text in plain English:\n{x}",
    "Rewrite this in a formal tone:\n{x}",
    "Rewrite this in a friendly, casual tone:\n{x}",
    "Correct the grammar and spelling of this text:\n{x}",
    "Turn this text into a list of bullet points:\n{x}",
    "Explain this to a beginner:\n{x}",
    "Write a title for this text:\n{x}",
    "What is the main point of this text?\n{x}",
)
TOPIC_TASKS = (
    "What is the Python module `{x}` for?",
    "Show me a short example that uses Python's `{x}` module.",
    "When should I use `{x}`, and when not?",
    "What are common mistakes when using `{x}`?",
    "Explain `{x}` as if I were new to Python.",
)


@dataclass(frozen=True)
class StdlibText:
    """What the instructions are made of: short functions' source, docstring paragraphs and module names."""

    functions: list[str]
    paragraphs: list[str]
    modules: list[str]


def stdlib_text(max_function_lines: int = 20) -> StdlibText:
    """Every top-level function of at most max_function_lines lines, every docstring paragraph of 120-700
    characters, and every module name, from the standard library's source (a fixed order)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    functions, paragraphs, modules = [], [], []
    for f in sorted(root.glob("*.py")):
        try:
            source = f.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        modules.append(f.stem)
        lines = source.splitlines()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Module)):
                paragraphs += _paragraphs(ast.get_docstring(node) or "")
            if isinstance(node, ast.FunctionDef) and node.col_offset == 0 and not node.name.startswith("_"):
                if 3 <= node.end_lineno - node.lineno + 1 <= max_function_lines:
                    functions.append("\n".join(lines[node.lineno - 1 : node.end_lineno]))
    if not functions or not paragraphs:
        raise FileNotFoundError(f"no Python source with docstrings under {root}: chat instructions are made from it")
    return StdlibText(functions, paragraphs, modules)


def _paragraphs(doc: str) -> list[str]:
    out = []
    for block in doc.split("\n\n"):
        text = " ".join(block.split())
        if 120 <= len(text) <= 700 and text.count(". ") >= 1 and not any(c in text for c in "{}>|=@"):
            out.append(text)
    return out


def chat_instructions(count: int, seed: int, text: StdlibText | None = None) -> list[str]:
    """`count` distinct instructions (fewer if the text runs out): code, prose and topic tasks in a 4:4:2 mix."""
    text = text or stdlib_text()
    rng = random.Random(seed)
    kinds = [(CODE_TASKS, text.functions)] * 4 + [(PROSE_TASKS, text.paragraphs)] * 4 + [(TOPIC_TASKS, text.modules)] * 2
    seen: set[str] = set()
    out: list[str] = []
    for _ in range(count * 20):
        if len(out) == count:
            break
        tasks, items = rng.choice(kinds)
        ask = rng.choice(tasks).format(x=rng.choice(items))
        if ask not in seen:
            seen.add(ask)
            out.append(ask)
    return out


def user_turn_prefix(tokenizer) -> list[int]:
    """The chat template's tokens before a user message's text (a system turn the template adds included)."""
    mark = "\x00MARK\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": mark}], tokenize=False)
    return tokenizer(text[: text.index(mark)], add_special_tokens=False)["input_ids"]


def self_posed_questions(engine, tokenizer, count: int, seed: int, max_tokens: int = 64,
                         batch: int = 64) -> list[str]:
    """`count` user messages the target writes itself at temperature 1 from the user-turn prefix (Magpie),
    distinct, each ended by the turn's end within max_tokens; fewer if it keeps repeating itself."""
    from .generation import FinishReason
    from .sampling import SamplingParams

    prefix = user_turn_prefix(tokenizer)
    out: list[str] = []
    seen: set[str] = set()
    for round_ in range(max(1, 4 * count // batch)):
        if len(out) >= count:
            break
        outs = engine.generate([prefix] * batch, max_tokens, SamplingParams(temperature=1.0, seed=seed + round_),
                               streams=list(range(batch)))
        for o in outs:
            question = tokenizer.decode(o.token_ids[:-1], skip_special_tokens=True).strip()  # the turn's end cut
            if o.finish_reason is FinishReason.STOP and len(question) >= 8 and question not in seen and len(out) < count:
                seen.add(question)
                out.append(question)
    return out


def chat_prompts(tokenizer, asks: list[str]) -> list[list[int]]:
    """Each ask as a user turn in the chat template, ready for the assistant's answer -> token lists."""
    return [tokenizer.apply_chat_template([{"role": "user", "content": a}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for a in asks]


def greedy_answers(engine, tokenizer, asks: list[str], max_tokens: int, batch: int, progress=None) -> list[Conversation]:
    """The target's greedy answers -> one conversation (prompt + answer) per ask (asks batched by length)."""
    return greedy_texts(engine, chat_prompts(tokenizer, asks), max_tokens, batch, progress)


def greedy_texts(engine, prompts: list[list[int]], max_tokens: int, batch: int, progress=None) -> list[Conversation]:
    """The target's greedy text after each prompt -> one conversation (prompt + what it wrote) per prompt, in
    the prompts' order (run in batches of neighbouring lengths). progress(rows, tokens) after each batch."""
    from .sampling import SamplingParams

    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    texts: list[Conversation | None] = [None] * len(prompts)
    for start in range(0, len(order), batch):
        rows = order[start : start + batch]
        outs = engine.generate([prompts[i] for i in rows], max_tokens, SamplingParams(temperature=0.0))
        for i, o in zip(rows, outs):
            texts[i] = Conversation(prompts[i] + o.token_ids, len(prompts[i]))
        if progress is not None:
            progress(len(rows), sum(len(o.token_ids) for o in outs))
    return texts


def chat_corpus(target, tokenizer, conversations: int, seed: int, max_tokens: int = 192,
                batch: int = 64) -> list[Conversation]:
    """The target's greedy answers to `conversations` prompts, a third of them questions it posed itself and
    the rest instructions over the standard library -> their conversations (prompt + answer), in a seeded order."""
    from tqdm import tqdm

    from .engine import SpeculativeEngine
    from .kvcache import CachedLM
    from .loading import eos_ids

    engine = SpeculativeEngine(CachedLM(target), None, eos_token_ids=eos_ids(target.generation_config, tokenizer))
    questions = self_posed_questions(engine, tokenizer, conversations // 3, seed, batch=batch)
    asks = questions + chat_instructions(conversations - len(questions), seed)
    random.Random(seed).shuffle(asks)
    with tqdm(total=len(asks), desc="target answers", unit="answer", mininterval=2.0) as bar:
        written = [0]

        def progress(rows: int, tokens: int) -> None:
            written[0] += tokens
            bar.update(rows)
            bar.set_postfix(tokens=written[0])

        return greedy_answers(engine, tokenizer, asks, max_tokens, batch, progress)


def continuation_prompts(stream: torch.Tensor, count: int, seed: int, lengths: tuple[int, int]) -> list[list[int]]:
    """`count` windows of a token stream [N], each of a length drawn from `lengths` (inclusive) at a seeded
    random start: the prompts the target continues."""
    lo, hi = lengths
    if not 1 <= lo <= hi or stream.numel() <= hi:
        raise ValueError(f"prompts of {lo}-{hi} tokens need a corpus of more than {hi} tokens, got {stream.numel()}")
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        n = rng.randint(lo, hi)
        start = rng.randrange(stream.numel() - n)
        prompts.append(stream[start : start + n].tolist())
    return prompts


def continuations(target, tokenizer, stream: torch.Tensor, count: int, seed: int, max_tokens: int = 128,
                  prompt_tokens: tuple[int, int] = (32, 256), batch: int = 64) -> list[Conversation]:
    """The target's greedy continuations of `count` windows of a corpus's token stream [N] -> one conversation
    (window + continuation) each, in the windows' seeded order. Windows end at most max_tokens before the
    target's context does."""
    from tqdm import tqdm

    from .engine import SpeculativeEngine
    from .kvcache import CachedLM
    from .loading import eos_ids

    room = target.config.get_text_config().max_position_embeddings - max_tokens
    lengths = (min(prompt_tokens[0], room), min(prompt_tokens[1], room))
    if lengths[0] < 1:
        raise ValueError(f"the target's context ({room + max_tokens} positions) leaves no room for a prompt before "
                         f"{max_tokens} new tokens")
    engine = SpeculativeEngine(CachedLM(target), None, eos_token_ids=eos_ids(target.generation_config, tokenizer))
    prompts = continuation_prompts(stream, count, seed, lengths)
    with tqdm(total=count, desc="target continues", unit="text", mininterval=2.0) as bar:
        return greedy_texts(engine, prompts, max_tokens, batch, lambda rows, tokens: bar.update(rows))


__all__ = ["chat_corpus", "chat_instructions", "chat_prompts", "continuation_prompts", "continuations", "greedy_answers",
           "greedy_texts", "self_posed_questions", "stdlib_text", "user_turn_prefix"]
