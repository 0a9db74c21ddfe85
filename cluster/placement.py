"""Where the actors go: the target group's ranks packed in one placement group (one GPU bundle each)
and every draft replica on a bundle of its own, so drafts never share the target's GPUs. Each
topology makes a secret of its own, which its draft replicas send on every call to its target
(actors/security.py); nothing outside the topology is given it: it reaches the actors through Ray's
object store (SharedSecurity), not as a creation argument, and no repr shows it. A lost target group is started again
on its own placement group, with the same secret (start_target_ranks; cluster/supervisor.py). The draft replicas load
while the target's ranks do: they are given the target's address with each request."""

import secrets
import uuid
from dataclasses import dataclass, field

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.draft_replica import DraftReplica
from specdec.scheduler import KvBudget
from actors.security import LinkSecurity, SharedSecurity, TlsFiles
from actors.target_rank import TargetRank, free_address
from specdec.loading import check_model, head_feature_layers, is_head, local_folder

from .config import SecurityConfig, ServeConfig

NAMESPACE = "specdec"  # actors are named here, for operators and tests: draft-<i>-<topology tag>, and
# target-<rank>-<topology tag>, or target-<rank>-<topology tag>.<n> once the group was started again (n-th try)
ACTOR_CONCURRENCY = 1024  # requests an actor streams at once (async: streams, not threads)


@dataclass
class Topology:
    target_ranks: list  # TargetRank handles, rank order; rank 0 serves
    drafts: list  # DraftReplica handles
    groups: list[PlacementGroup]  # the target group's first, then the draft replicas'
    target_address: str  # rank 0's TargetService, host:port
    tag: str  # in the actors' names
    security: LinkSecurity  # the draft -> target link's secret (not in its repr) and TLS files, the same for a rebuilt group
    # the same in Ray's object store, what the actors are given: held here for the topology's life, as Ray
    # restarts a replica with its creation arguments, whose reference must still resolve then
    shared: SharedSecurity | None = field(default=None, repr=False)

    @property
    def target(self):
        return self.target_ranks[0]

    @property
    def target_pg(self) -> PlacementGroup:
        return self.groups[0]

    def shutdown(self) -> None:
        kill(self.target_ranks + self.drafts)
        for pg in self.groups:
            remove_placement_group(pg)


def _bundles(n: int, gpus: float, cpus: int) -> list[dict]:
    return [{"GPU": gpus, "CPU": cpus} for _ in range(n)]


def _on(pg: PlacementGroup, bundle: int) -> PlacementGroupSchedulingStrategy:
    return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=bundle)


def link_security(cfg: SecurityConfig) -> LinkSecurity:
    """A new secret for one topology's draft -> target link, and the TLS files if the config has them."""
    tls = cfg.internal_tls
    files = TlsFiles(tls.cert, tls.key, tls.ca, tls.server_name, tls.client_cert, tls.client_key) if tls else None
    return LinkSecurity(secrets.token_urlsafe(32), files)


def start_topology(cfg: ServeConfig, timeout_s: float = 300) -> Topology:
    """Reserve GPUs, start the target ranks and the draft replicas, and connect them."""
    cfg.security.check_internal_tls_files()
    security = link_security(cfg.security)
    place, models, spec = cfg.placement, cfg.models, cfg.speculation
    target_pg = placement_group(_bundles(place.tensor_parallel_size, place.gpus_per_actor, place.cpus_per_target_rank),
                                strategy="STRICT_PACK")
    groups = [target_pg]
    n_drafts = place.draft_replicas if spec.shapes() else 0
    if n_drafts:
        groups.append(placement_group(_bundles(n_drafts, place.gpus_per_actor, place.cpus_per_draft_replica),
                                      strategy="PACK"))
    topo = Topology([], [], groups, "", tag=uuid.uuid4().hex[:8], security=security)
    try:
        for pg in groups:
            ray.get(pg.ready(), timeout=timeout_s)  # fails, naming the wait, when the cluster lacks the GPUs
        topo.shared = SharedSecurity.put(security)
        # the replicas load while the target ranks do: they are given the target's address with each request
        topo.target_ranks = launch_target_ranks(cfg, target_pg, topo.tag, topo.shared)
        topo.drafts = [
            DraftReplica.options(num_gpus=place.gpus_per_actor, num_cpus=place.cpus_per_draft_replica,
                                 max_concurrency=ACTOR_CONCURRENCY,
                                 max_restarts=-1, scheduling_strategy=_on(groups[1], i),
                                 name=f"draft-{i}-{topo.tag}", namespace=NAMESPACE)
            .remote(models.drafts(), spec.shapes(), spec.overlap,
                    corpora=spec.suffix.corpora, corpus_max_tokens=spec.suffix.corpus_max_tokens,
                    target_model=models.target.path, prefix_cache_tokens=cfg.server.prefix_cache_tokens,
                    budget=kv_budget(cfg), head=(models.head.path, models.head.dtype) if models.head else None,
                    quantization=models.draft_quantization,
                    security=topo.shared, logical_gpus=place.logical_gpus)
            for i in range(n_drafts)]
        topo.target_address = target_ready(topo.target_ranks, timeout_s)
        ray.get([d.ready.remote() for d in topo.drafts], timeout=timeout_s)
    except Exception:
        topo.shutdown()  # release what was reserved, then report why
        raise
    return topo


def launch_target_ranks(cfg: ServeConfig, pg: PlacementGroup, tag: str, security: SharedSecurity) -> list:
    """The target group's ranks (target-<rank>-<tag>), one on each bundle of `pg`, started (not yet loaded:
    target_ready waits for that), in rank order."""
    place, server, tp = cfg.placement, cfg.server, cfg.placement.tensor_parallel_size
    rendezvous = ray.get(ray.remote(free_address).options(num_cpus=0, scheduling_strategy=_on(pg, 0))
                         .remote()) if tp > 1 else None
    return [TargetRank.options(num_gpus=place.gpus_per_actor, num_cpus=place.cpus_per_target_rank,
                               max_concurrency=ACTOR_CONCURRENCY, scheduling_strategy=_on(pg, r),
                               name=f"target-{r}-{tag}", namespace=NAMESPACE)
            .remote(cfg.models.target.path, cfg.models.target.dtype, r, tp, rendezvous, kv_budget(cfg),
                    server.idle_row_timeout_s, server.prefix_cache_tokens, server.max_batched_tokens,
                    gather_trees=server.gather_trees, security=security, logical_gpus=place.logical_gpus,
                    head_layers=served_head_layers(cfg))
            for r in range(tp)]


def served_head_layers(cfg: ServeConfig) -> tuple[int, ...] | None:
    """The target layers the config's draft head reads (models.head, else the first draft that is a head), which
    the target's rows keep their features at from the first request on; None when it serves no head."""
    for path in ([cfg.models.head.path] if cfg.models.head else []) + [p for p, _ in cfg.models.drafts().values()]:
        if is_head(local_folder(path)):
            return head_feature_layers(path, check_model(cfg.models.target.path))
    return None


def start_target_ranks(cfg: ServeConfig, pg: PlacementGroup, tag: str, security: SharedSecurity,
                       timeout_s: float = 300) -> tuple[list, str]:
    """The target group's ranks, loaded and joined -> (the ranks in rank order, rank 0's address)."""
    ranks = launch_target_ranks(cfg, pg, tag, security)
    return ranks, target_ready(ranks, timeout_s)


def target_ready(ranks: list, timeout_s: float = 300) -> str:
    """Wait until every rank has loaded and joined -> rank 0's TargetService address. The ranks are killed if
    the group fails to start."""
    try:
        ray.get([rank.ready.remote() for rank in ranks], timeout=timeout_s)
        return ray.get(ranks[0].address.remote())
    except Exception:
        kill(ranks)
        raise


def kv_budget(cfg: ServeConfig, window: int | None = None) -> KvBudget:
    """The target's bounds, from server.*; a tree's room from speculation and routing: the nodes past the
    root of the largest drafter's tree (DraftShape.nodes) for the largest K any task type may be given.
    window: every layer's sliding window (the target's scheduler sets its own, from its cache)."""
    routing = cfg.routing
    k = max([routing.default.max_k, *(t.max_k for t in routing.task_types.values())])
    tree_room = max([KvBudget.tree_room, *(shape.nodes(k) - 1 for shape in cfg.speculation.shapes().values())])
    return KvBudget(cfg.server.max_running_requests, cfg.server.max_kv_tokens, cfg.server.max_waiting_requests,
                    tree_room, window)


def kill(actors: list) -> None:
    for actor in actors:
        ray.kill(actor, no_restart=True)
