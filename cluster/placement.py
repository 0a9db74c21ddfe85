"""Where the actors go: the target group's ranks packed in one placement group (one GPU bundle each)
and every draft replica on a bundle of its own, so drafts never share the target's GPUs."""

from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.draft_replica import DraftReplica
from actors.target_rank import TargetRank

from .config import ServeConfig


@dataclass
class Topology:
    target_ranks: list  # TargetRank handles, rank order
    drafts: list  # DraftReplica handles
    groups: list[PlacementGroup]

    def shutdown(self) -> None:
        for actor in self.target_ranks + self.drafts:
            ray.kill(actor)
        for pg in self.groups:
            remove_placement_group(pg)


def _bundles(n: int, gpus: float) -> list[dict]:
    return [{"GPU": gpus, "CPU": 1} for _ in range(n)]


def start_topology(cfg: ServeConfig, timeout_s: float = 60) -> Topology:
    """Reserve GPUs, start the target ranks and the draft replicas, and connect them."""
    place, models, spec = cfg.placement, cfg.models, cfg.speculation
    target_pg = placement_group(_bundles(place.tensor_parallel_size, place.gpus_per_actor), strategy="STRICT_PACK")
    groups = [target_pg]
    if place.draft_replicas:
        groups.append(placement_group(_bundles(place.draft_replicas, place.gpus_per_actor), strategy="PACK"))
    for pg in groups:
        ray.get(pg.ready(), timeout=timeout_s)  # fails, naming the wait, when the cluster lacks the GPUs

    def on(pg, i):
        return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=i)

    ranks = [TargetRank.options(num_gpus=place.gpus_per_actor, num_cpus=1, scheduling_strategy=on(target_pg, r))
             .remote(models.target.path, models.target.dtype, r, place.tensor_parallel_size)
             for r in range(place.tensor_parallel_size)]
    try:
        address = ray.get(ranks[0].address.remote(), timeout=timeout_s)
    except Exception:
        Topology(ranks, [], groups).shutdown()  # release what was reserved, then report why
        raise
    draft_path = models.draft.path if models.draft else None
    depth = 4 if spec.num_speculative_tokens == "auto" else spec.num_speculative_tokens
    drafts = [DraftReplica.options(num_gpus=place.gpus_per_actor, num_cpus=1, scheduling_strategy=on(groups[1], i))
              .remote(draft_path, address, spec.drafter, models.draft.dtype if models.draft else "float32",
                      spec.tree_width, depth)
              for i in range(place.draft_replicas)]
    return Topology(ranks, drafts, groups)
