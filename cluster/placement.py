"""Where the actors go: the target group's ranks packed in one placement group (one GPU bundle each)
and every draft replica on a bundle of its own, so drafts never share the target's GPUs. Each
topology makes a secret of its own, which its draft replicas send on every call to its target
(actors/security.py); nothing outside the topology is given it."""

import secrets
import uuid
from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.draft_replica import DraftReplica
from actors.scheduler import KvBudget
from actors.security import LinkSecurity, TlsFiles
from actors.target_rank import TargetRank, free_address

from .config import SecurityConfig, ServeConfig

NAMESPACE = "specdec"  # draft replicas are named here (draft-<i>-<topology tag>), for operators and tests
ACTOR_CONCURRENCY = 1024  # requests an actor streams at once (async: streams, not threads)


@dataclass
class Topology:
    target_ranks: list  # TargetRank handles, rank order; rank 0 serves
    drafts: list  # DraftReplica handles
    groups: list[PlacementGroup]
    target_address: str  # rank 0's TargetService, host:port

    @property
    def target(self):
        return self.target_ranks[0]

    def shutdown(self) -> None:
        for actor in self.target_ranks + self.drafts:
            ray.kill(actor, no_restart=True)
        for pg in self.groups:
            remove_placement_group(pg)


def _bundles(n: int, gpus: float, cpus: int) -> list[dict]:
    return [{"GPU": gpus, "CPU": cpus} for _ in range(n)]


def _on(pg: PlacementGroup, bundle: int) -> PlacementGroupSchedulingStrategy:
    return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=bundle)


def link_security(cfg: SecurityConfig) -> LinkSecurity:
    """A new secret for one topology's draft -> target link, and the TLS files if the config has them."""
    tls = cfg.internal_tls
    return LinkSecurity(secrets.token_urlsafe(32),
                        TlsFiles(tls.cert, tls.key, tls.ca, tls.server_name) if tls is not None else None)


def start_topology(cfg: ServeConfig, timeout_s: float = 300) -> Topology:
    """Reserve GPUs, start the target ranks and the draft replicas, and connect them."""
    cfg.security.check_internal_tls_files()
    security = link_security(cfg.security)
    place, models, spec = cfg.placement, cfg.models, cfg.speculation
    tp = place.tensor_parallel_size
    target_pg = placement_group(_bundles(tp, place.gpus_per_actor, place.cpus_per_target_rank), strategy="STRICT_PACK")
    groups = [target_pg]
    n_drafts = place.draft_replicas if spec.drafter != "none" else 0
    if n_drafts:
        groups.append(placement_group(_bundles(n_drafts, place.gpus_per_actor, place.cpus_per_draft_replica),
                                      strategy="PACK"))
    topo, tag = Topology([], [], groups, ""), uuid.uuid4().hex[:8]
    try:
        for pg in groups:
            ray.get(pg.ready(), timeout=timeout_s)  # fails, naming the wait, when the cluster lacks the GPUs
        rendezvous = ray.get(ray.remote(free_address).options(num_cpus=0, scheduling_strategy=_on(target_pg, 0))
                             .remote()) if tp > 1 else None
        topo.target_ranks = [
            TargetRank.options(num_gpus=place.gpus_per_actor, num_cpus=place.cpus_per_target_rank,
                               max_concurrency=ACTOR_CONCURRENCY,
                               scheduling_strategy=_on(target_pg, r))
            .remote(models.target.path, models.target.dtype, r, tp, rendezvous,
                    KvBudget(cfg.server.max_running_requests, cfg.server.max_kv_tokens), security=security)
            for r in range(tp)]
        ray.get([rank.ready.remote() for rank in topo.target_ranks], timeout=timeout_s)
        topo.target_address = ray.get(topo.target.address.remote())
        topo.drafts = [
            DraftReplica.options(num_gpus=place.gpus_per_actor, num_cpus=place.cpus_per_draft_replica,
                                 max_concurrency=ACTOR_CONCURRENCY,
                                 max_restarts=-1, scheduling_strategy=_on(groups[1], i),
                                 name=f"draft-{i}-{tag}", namespace=NAMESPACE)
            .remote(models.drafts(), topo.target_address, spec.drafter, spec.tree_width, spec.overlap,
                    security=security)
            for i in range(n_drafts)]
        ray.get([d.ready.remote() for d in topo.drafts], timeout=timeout_s)
    except Exception:
        topo.shutdown()  # release what was reserved, then report why
        raise
    return topo
