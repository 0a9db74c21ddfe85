"""What shipping a head's features costs on the draft -> target link: the same Verify steps (R rows, each a
chain of K = 4 random guesses) over real gRPC on loopback, with and without feature_layers (three layers,
as an EAGLE-3 head reads), alternated. Reports per step: the reply's bytes, the round trip, the time the
trees spent in the target (its forward included: TargetScheduler.tree_loop_time_s), and the hop (round
trip less that), all measured on this machine. The target is the bench pair's (hidden 512, 6 layers).

    python -m tools.bench.feature_hop [rows ...] >> docs/bench/feature-hop.txt   # from the repository root
"""
import statistics
import sys
import time

import torch

from actors.grpc_target import GrpcTarget
from actors.security import LinkSecurity, serve_target, target_channel
from actors.target_service import TargetService
from protos import specdec_tree_pb2_grpc as tree_grpc
from specdec.eagle3_config import default_aux_layers
from specdec.kvcache import CachedLM
from specdec.loading import load_served_model
from specdec.sampling import SamplingParams
from specdec.scheduler import KvBudget, TargetScheduler
from specdec.target import TargetWorker
from specdec.tree import TokenTree

TARGET, STEPS, K = "../shared/bench-models/target", 30, 4


class SizedStub:
    """A stub that records the bytes of each Verify reply."""

    def __init__(self, stub):
        self.stub, self.reply_bytes = stub, []

    def __getattr__(self, name):
        return getattr(self.stub, name)

    @property
    def Verify(self):
        stub, sizes = self.stub, self.reply_bytes

        class Call:
            @staticmethod
            def future(request, timeout=None):
                future = stub.Verify.future(request, timeout=timeout)
                future.add_done_callback(lambda f: sizes.append(f.result().ByteSize()) if f.exception() is None else None)
                return future

        return Call


def steps(remote: GrpcTarget, scheduler: TargetScheduler, rows: int, layers: tuple[int, ...], tag: str) -> dict:
    rids = [f"{tag}{i}" for i in range(rows)]
    gen = torch.Generator().manual_seed(0)
    for rid in rids:
        remote.open(rid, torch.randint(0, 8192, (64,), generator=gen).tolist(), SamplingParams(), 0, 4 * STEPS * (K + 1),
                    layers)
    last = {rid: scheduler.worker.last_token(rid) for rid in rids}
    round_trip, inside = [], []
    for _ in range(STEPS):
        trees = {}
        for rid in rids:
            tree = TokenTree.root(last[rid])
            tree.add_guesses(torch.randint(0, 8192, (K,), generator=gen).tolist(), list(range(-1, K - 1)), False)
            trees[rid] = tree
        before = scheduler.tree_loop_time_s
        t0 = time.perf_counter()
        verdicts = remote.verify(trees)
        round_trip.append((time.perf_counter() - t0) * 1e3)
        inside.append((scheduler.tree_loop_time_s - before) / rows * 1e3)  # each tree's own seconds in the target
        last = {rid: v.tokens[-1] for rid, v in verdicts.items()}
    remote.close(rids)
    return {"round_trip_ms": statistics.median(round_trip), "in_target_ms": statistics.median(inside)}


def main() -> None:
    torch.set_num_threads(1)
    model = load_served_model(TARGET)
    layers = default_aux_layers(model.config.num_hidden_layers)
    print(f"# tools/bench/feature_hop.py: bench target (hidden {model.config.hidden_size}), loopback gRPC, "
          f"chains of K={K}, {STEPS} steps each, medians; features of layers {layers} in bfloat16")
    print(f"{'rows':>4} {'features':>8} {'reply bytes':>11} {'round trip ms':>13} {'in target ms':>12} {'hop ms':>7}")
    for rows in map(int, sys.argv[1:] or ["1", "8", "32"]):
        scheduler = TargetScheduler(TargetWorker(CachedLM(model)), KvBudget(max_rows=rows + 1))
        server, port = serve_target(TargetService(scheduler), tree_grpc.add_TargetServiceServicer_to_server,
                                    "127.0.0.1", LinkSecurity("hop"))
        channel = target_channel(f"127.0.0.1:{port}", LinkSecurity("hop"))
        stub = SizedStub(tree_grpc.TargetServiceStub(channel))
        remote = GrpcTarget(stub)
        try:
            for round_ in range(2):  # alternated: with, without, with, without
                for with_features in (True, False):
                    stub.reply_bytes.clear()
                    r = steps(remote, scheduler, rows, layers if with_features else (), f"{round_}{with_features}-")
                    reply = statistics.median(stub.reply_bytes)
                    print(f"{rows:>4} {'yes' if with_features else 'no':>8} {reply:>11.0f} {r['round_trip_ms']:>13.2f} "
                          f"{r['in_target_ms']:>12.2f} {r['round_trip_ms'] - r['in_target_ms']:>7.2f}", flush=True)
        finally:
            channel.close()
            server.stop(grace=None)
            scheduler.stop()


if __name__ == "__main__":
    main()
