"""What a suffix draft costs beside one depth of a draft model, at batch 1, on the bench pair's prompts
(the multi-turn workload's contexts, from plain greedy answers): python -m tools.bench.suffix_cost
(from the repository root; ../shared beside it). Prints the median microseconds per proposal of each."""
import statistics
import time

import torch

from specdec import CachedLM, SpecConfig, SpeculativeEngine
from specdec.drafters import ModelDrafter, Plan, SuffixDrafter
from specdec.loading import load_model, load_tokenizer
from specdec.prompts import load_prompts
from specdec.sampling import SamplingParams
from specdec.workload import Conversation

GREEDY = SamplingParams()


def contexts(target, tokenizer, rows, turns: int = 3, new: int = 64) -> list[list[int]]:
    """Every turn's prompt + answer of each conversation, as the drafters see them at the end."""
    engine = SpeculativeEngine(CachedLM(target), None, SpecConfig(depth=0), eos_token_ids=set())
    out = []
    for row in rows:
        talk = Conversation.open(row, tokenizer)
        for _ in range(turns):
            answer = engine.generate([talk.ids], new)[0].token_ids
            out.append(talk.ids + answer)
            talk.answer(answer, tokenizer)
    return out


def per_proposal(drafter, seqs: list[list[int]], plan: Plan, fresh: bool) -> list[float]:
    """Seconds of each propose() over every prefix of the last 32 tokens of each context, one row at a time."""
    times = []
    for seq in seqs:
        drafter.start(1)
        if fresh:
            drafter.propose([seq[:-32]], [Plan()], [GREEDY], [None])  # the row's text before the timed steps
        for end in range(len(seq) - 32, len(seq)):
            t0 = time.perf_counter()
            drafter.propose([seq[:end]], [plan], [GREEDY], [None])
            times.append(time.perf_counter() - t0)
            drafter.commit([[0]])
    return times


def main() -> None:
    torch.set_num_threads(1)
    target, draft = load_model("../shared/bench-models/target"), load_model("../shared/bench-models/draft")
    tokenizer = load_tokenizer("../shared/bench-models/target")
    seqs = contexts(target, tokenizer, load_prompts("../shared/prompts/public.jsonl", 2, tokenizer))
    suffix = per_proposal(SuffixDrafter(), seqs, Plan(0, 16), fresh=True)
    model = per_proposal(ModelDrafter(CachedLM(draft)), seqs, Plan(1, 0), fresh=True)
    print(f"contexts: {len(seqs)}, {min(map(len, seqs))}-{max(map(len, seqs))} tokens; torch threads 1")
    print(f"suffix draft (up to 16 nodes): median {statistics.median(suffix) * 1e6:.0f} us, "
          f"p90 {sorted(suffix)[int(0.9 * len(suffix))] * 1e6:.0f} us")
    print(f"draft model, one depth:        median {statistics.median(model) * 1e6:.0f} us, "
          f"p90 {sorted(model)[int(0.9 * len(model))] * 1e6:.0f} us")


if __name__ == "__main__":
    main()
