"""Where a speculative step's time goes, on any device: for each `specdec bench` mode, the wall time of a step
against the target's and the drafter's forwards inside it, and what is left (trees, acceptance, the loops'
hand-offs). A forward's time is split into host time (until the call returns: transformers' modules in Python,
specdec's attention and block tables, the kernel launches) and, on a GPU, the wait for its kernels after it.
Where host time is nearly all of it, a forward costs the same whatever its layers do, and fewer forwards or
CUDA graphs are the lever, not faster kernels.

`--twin` runs the same modes on the models' width-shrunk twins: the same families, layers, attention heads and
vocabularies, a head size of 8 and random weights (a draft head's twin keeps its draft vocabulary and the layers it
reads), so a step's arithmetic is almost nothing and what it costs is the host's floor: the modules in Python,
specdec's trees, plans and hand-offs. Beside the real models' split it says how much of a step no faster kernel
can take. Random weights accept different drafts, so compare a fixed shape's ms a step (chain-k4, head-k4), not
tokens a step.

On a GPU each forward is followed by a synchronize, so no forward overlaps the next one's launches. Wall time a
step is then a little above the bench's, so compare tokens/s with `specdec bench`.

    python -m tools.bench.step_profile --target DIR --draft DIR [--head DIR] [--device cuda] \\
        --prompts FILE [--limit N] [--modes chain-k4,ngram-k8] [--twin] [--torch-profile] [--json]
"""
import argparse
import json
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specdec.bench import assistant_model, build_modes, modes_asked, wants
from specdec.compute import on_compute, single_threaded
from specdec.drafter_kinds import DRAFT_QUANTIZATIONS
from specdec.eagle3 import Eagle3Head, head_config, save_head
from specdec.loading import check_draft_tokenizer, eos_ids, load_draft, load_served_model, load_tokenizer, parse_dtype
from specdec.prompts import load_prompts
from specdec.sampling import SamplingParams

TWIN_HEAD_SIZE = 8  # a twin's attention head size: the least the CPU kernel takes (a multiple of 8)


PREFILL_TOKENS = 32  # a forward of more query tokens than this is a prompt's prefill, counted apart


def query_tokens(args, kwargs) -> int:
    ids = kwargs.get("input_ids", args[0] if args else None)
    return ids.shape[-1] if isinstance(ids, torch.Tensor) else 0


class ForwardClock:
    """Host and device-wait seconds and calls per model (and per model's prefills), timed around each forward."""

    def __init__(self, device: torch.device):
        self.device = device
        self.host, self.wait, self.calls = Counter(), Counter(), Counter()

    def watch(self, model: torch.nn.Module, name: str) -> None:
        inner = model.forward

        def forward(*args, **kwargs):
            key = f"{name} prefill" if query_tokens(args, kwargs) > PREFILL_TOKENS else name
            t0 = time.perf_counter()
            out = inner(*args, **kwargs)
            t1 = time.perf_counter()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.host[key] += t1 - t0
            self.wait[key] += time.perf_counter() - t1
            self.calls[key] += 1
            return out

        model.forward = forward  # nn.Module.__call__ calls the instance's forward

    def reset(self) -> None:
        self.host.clear(), self.wait.clear(), self.calls.clear()


@dataclass
class StepSplit:
    """One mode over the prompts: per step (per token for plain), in milliseconds."""
    mode: str
    tokens: int
    steps: int
    wall_ms: float
    forwards: dict  # model -> {"host_ms", "wait_ms": a step's, "calls": in all}
    other_ms: float

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / self.steps


def profile_mode(mode, prompts: list[list[int]], clock: ForwardClock) -> StepSplit:
    mode.run(prompts[0][:64])  # warm-up, not counted
    clock.reset()
    tokens = steps = 0
    t0 = time.perf_counter()
    for ids in prompts:
        out, stats = mode.run(ids)
        tokens += len(out)
        steps += stats.steps if stats is not None else len(out)
    wall = time.perf_counter() - t0
    per = lambda s: round(s * 1e3 / steps, 3)  # noqa: E731
    forwards = {name: {"host_ms": per(clock.host[name]), "wait_ms": per(clock.wait[name]),
                       "calls": clock.calls[name]} for name in clock.calls}
    other = wall - sum(clock.host.values()) - sum(clock.wait.values())
    return StepSplit(mode.name, tokens, steps, per(wall), forwards, per(other))


def twin_config(config):
    """A model's config made narrow: its layers, attention heads and vocabulary, each head TWIN_HEAD_SIZE wide, an
    MLP twice the hidden size."""
    twin = config.__class__.from_dict(config.to_dict())
    text = twin.get_text_config()
    text.head_dim = TWIN_HEAD_SIZE
    text.hidden_size = text.num_attention_heads * TWIN_HEAD_SIZE
    text.intermediate_size = 2 * text.hidden_size
    return twin


def build_twins(target: str, draft: str, head: str | None, folder: str) -> tuple[str, str, str | None]:
    """The target's, the draft's and the head's twins (twin_config, random weights, seeded), written to `folder`
    and loaded back the way the models are -> their folders. A Medusa head has no twin here (ValueError)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    out = {}
    for name, path in (("target", target), ("draft", draft)):
        config = twin_config(AutoConfig.from_pretrained(path))
        AutoModelForCausalLM.from_config(config).save_pretrained(f"{folder}/{name}")
        out[name] = f"{folder}/{name}"
    out["head"] = None
    if head is not None:
        real = json.loads((Path(head) / "config.json").read_text())
        if "draft_vocab_size" not in real:
            raise ValueError(f"--twin: {head} is not an EAGLE-3 head (only those have a twin here)")
        aux = tuple(real.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids", ())) or None
        twin = Eagle3Head(head_config(AutoConfig.from_pretrained(out["target"]), real["draft_vocab_size"], aux))
        save_head(twin, f"{folder}/head")
        out["head"] = f"{folder}/head"
    return out["target"], out["draft"], out["head"]


def torch_profile(mode, ids: list[int], device: torch.device) -> str:
    """One generation under torch.profiler: its operators by self CPU time (a GPU's launches among them). The
    profiler records the operators of the thread that starts it, so on a CPU it starts on the compute thread,
    where the models run (specdec.compute)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    prof = torch.profiler.profile(activities=activities)
    on_compute(device, prof.__enter__)
    try:
        mode.run(ids)
    finally:
        on_compute(device, prof.__exit__, None, None, None)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20)


def print_split(s: StepSplit) -> None:
    parts = "  ".join(f"{name} {f['host_ms']:.2f}+{f['wait_ms']:.2f} ms x{f['calls'] / s.steps:.2f}"
                      for name, f in sorted(s.forwards.items()))
    unit = "token" if s.mode == "plain" else "step"
    print(f"{s.mode:<18} {s.tokens:>6} tokens {s.tokens_per_step:5.2f}/step  {s.wall_ms:7.2f} ms a {unit}: "
          f"{parts}  other {s.other_ms:.2f} ms")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--draft", required=True)
    p.add_argument("--head", help="draft heads' folder, for the head modes (head-k4, ...) --modes names")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--draft-quantization", choices=DRAFT_QUANTIZATIONS, default="auto",
                   help="the draft's and head's linear layers, as `specdec bench` takes it")
    p.add_argument("--prompts", required=True)
    p.add_argument("--limit", type=int, help="the first N prompts of each task type")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--modes", default="chain-k4,ngram-k8", help="`specdec bench` modes (plain always runs)")
    p.add_argument("--twin", action="store_true", help="run the models' width-shrunk twins (random weights): the "
                                                          "host's floor of each mode's step")
    p.add_argument("--torch-profile", action="store_true", help="also print torch.profiler's operator table per mode")
    p.add_argument("--json", action="store_true", help="end with one JSON line {'modes': [...]}")
    args = p.parse_args(argv)

    args.corpus = None  # modes_asked's: no corpus modes here
    single_threaded()  # the models run on the compute thread (specdec.compute), all of torch's threads theirs
    only = modes_asked(args)
    device, dtype = torch.device(args.device), parse_dtype(args.dtype)
    tokenizer = load_tokenizer(args.target)
    check_draft_tokenizer(tokenizer, args.draft)
    with tempfile.TemporaryDirectory() as folder, torch.inference_mode():
        paths = build_twins(args.target, args.draft, args.head, folder) if args.twin else (args.target, args.draft,
                                                                                            args.head)
        target = load_served_model(paths[0], dtype, args.device)
        q = args.draft_quantization
        draft = load_draft(paths[1], target, dtype, args.device, served=True, quantization=q)
        head = load_draft(paths[2], target, dtype, args.device, served=True, quantization=q) if args.head else None
        clock = ForwardClock(device)
        clock.watch(target, "target")
        clock.watch(draft, "draft")
        if head is not None:
            clock.watch(head, "head")
        assistant = assistant_model(args.draft, draft, dtype, args.device, q) if wants(only, "hf-assisted") else None
        modes = build_modes(target, draft, eos_ids(target.generation_config, tokenizer), args.max_new_tokens,
                            SamplingParams(), only, head=head, assistant=assistant)
        prompts = [tokenizer(r["prompt"])["input_ids"] for r in load_prompts(args.prompts, args.limit, tokenizer)]
        print(f"# tools.bench.step_profile: {'the twins of ' if args.twin else ''}{args.target} / {args.draft}"
              f"{' / ' + args.head if args.head else ''}, {len(prompts)} prompts of {args.prompts}, "
              f"{args.max_new_tokens} greedy tokens, {args.dtype}, device {args.device}; per forward model: "
              f"host + device wait a step, x forwards a step")
        splits = []
        for mode in modes:
            splits.append(profile_mode(mode, prompts, clock))
            print_split(splits[-1])
            if args.torch_profile:
                print(torch_profile(mode, prompts[0], device))
    if args.json:
        print(json.dumps({"modes": [asdict(s) | {"tokens_per_step": s.tokens_per_step} for s in splits]}))


if __name__ == "__main__":
    main()
