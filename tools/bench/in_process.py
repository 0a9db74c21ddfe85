"""One request through the served loops in one process, for the benchmarks that drive them directly."""
import threading

from specdec.draft_loop import DraftLoop, DraftRequest
from specdec.sampling import SamplingParams
from specdec.scheduler import TargetScheduler


def decode(scheduler: TargetScheduler, drafts: DraftLoop, rid: str, prompt: list[int], k: int, new_tokens: int,
           params: SamplingParams = SamplingParams()) -> list[int]:
    """Decode `prompt` plainly on the scheduler (k=0) or speculatively through the draft loop, K=k deep; wait
    for it -> its tokens."""
    done, tokens = threading.Event(), []

    def sink(new, out, finished, error):
        tokens.extend(new)
        if finished:
            done.set()
    if k == 0:
        scheduler.decode(rid, prompt, params, new_tokens, set(), sink)
    else:
        first = scheduler.open(rid, prompt, params, 0, new_tokens).first
        drafts.join(DraftRequest(rid, prompt, params, new_tokens, set(), k, sink, first=first))
    done.wait()
    return tokens
