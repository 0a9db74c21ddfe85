"""Shared fixtures: tiny Llama models built and saved once per session, prompts, and reference decodes.

No model can be downloaded, so the tests make their own:
  * `target`  a random Llama (vocab 64) with a scaled-up lm_head, so its logits are peaky and greedy
              argmax never sits on a near-tie that float rounding could flip;
  * `draft`   a copy of the target with Gaussian noise on every weight: it agrees with the target
              often but not always (per-depth acceptance around one half);
  * `small_target` / `small_draft`  vocab 8, for tests that enumerate exact output distributions.
All are saved with save_pretrained and read back the real way: `target` and `draft` as the server
loads them (specdec.loading.load_served_model: linear layers packed for oneDNN), the small pair through
specdec.loading.load_model (plain nn.Linear), so the engine's tests cover both."""

import copy
import os
import random
import shutil
import threading
from dataclasses import dataclass

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from specdec.loading import load_model, load_served_model
from specdec.plain import hf_greedy_margin

VOCAB = 64
NEW_TOKENS = 24  # tokens generated in the greedy equality tests
MIN_GAP = 2e-3  # reference prompts whose greedy path has a top-1/top-2 logit gap below this are dropped
SMALL_VOCAB = 8

# The suite serves the default pair (test_example_configs, as the README's `specdec serve`): it builds the
# default draft by the reduced recipe (a minute or two, not 8 to 40: specdec.default_models.DefaultSpec.quick),
# here and in every server it starts; what it tests is the path, not the draft.
os.environ.setdefault("SPECDEC_DEFAULT_DRAFT", "quick")

# Tiny models gain nothing from intra-op threads, and on a 2-core machine shared with other work,
# spinning OpenMP threads can slow the suite down tenfold.
torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def paged_kernel_built():
    """The paged kernel is built first (on a fresh machine, about 35 s), not inside a test with a deadline, and
    every server a test starts finds it there, even one given a cache folder of its own (XDG_CACHE_HOME)."""
    from specdec import paged_kernel

    os.environ.setdefault(paged_kernel.PLACE, str(paged_kernel.kernel_dir()))
    paged_kernel.paged_attention()


@pytest.fixture(autouse=True)
def loops_end_with_their_test(monkeypatch):
    """A draft loop or target scheduler a test starts and leaves running is stopped when the test ends, draft loops
    first (they step against their target), so its thread and the models and KV it holds do not outlive the test.
    One that still has requests to step (a test that left a request open) is given two seconds and then left."""
    from specdec.draft_loop import DraftLoop
    from specdec.scheduler import TargetScheduler

    started: list = []
    for cls in (DraftLoop, TargetScheduler):
        def init(self, *args, _init=cls.__init__, **kwargs):
            _init(self, *args, **kwargs)
            started.append(self)

        monkeypatch.setattr(cls, "__init__", init)
    yield
    for loop in sorted(started, key=lambda x: not isinstance(x, DraftLoop)):
        if loop._thread.is_alive():
            with loop._cv:
                loop._stopped = True
                loop._cv.notify()
            loop._thread.join(timeout=2.0)
        if isinstance(loop, DraftLoop) and loop._verifier is not None and not loop._thread.is_alive():
            loop._verifier.shutdown(wait=False)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """The session's result is in and reported: the process ends with its exit status now, without the
    interpreter's teardown. That teardown runs while threads of Ray's core worker, gRPC and the models' compute
    thread may still be alive in native code, and it once crashed (SIGSEGV) after every test had passed, failing
    CI with nothing wrong in what the tests test. The threads still alive are named on stderr first, for
    whoever looks into what outlived its test."""
    import sys

    alive = sorted(t.name for t in threading.enumerate() if t is not threading.main_thread())
    print(f"\nthreads alive at the end of the session: {alive}", file=sys.stderr)
    sys.stdout.flush(), sys.stderr.flush()
    status = getattr(config, "_specdec_exitstatus", None)
    if status is not None:
        os._exit(int(status))


def pytest_sessionfinish(session, exitstatus):
    session.config._specdec_exitstatus = exitstatus


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


def _llama_config(vocab: int, hidden: int, init: float, max_pos: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention, as most real models
        max_position_embeddings=256,
        initializer_range=init,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def _noisy_copy(model: LlamaForCausalLM, noise: float, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    draft = copy.deepcopy(model)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * noise * p.std())
    return draft


def threads_for_new_threads(n: int) -> None:
    """torch's setting that threads started from now on take (these tests run on one, above), set from a thread
    of its own, so that the calling thread opens no team of n."""
    setter = threading.Thread(target=torch.set_num_threads, args=(n,))
    setter.start(), setter.join()


def save_tokenizer(path, words: list[str], chat_template: str | None = None) -> str:
    """A word-level tokenizer: "[UNK]" is id 0, words[i] is id i + 1."""
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", chat_template=chat_template).save_pretrained(path)
    return str(path)


SERVED_WORDS = [f"w{i}" for i in range(1, VOCAB)]  # the served target's tokenizer: "w<i>" is id i, "[UNK]" 0
CHAT_ROLES = {"system": "w61", "user": "w62", "assistant": "w63"}  # how the chat template marks each role
CHAT_TEMPLATE = (
    "{% set roles = " + str(CHAT_ROLES) + " %}{% for m in messages %}"
    "{% if m['role'] not in roles %}{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "{{ roles[m['role']] }} {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w63{% endif %}"
)


def served_target(model_dirs, root) -> str:
    """A copy of the target with a tokenizer and a chat template, as a server needs it (prompts like
    "w5 w17 w3"; chats rendered as "w62 <user's words> w63")."""
    path = shutil.copytree(model_dirs.target, root / "target")
    return save_tokenizer(path, SERVED_WORDS, CHAT_TEMPLATE)


def start_serving(config: dict, root, num_cpus: int, num_gpus: int):
    """Write `config` to root/specdec.yaml, start a local Ray cluster with num_gpus GPUs and Serve on
    the config's ports (loopback). -> the config file's path, for build_app or a Serve config. Without
    CUDA the file says its GPUs are logical (placement.logical_gpus), as `specdec serve` does then:
    otherwise the actors, given a GPU by Ray and seeing no CUDA, would refuse to start. With CUDA (the
    GPU suite) they are real."""
    import yaml

    from cluster.local import start_ray, start_serve

    path = root / "specdec.yaml"
    placement = {**config.get("placement", {}), "logical_gpus": not torch.cuda.is_available()}
    path.write_text(yaml.safe_dump({**config, "placement": placement}))
    start_ray(num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False, log_to_driver=False)
    start_serve(config["server"]["http_port"], config["server"]["grpc_port"])
    return path


@dataclass(frozen=True)
class ModelDirs:
    target: str
    draft: str
    small_target: str
    small_draft: str


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> ModelDirs:
    root = tmp_path_factory.mktemp("models")
    torch.manual_seed(0)
    target = LlamaForCausalLM(_llama_config(VOCAB, 64, 0.3, 256)).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(4.0)  # peaky logits: confident greedy choices
    draft = _noisy_copy(target, 0.05, seed=1)

    torch.manual_seed(2)
    small_target = LlamaForCausalLM(_llama_config(SMALL_VOCAB, 32, 0.2, 64)).eval()
    small_draft = _noisy_copy(small_target, 0.3, seed=3)

    dirs = {}
    for name, model in [("target", target), ("draft", draft), ("small_target", small_target), ("small_draft", small_draft)]:
        path = root / name
        model.save_pretrained(path)
        dirs[name] = str(path)
    return ModelDirs(**dirs)


@pytest.fixture(scope="session")
def target(model_dirs):
    return load_served_model(model_dirs.target)  # as served: linear layers packed (specdec.cpu_linear)


@pytest.fixture(scope="session")
def draft(model_dirs):
    return load_served_model(model_dirs.draft)


@pytest.fixture(scope="session")
def small_target(model_dirs):
    return load_model(model_dirs.small_target)


@pytest.fixture(scope="session")
def small_draft(model_dirs):
    return load_model(model_dirs.small_draft)


def make_prompts(seed: int, count: int) -> list[list[int]]:
    """Random prompts of varied lengths (1..40), a third of them built from a repeated pattern so that
    prompt lookup (n-gram) finds matches."""
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        if i % 3 == 2:
            pattern = [rng.randrange(VOCAB) for _ in range(rng.randint(2, 6))]
            n = rng.randint(8, 40)
            prompts.append((pattern * 40)[:n])
        else:
            prompts.append([rng.randrange(VOCAB) for _ in range(rng.randint(3, 40))])
    return prompts


@dataclass
class Reference:
    prompts: list[list[int]]
    continuations: list[list[int]]  # NEW_TOKENS greedy tokens of the target after each prompt


@pytest.fixture(scope="session")
def reference(target) -> Reference:
    """Prompts (a length-1 and a length-2 one among them) and the target's plain greedy continuations.
    Prompts whose greedy path passes a near-tie are dropped so that equality is a fair demand."""
    candidates = [[5], [17, 42]] + make_prompts(seed=0, count=10) + make_prompts(seed=1, count=8)
    prompts, conts = [], []
    for p in candidates:
        tokens, gap = hf_greedy_margin(target, p, NEW_TOKENS)
        if gap >= MIN_GAP:
            prompts.append(p)
            conts.append(tokens)
    print(f"\nreference: {len(prompts)} of {len(candidates)} prompts kept (lengths {sorted(map(len, prompts))})")
    assert len(prompts) >= 14, f"only {len(prompts)} prompts without near-ties"
    return Reference(prompts, conts)



# ------------------------------------------------------------------ draft heads (tests/test_heads*.py)


class NoTokenizer:
    """What the head trainers save beside their heads, for tests that have no tokenizer to save."""

    def save_pretrained(self, path):
        pass


@dataclass
class Smooth:
    model: object  # as served (linear layers packed)
    path: str  # its folder, with the served tokenizer ("w<i>" is id i)
    reference: Reference


@pytest.fixture(scope="session")
def smooth(tmp_path_factory) -> Smooth:
    """A 3-layer Llama with transformers' own initialisation (the `target` fixture, scaled up to peaky logits,
    is a function no head learns in seconds), with prompts and its plain greedy continuations (those passing
    a near-tie dropped, as `reference`)."""
    torch.manual_seed(5)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    path = tmp_path_factory.mktemp("smooth")
    model.save_pretrained(path)
    save_tokenizer(path, SERVED_WORDS, CHAT_TEMPLATE)
    model = load_served_model(str(path))
    prompts, conts = [], []
    for p in [[5], [17, 42]] + make_prompts(seed=3, count=16):
        tokens, gap = hf_greedy_margin(model, p, NEW_TOKENS)
        if gap >= MIN_GAP:
            prompts.append(p)
            conts.append(tokens)
    assert len(prompts) >= 10, len(prompts)
    return Smooth(model, str(path), Reference(prompts, conts))


@dataclass
class Trained:
    heads: object
    path: str
    summary: dict


def _sampled_text(model, seed: int) -> torch.Tensor:
    """Text the model samples at temperature 0.7 from each even token: [~3000] (what heads train on here)."""
    from specdec import CachedLM, SamplingParams, SpeculativeEngine

    engine = SpeculativeEngine(CachedLM(model), None, eos_token_ids=set())
    outs = engine.generate([[i] for i in range(0, VOCAB, 2)], 100, SamplingParams(temperature=0.7, seed=seed))
    return torch.cat([torch.tensor([i * 2] + o.token_ids) for i, o in enumerate(outs)])


@pytest.fixture(scope="session")
def trained_head(smooth, tmp_path_factory) -> Trained:
    """An EAGLE-3 head trained on text `smooth` samples, for a few seconds: it agrees with it often."""
    from specdec.eagle3 import load_head
    from specdec.head_training import train_head
    from specdec.training import TrainConfig

    tokens, out = _sampled_text(smooth.model, 0), tmp_path_factory.mktemp("eagle3")
    cut = tokens.numel() * 9 // 10
    summary = train_head(smooth.model, NoTokenizer(), out, tokens[:cut], tokens[cut:], VOCAB - 8,
                         TrainConfig(steps=150, batch_size=16, seq_len=48), ttt_steps=3)
    return Trained(load_head(out, smooth.model), str(out), summary)


@pytest.fixture(scope="session")
def trained_medusa(smooth, tmp_path_factory) -> Trained:
    """Four Medusa heads trained on text `smooth` samples, for a few seconds."""
    from specdec.head_training import train_medusa
    from specdec.medusa import load_medusa
    from specdec.training import TrainConfig

    tokens, out = _sampled_text(smooth.model, 1), tmp_path_factory.mktemp("medusa")
    cut = tokens.numel() * 9 // 10
    summary = train_medusa(smooth.model, NoTokenizer(), out, tokens[:cut], tokens[cut:], num_heads=4,
                           cfg=TrainConfig(steps=150, batch_size=16, seq_len=48))
    return Trained(load_medusa(out, smooth.model), str(out), summary)
