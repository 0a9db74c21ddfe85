"""Draft heads served across processes: the target ships its hidden states with each verdict and, chunked to
the link's message limit, with each opened prompt (PromptFeatures); a draft replica loads the heads with no
target of its own (its config and shared embeddings read from the target's folder). Greedy output stays
plain decoding, over real gRPC and through a Ray topology of a tensor-parallel target and two replicas;
sampling keeps the target's distribution."""

import asyncio
import contextlib
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from actors import wire
from actors.draft_replica import load_replica_draft
from actors.grpc_target import GrpcTarget
from actors.security import LinkSecurity, serve_target, target_channel
from actors.target_service import TargetService
from conftest import NEW_TOKENS, VOCAB, threads_for_new_threads
from scheduling import wait_for
from protos import specdec_tree_pb2 as tree_pb
from protos import specdec_tree_pb2_grpc as tree_grpc
from specdec.acceptance import Verdict
from specdec.blocks import BlockPool
from specdec.draft_loop import DraftLoop, DraftRequest
from specdec.drafter_factory import draft_runner, make_drafter
from specdec.errors import InvalidArgument
from specdec.head_training import new_head
from specdec.kvcache import CachedLM
from specdec.loading import TargetParts, load_model
from specdec.plain import hf_greedy
from specdec.sampling import SamplingParams
from specdec.scheduler import KvBudget, TargetScheduler
from specdec.target import TargetWorker
from specdec.tree import TokenTree

GREEDY = SamplingParams()
SECRET = "heads-served-secret"


class Collect:
    def __init__(self):
        self.tokens, self.done, self.error, self.stats = [], threading.Event(), None, None

    def __call__(self, tokens, out, finished, error):
        self.tokens += tokens
        if finished:
            self.error, self.stats = error, out.stats
            self.done.set()

    def wait(self, timeout: float = 120) -> list[int]:
        assert self.done.wait(timeout), "the request never finished"
        assert self.error is None, self.error
        return self.tokens


class CountingStub:
    """A TargetService stub that counts the PromptFeatures calls made through it."""

    def __init__(self, stub):
        self.stub, self.feature_calls = stub, 0
        self.feature_threads: list[int] = []  # torch's threads on the thread that made each PromptFeatures call

    def __getattr__(self, name):
        if name == "PromptFeatures":
            self.feature_calls += 1
            self.feature_threads.append(torch.get_num_threads())
        return getattr(self.stub, name)


@contextlib.contextmanager
def serving(model, limit: int, pool: BlockPool | None = None, **budget):
    """The model's scheduler (its KV in `pool`, else a pool without a prefix cache) behind a real TargetService on
    loopback with this message limit -> (scheduler, a GrpcTarget with the same limit, its counting stub)."""
    scheduler = TargetScheduler(TargetWorker(CachedLM(model, pool)), KvBudget(**budget))
    server, port = serve_target(TargetService(scheduler, message_limit=limit), tree_grpc.add_TargetServiceServicer_to_server,
                                "127.0.0.1", LinkSecurity(SECRET))
    channel = target_channel(f"127.0.0.1:{port}", LinkSecurity(SECRET))
    stub = CountingStub(tree_grpc.TargetServiceStub(channel))
    try:
        yield scheduler, GrpcTarget(stub, message_limit=limit), stub
    finally:
        channel.close()
        server.stop(grace=None)
        scheduler.stop()


def run_remote(remote: GrpcTarget, drafter, prompts, new_tokens, params=GREEDY, depth=3, prefix="r",
               overlap: bool = False) -> list[Collect]:
    """Each prompt opened on the remote target (with the drafter's feature layers) and stepped by one draft loop
    (overlap: drafting each next step while the target verifies)."""
    loop = DraftLoop(remote, drafter, overlap=overlap)
    assert loop.overlap == overlap
    sinks = [Collect() for _ in prompts]

    def start(i: int) -> None:
        rid = f"{prefix}{i}"
        # a head's pairs its prefix index holds (if it has one), as a replica takes them before it opens
        (held,) = loop.prefill([prompts[i]], [params.cache_salt]) if drafter.feature_layers else (None,)
        opened = remote.open(rid, prompts[i], params, i, new_tokens, drafter.feature_layers,
                             features_from=held.lm.lengths[0] if held is not None else 0)
        loop.join(DraftRequest(rid, prompts[i], params, new_tokens, set(), depth, sinks[i], stream=i,
                               draft_prefill=held, features=opened.features, first=opened.first))

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(start, range(len(prompts))))
    for sink in sinks:
        sink.done.wait(300)
    loop.stop()
    return sinks


@pytest.mark.parametrize("heads, width, overlap", [("trained_head", 1, False), ("trained_head", 2, False),
                                                   ("trained_medusa", 2, False), ("trained_head", 2, True)])
def test_heads_over_grpc_equal_plain_decoding(smooth, heads, width, overlap, request):
    """A head loaded as a replica loads it (TargetParts: no target model), its features over the wire in
    bfloat16, a 2 KiB message limit: prompt features come in several PromptFeatures calls, and a step's
    trees in several Verify calls whose replies (the verdicts' features) fit too. overlap: an EAGLE-3 head
    drafts each next step while the target verifies, the verdicts' features settling its guesses."""
    trained = request.getfixturevalue(heads)
    model = load_replica_draft(trained.path, smooth.path, torch.float32, "cpu")
    drafter = make_drafter("model", draft_runner(model), width)
    with serving(smooth.model, limit=2048) as (scheduler, remote, stub):
        sinks = run_remote(remote, drafter, smooth.reference.prompts, NEW_TOKENS, overlap=overlap)
        assert [s.wait() for s in sinks] == smooth.reference.continuations
        assert stub.feature_calls > len(sinks)  # the longer prompts' features took more than one message
        assert remote.feature_row_bytes == len(drafter.feature_layers) * 64 * 2  # bfloat16 on the wire
    accepted = sum(s.stats.accepted for s in sinks)
    assert accepted > 0 and accepted < sum(s.stats.drafted for s in sinks)
    assert (sum(s.stats.drafted_ahead for s in sinks) > 0) == overlap


def test_a_heads_next_turn_takes_its_prompt_and_answer_cached_with_their_features(smooth, trained_head):
    """Conversations through a target whose prefix cache is on: each one's second turn (its first prompt, the
    answer and a follow-up) takes the first turn's blocks, answer included, with the features kept beside them
    (the target runs only the follow-up); the head takes its own pairs of the first turn from its index, so the
    target sends the features after them only; and both turns' outputs are plain decoding's."""
    from conftest import MIN_GAP
    from specdec.plain import hf_greedy_margin

    model = load_replica_draft(trained_head.path, smooth.path, torch.float32, "cpu")
    drafter = make_drafter("model", draft_runner(model, BlockPool(4096)), 1)  # the head's pool: its own index
    pool = BlockPool(4096)
    with serving(smooth.model, limit=1 << 20, pool=pool) as (scheduler, remote, stub):
        starts, read = [], remote.prompt_features
        remote.prompt_features = lambda rid, start=0: (starts.append(start), read(rid, start))[1]
        first = run_remote(remote, drafter, smooth.reference.prompts, NEW_TOKENS)
        assert starts == [0] * len(first)  # nothing cached yet: every prompt's features from its first token
        answers = [s.wait() for s in first]
        assert answers == smooth.reference.continuations
        turns = [p + a + [1, 2, 3] for p, a in zip(smooth.reference.prompts, answers)]
        plain = [hf_greedy_margin(smooth.model, t, NEW_TOKENS) for t in turns]
        kept = [i for i, (_, gap) in enumerate(plain) if gap >= MIN_GAP]  # no near-tie on the way: a fair demand
        assert len(kept) >= len(turns) // 2
        before, head_before, starts[:] = pool.stats().hit_tokens, drafter.lm.pool.stats().hit_tokens, []
        second = run_remote(remote, drafter, [turns[i] for i in kept], NEW_TOKENS, prefix="turn 2 ")
        assert [s.wait() for s in second] == [plain[i][0] for i in kept]
        # the features kept with the cached blocks (3 layers x hidden 64, 16 bits): counted, within the cap's worth
        row_bytes = len(drafter.feature_layers) * 64 * 2
        assert 0 < scheduler.stats().prefix_feature_bytes <= 4096 * row_bytes
    held = sum((len(smooth.reference.prompts[i]) + len(answers[i]) - 1) // 16 * 16 for i in kept)
    assert pool.stats().hit_tokens - before >= held  # every whole block of each first turn, its answer's too
    # the head took its own pairs of each first turn too, so the target sent only the features after them
    prompt_pairs = sum((len(smooth.reference.prompts[i]) - 1) // 16 * 16 for i in kept)
    assert drafter.lm.pool.stats().hit_tokens - head_before == sum(starts) >= prompt_pairs > 0
    assert sum(s.stats.accepted for s in second) > 0


def test_a_4000_token_prompt_with_a_head_is_served(smooth, trained_head, tmp_path):
    """The head's target with a context of 4200 positions: a 4000-token prompt's features (4000 x 3 x 64
    bfloat16 values) come over a 64 KiB link in chunks, and the output is plain decoding's."""
    model = load_model(smooth.path)
    model.config.max_position_embeddings = 4200
    model.save_pretrained(tmp_path / "long")
    long_target = load_model(str(tmp_path / "long"))
    head = load_replica_draft(trained_head.path, str(tmp_path / "long"), torch.float32, "cpu")
    prompt = torch.randint(0, VOCAB, (4000,), generator=torch.Generator().manual_seed(4)).tolist()
    with serving(long_target, limit=65536, max_tokens=5000) as (_, remote, stub):
        (sink,) = run_remote(remote, make_drafter("model", draft_runner(head), 1), [prompt], 8)
        assert sink.wait() == hf_greedy(long_target, prompt, 8)
        assert stub.feature_calls >= 4000 * 3 * 64 * 2 // 65536


@pytest.mark.parametrize("cached, overlap", [(False, False), (True, False), (False, True)],
                         ids=["no cache", "prefix cache", "drafting ahead"])
def test_heads_sampling_over_grpc_keeps_the_targets_distribution(small_target, model_dirs, tmp_path, cached, overlap):
    """Seeded samples drafted by a random EAGLE-3 head over gRPC (features in bfloat16): the joint of their
    first 3 tokens is the target's (chi-square against enumeration). With the prefix caches on (the target's
    and the head's), a prompt of a whole block and more: every request after the first few takes its first
    block's KV and features from the target's cache and its pairs from the head's. Drafting ahead (the requests
    run on to 8 tokens, so that trees are drafted ahead with nodes; the first 3 are compared), the trees of
    steps whose assumption held were drafted on the head's own outputs."""
    from specdec.eagle3 import save_head
    from test_sampling import P_MIN, PROMPT, chi_square_pvalue, exact_joint

    head = new_head(small_target, torch.tensor([0, 1, 2, 4, 5, 7]))
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.dim() >= 2 and not name.startswith("embed_tokens"):
                p.normal_(0, 0.3)
    save_head(head, tmp_path / "head")
    replica = load_replica_draft(str(tmp_path / "head"), model_dirs.small_target, torch.float32, "cpu")
    drafter = make_drafter("model", draft_runner(replica, BlockPool(4096) if cached else None), 2)
    prompt, pool = (PROMPT * 4, BlockPool(4096)) if cached else (PROMPT, None)  # 20 tokens: one whole block
    m, n_tokens, params = 1200, 3, SamplingParams(temperature=1.0, seed=5)
    with serving(small_target, limit=1 << 20, pool=pool, max_rows=m) as (scheduler, remote, _):
        sinks = run_remote(remote, drafter, [prompt] * m, 8 if overlap else n_tokens, params, depth=2, prefix="s",
                           overlap=overlap)
        outcomes = Counter(tuple(s.wait()[:n_tokens]) for s in sinks)
        assert scheduler.stats().largest_batch > 8
    if cached:
        assert pool.stats().hit_tokens >= 16 * (m // 2) and drafter.lm.pool.stats().hit_tokens >= 16 * (m // 2)
    assert sum(s.stats.accepted for s in sinks) > 0
    assert (sum(s.stats.drafted_ahead for s in sinks) > 0) == overlap
    assert chi_square_pvalue(outcomes, exact_joint(small_target, prompt, n_tokens, params), m) > P_MIN


# ------------------------------------------------------------------ the wire and the target's side


def test_features_cross_the_wire_in_16_bits_and_malformed_ones_are_refused():
    f = torch.randn(5, 12)
    msg = wire.features_to_proto(f)
    assert msg.dtype == "bfloat16" and len(msg.data) == 5 * 12 * 2
    back = wire.features_from_proto(msg, "features", rows=5)
    torch.testing.assert_close(back.float(), f.to(torch.bfloat16).float())
    half = wire.features_from_proto(wire.features_to_proto(f.half()), "features")
    assert half.dtype == torch.float16 and torch.equal(half, f.half())
    for change, field in [(dict(dtype="int8"), "features.dtype"), (dict(rows=6), "features.data"),
                          (dict(width=0), "features.width"), (dict(rows=-1), "features.width")]:
        bad = tree_pb.Features()
        bad.CopyFrom(msg)
        for k, v in change.items():
            setattr(bad, k, v)
        with pytest.raises(InvalidArgument) as e:
            wire.features_from_proto(bad, "features")
        assert e.value.field == field
    with pytest.raises(InvalidArgument, match="expected 4"):
        wire.features_from_proto(msg, "features", rows=4)
    verdict = wire.verdict_to_proto("r", Verdict([0, 1], [3, 4], features=torch.randn(3, 12)))  # 3 rows, 2 nodes
    with pytest.raises(ValueError, match="verdict of request 'r'.*expected 2"):
        wire.verdict_from_proto(verdict)


def test_verify_requests_split_so_that_the_replies_fit():
    trees = {}
    for i in range(6):
        tree = TokenTree.root(1)
        tree.add_guesses([2, 3, 4], [-1, 0, 1], share_prefix=False)  # 4 nodes deep: a reply of up to 4 rows
        trees[f"r{i}"] = tree
    alone, _ = wire.verify_requests(trees, 4096)
    assert len(alone) == 1
    split, refused = wire.verify_requests(trees, 4096, reply_bytes_per_node=400)  # 1600 bytes a reply: 2 a message
    assert len(split) == 3 and not refused
    _, refused = wire.verify_requests(trees, 4096, reply_bytes_per_node=2000)
    assert set(refused) == set(trees)


def test_prompt_features_are_kept_until_taken_or_closed(smooth):
    scheduler = TargetScheduler(TargetWorker(CachedLM(smooth.model)), KvBudget())
    try:
        done = threading.Event()
        scheduler.open_then("a", [3, 4, 5, 6, 7], GREEDY, 0, 4, lambda error: done.set(), feature_layers=(0, 3))
        assert done.wait(30)
        first, total = scheduler.prompt_features("a", 0, lambda width, dtype: 3)
        assert total == 5 and first.shape == (3, 2 * 64)  # every prompt token's: the first token came with the open
        rest, _ = scheduler.prompt_features("a", 3, lambda width, dtype: 3)
        assert rest.shape[0] == 2
        with pytest.raises(KeyError, match="no prompt features waiting"):  # all taken: forgotten
            scheduler.prompt_features("a", 0, lambda width, dtype: 3)
        done.clear()
        scheduler.open_then("b", [3, 4, 5], GREEDY, 0, 4, lambda error: done.set(), feature_layers=(1, 1, 2))
        assert done.wait(30)
        scheduler.close(["b"])
        with pytest.raises(KeyError):
            for _ in range(200):  # gone with its row, before the next forward
                scheduler.prompt_features("b", 0, lambda width, dtype: 1)
                threading.Event().wait(0.01)
        with pytest.raises(InvalidArgument, match="feature_layers"):  # 3 layers: ids 0..3
            scheduler.open_then("c", [3, 4], GREEDY, 0, 4, lambda error: None, feature_layers=(4,))
    finally:
        scheduler.stop()


def test_target_parts_reads_the_embeddings_a_head_shares(smooth):
    parts = TargetParts(smooth.path)
    assert parts.config.hidden_size == 64
    torch.testing.assert_close(parts.get_input_embeddings().weight, smooth.model.get_input_embeddings().weight)
    plain = load_model(smooth.path)
    torch.testing.assert_close(parts.get_output_embeddings().weight, plain.lm_head.weight)


def test_target_parts_reads_a_tied_targets_embedding_for_both(tmp_path):
    """A target whose LM head is its embedding (tie_word_embeddings, as SmolLM2 and the bench target): its
    checkpoint holds the embedding alone, under the embedding's name, and both reads find it."""
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    tied = LlamaForCausalLM(config)
    tied.save_pretrained(tmp_path)
    parts = TargetParts(str(tmp_path))
    torch.testing.assert_close(parts.get_input_embeddings().weight, tied.get_input_embeddings().weight)
    torch.testing.assert_close(parts.get_output_embeddings().weight, tied.get_input_embeddings().weight)


# ------------------------------------------------------------------ a Ray topology


SERVED_PROMPTS = ["w5 w17 w3", "w40 w41 w42 w43 w44 w45", "w9 w1 w2 w1 w2 w1 w2"]


def complete_on(frontend, prompt: str, **request) -> tuple[list[int], object]:
    """One request through a Frontend with speculation ON -> (its tokens, its last chunk's stats)."""
    from cluster.admission import Request
    from cluster.speculation import Speculation

    async def complete():
        job = frontend.admission.admit(Request(prompt=prompt, max_new_tokens=NEW_TOKENS, speculation=Speculation.ON,
                                               **request))
        tokens, last = [], None
        async for chunk in frontend.generate(job):
            tokens += chunk.token_ids
            last = chunk
        return tokens, last.stats

    return asyncio.run(complete())


def test_the_target_is_told_the_served_heads_layers_at_start(smooth, trained_head, trained_medusa, tmp_path):
    """placement.served_head_layers: the layers of models.head (else of the first draft that is a head), read from its
    config, which the target's rows keep features at from the first request; None without a head."""
    from cluster.config import parse_config
    from cluster.placement import served_head_layers

    def layers(models: dict):
        drafters = ["model+ngram"] + (["head"] if "head" in models else [])
        return served_head_layers(parse_config({"models": {"target": {"path": smooth.path}} | models,
                                                "speculation": {"drafter": drafters}}))

    assert layers({"draft": {"path": smooth.path}}) is None
    assert layers({"draft": {"path": smooth.path}, "head": {"path": trained_head.path}}) == trained_head.heads.aux_layers
    assert layers({"draft": {"path": trained_medusa.path}}) == (smooth.model.config.num_hidden_layers,)


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=4, num_gpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_heads_on_replicas_beside_a_tensor_parallel_target_equal_plain_decoding(cluster, smooth, trained_head,
                                                                               trained_medusa):
    """Two draft replicas load the heads (from the target's folder: no target model of their own): the EAGLE-3
    head drafts for every task type but "medusa", Medusa's heads for that one. The target is split over two
    ranks; the verdicts' features come from rank 0. With speculation.overlap the EAGLE-3 head drafts ahead
    (Medusa's heads cannot). Greedy output is plain decoding's, and the requests really speculated."""
    from cluster.config import parse_config
    from cluster.frontend import Frontend
    from cluster.placement import start_topology

    cfg = parse_config({"models": {"target": {"path": smooth.path}, "draft": {"path": trained_head.path},
                                   "task_drafts": {"medusa": {"path": trained_medusa.path}}},
                        "placement": {"tensor_parallel_size": 2, "draft_replicas": 2, "logical_gpus": True},
                        "speculation": {"drafter": "model", "overlap": True}, "routing": {"default": {}}})
    frontend = Frontend(cfg, start_topology(cfg))
    ahead = {"code": 0, "medusa": 0}
    try:
        for prompt in SERVED_PROMPTS:
            want = hf_greedy(smooth.model, frontend.tokenizer(prompt)["input_ids"], NEW_TOKENS)
            for task_type in ("code", "medusa"):
                before = frontend.timing.drafted_ahead
                tokens, stats = complete_on(frontend, prompt, task_type=task_type)
                assert tokens == want, (prompt, task_type)
                assert stats.speculative and stats.drafted > 0
                ahead[task_type] += frontend.timing.drafted_ahead - before  # steps whose tree was drafted ahead
        assert ahead["code"] > 0 and ahead["medusa"] == 0, ahead
    finally:
        frontend.shutdown()


def test_a_head_and_a_draft_model_are_drafter_kinds_of_one_replica(cluster, smooth, trained_head):
    """models.head beside models.draft: one replica runs model+ngram (a draft model: here the target's own weights)
    and head (the EAGLE-3 head), each request with the one asked for. Greedy output is plain decoding's either way;
    the ingress measures each forward's drafting apart (the head's depths are not the draft model's), and the head's
    pool is its own."""
    from cluster.config import parse_config
    from cluster.frontend import Frontend, check_served_models
    from cluster.placement import start_topology

    cfg = parse_config({"models": {"target": {"path": smooth.path}, "draft": {"path": smooth.path},
                                   "head": {"path": trained_head.path}},
                        "placement": {"draft_replicas": 1, "logical_gpus": True},
                        "speculation": {"drafter": ["model+ngram", "head"]}})
    check_served_models(cfg)
    frontend = Frontend(cfg, start_topology(cfg))
    try:
        for prompt in SERVED_PROMPTS:
            want = hf_greedy(smooth.model, frontend.tokenizer(prompt)["input_ids"], NEW_TOKENS)
            for drafter in ("head", "model+ngram"):
                tokens, stats = complete_on(frontend, prompt, drafter=drafter)
                assert tokens == want, (prompt, drafter)
                assert stats.speculative and stats.drafted > 0
        by_forward = frontend.timing.by_forward
        assert set(by_forward) == {"model", "head"} and all(f.depths > 0 and f.steps > 0 for f in by_forward.values())
        assert by_forward["model"].depths + by_forward["head"].depths == frontend.timing.draft_depths
        (pools,) = ray.get([d.kv_stats.remote() for d in frontend.topology.drafts])
        assert set(pools) == {"", "<head>"}

        def costs() -> dict:  # /v1/stats "costs": what the router prices each forward at, from the polls
            return asyncio.run(frontend.stats()).to_json()["costs"]["drafting"]

        wait_for(lambda: set(costs()) == {"model", "head"}, costs, timeout=20, every=0.5)
        assert all(c["s_per_depth"] > 0 and c["ahead"] == 0 for c in costs().values()), costs()
    finally:
        frontend.shutdown()


def test_serve_checks_heads_against_the_target_before_the_actors_start(smooth, trained_head, trained_medusa,
                                                                         model_dirs, tmp_path):
    """A server's drafts may be heads made for its target; heads made for another (here the tests' other
    target: its hidden size differs) are refused before Ray starts, naming what differs."""
    from cluster.config import parse_config
    from cluster.frontend import check_served_models
    from specdec.errors import HeadMismatch

    def cfg(target, draft):
        return parse_config({"models": {"target": {"path": target}, "draft": {"path": draft},
                                        "task_drafts": {"medusa": {"path": trained_medusa.path}}}})

    assert check_served_models(cfg(smooth.path, trained_head.path)).hidden_size == 64
    other = tmp_path / "wide"
    load_model(smooth.path).config.__class__(vocab_size=VOCAB, hidden_size=96, intermediate_size=128,
                                             num_hidden_layers=3, num_attention_heads=4,
                                             num_key_value_heads=2).save_pretrained(other)
    with pytest.raises(HeadMismatch, match=r"hidden states of size 64 \(target_hidden_size\); the target.s are 96"):
        check_served_models(cfg(str(other), trained_head.path))
    heads = {"models": {"target": {"path": str(other)}, "head": {"path": trained_head.path}},
             "speculation": {"drafter": "head"}}
    with pytest.raises(HeadMismatch, match=r"hidden states of size 64"):  # models.head is checked the same way
        check_served_models(parse_config(heads))
    heads["models"]["head"]["path"] = smooth.path
    with pytest.raises(ValueError, match=r"models.head: .* holds no draft head .* a draft model goes in models.draft"):
        check_served_models(parse_config(heads))


def test_verify_reads_its_trees_and_its_verdicts_features_off_the_event_loop(smooth, trained_head, monkeypatch):
    """A Verify message's trees are read, and its verdicts' features copied off the device, on the service's
    verify pool: the event loop every replica's Open, Verify and Close share never waits for them."""
    model = load_replica_draft(trained_head.path, smooth.path, torch.float32, "cpu")
    drafter = make_drafter("model", draft_runner(model), 1)
    seen = {"tree_from_proto": set(), "features_to_proto": set()}
    for name in seen:
        real = getattr(wire, name)

        def recording(*args, real=real, name=name, **kwargs):
            seen[name].add(threading.current_thread().name.split("_")[0])
            return real(*args, **kwargs)

        monkeypatch.setattr(wire, name, recording)
    with serving(smooth.model, limit=1 << 20) as (scheduler, remote, stub):
        sinks = run_remote(remote, drafter, smooth.reference.prompts[:2], 6)
    assert all(sink.error is None for sink in sinks)
    assert seen == {"tree_from_proto": {"verify-rpc"}, "features_to_proto": {"verify-rpc"}}, seen


def test_prompt_features_read_on_a_pool_thread_run_torch_on_one(smooth, trained_head):
    """open_async reads a prompt's features on a pool's thread (off the event loop); torch runs there on one
    thread, so that no second team of torch's threads makes the compute thread's forwards wait (specdec.compute),
    whatever torch's setting for new threads."""
    model = load_replica_draft(trained_head.path, smooth.path, torch.float32, "cpu")
    layers = make_drafter("model", draft_runner(model), 1).feature_layers
    prompt = smooth.reference.prompts[-1]
    before = torch.get_num_threads()
    threads_for_new_threads(2)
    try:
        with serving(smooth.model, limit=2048) as (scheduler, remote, stub):
            opened = asyncio.run(remote.open_async("pooled", prompt, GREEDY, 0, 4, layers))
            remote.close(["pooled"])
    finally:
        threads_for_new_threads(before)
    assert opened.features.shape[0] == len(prompt)
    assert stub.feature_threads and set(stub.feature_threads) == {1}, stub.feature_threads
