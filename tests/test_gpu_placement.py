"""The GPU path's placement defects, checked without a GPU: an actor that Ray gives a GPU but that sees no
CUDA refuses to start (unless placement.logical_gpus says the GPUs are logical), and a tensor-parallel
follower that fails a mirrored call ends its process instead of leaving rank 0 to hang."""

import os
import subprocess
import sys
import textwrap

import pytest
import ray
import torch

from actors import lockstep
from actors.target_rank import NoCudaError, device_for_actor
from cluster.local import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --- a GPU from Ray and no CUDA: refused, naming the build and both remedies ---------------------------------


@pytest.fixture
def ray_gave_gpu(monkeypatch):
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: [3])


def test_a_gpu_without_cuda_refuses_to_start(ray_gave_gpu, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(NoCudaError) as info:
        device_for_actor(logical_gpus=False)
    message = str(info.value)
    assert "GPU 3" in message and f"torch {torch.__version__} (CPU-only build)" in message
    assert "install a CUDA build of torch in the image" in message
    assert "placement.logical_gpus: true" in message


def test_a_cuda_build_that_finds_no_device_says_so(ray_gave_gpu, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    with pytest.raises(NoCudaError, match=r"finds no CUDA device .*\(CUDA 12\.4 build\)"):
        device_for_actor(logical_gpus=False)


def test_logical_gpus_run_on_the_cpu(ray_gave_gpu, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device_for_actor(logical_gpus=True) == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # logical slots even where CUDA is
    assert device_for_actor(logical_gpus=True) == "cpu"


def test_a_gpu_with_cuda_is_used(ray_gave_gpu, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert device_for_actor(logical_gpus=False) == "cuda:0"


def test_no_gpu_from_ray_is_the_cpu(monkeypatch):
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: [])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device_for_actor(logical_gpus=False) == "cpu"


# --- a tensor-parallel follower: a refusal is logged, anything else ends the process -------------------------


class Died(Exception):
    pass


def follow_calls(monkeypatch, worker, calls) -> None:
    """Run follow() in this process on `calls` (what rank 0 broadcasts, None last), with die() raising Died."""
    boxes = iter(calls)

    def broadcast(box, src, group):
        box[0] = next(boxes)

    monkeypatch.setattr(lockstep.dist, "broadcast_object_list", broadcast)
    monkeypatch.setattr(lockstep, "die", lambda: (_ for _ in ()).throw(Died()), raising=False)
    lockstep.follow(worker, group=None)


class Refuses:
    def __init__(self, error: Exception):
        self.error, self.calls = error, 0

    def verify(self, trees, max_nodes=None):
        self.calls += 1
        raise self.error


@pytest.mark.parametrize("error", [ValueError("bad tree"), KeyError("r1")])
def test_a_refusal_is_only_logged(monkeypatch, caplog, error):
    worker = Refuses(error)
    with caplog.at_level("DEBUG", logger=lockstep.log.name):
        follow_calls(monkeypatch, worker, [("verify", ([],)), ("verify", ([],)), None])
    assert worker.calls == 2  # followed on after the first refusal, and returned at None
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]


def test_any_other_failure_ends_the_follower(monkeypatch, caplog):
    worker = Refuses(RuntimeError("CUDA out of memory"))
    with pytest.raises(Died):
        follow_calls(monkeypatch, worker, [("verify", ([],)), ("verify", ([],)), None])
    assert worker.calls == 1
    (record,) = [r for r in caplog.records if r.levelname == "CRITICAL"]
    assert "mirrored verify" in record.getMessage() and "CUDA out of memory" in record.exc_text


def test_a_lost_broadcast_ends_the_follower(monkeypatch):
    def broadcast(box, src, group):
        raise RuntimeError("Connection closed by peer")

    monkeypatch.setattr(lockstep.dist, "broadcast_object_list", broadcast)
    monkeypatch.setattr(lockstep, "die", lambda: (_ for _ in ()).throw(Died()), raising=False)
    with pytest.raises(Died):
        lockstep.follow(Refuses(ValueError()), group=None)


RANK = textwrap.dedent("""
    import datetime, sys, threading, time
    import torch, torch.distributed as dist
    from actors.lockstep import follow

    rank, port, error = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    group = dist.new_group(backend="gloo")
    if rank == 0:
        dist.broadcast_object_list([("verify", ([],))], src=0, group=group)
        try:  # rank 0's next collectives (in serving: the forward's)
            dist.broadcast_object_list([None], src=0, group=group)
            dist.barrier(group=group)
            print("rank 1 met rank 0", flush=True)
        except Exception as e:
            print("rank 0's collective failed", flush=True)
    else:
        class Worker:
            def verify(self, trees, max_nodes=None):
                raise {"runtime": RuntimeError, "value": ValueError}[error]("mirrored call failed")
        follower = threading.Thread(target=follow, args=(Worker(), group), daemon=True)
        follower.start()
        follower.join()
        print("follow returned", flush=True)
        dist.barrier(group=group)
        time.sleep(600)  # the actor lives on after its follow thread, as a TargetRank does
""")


def run_ranks(error: str) -> list[subprocess.Popen]:
    port = str(free_port())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, *sys.path])}
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, str(rank), port, error], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    return ranks


def test_a_follower_whose_worker_raises_ends_its_process():
    """Two gloo ranks in processes of their own: rank 1's mirrored verify raises RuntimeError (as a CUDA OOM
    would); its process exits with status 1 after a CRITICAL log line, and rank 0's next collective fails
    instead of waiting for its timeout. Before the fix, the follow thread ended and the process lived on."""
    rank0, rank1 = run_ranks("runtime")
    try:
        assert rank1.wait(timeout=180) == 1, rank1.communicate()  # before the fix: alive, TimeoutExpired
        out, err = rank1.communicate()
        assert "failed the mirrored verify" in err and "mirrored call failed" in err, err
        assert "follow returned" not in out
        out0, _ = rank0.communicate(timeout=180)
        assert "rank 0's collective failed" in out0, out0
    finally:
        for p in (rank0, rank1):
            if p.poll() is None:
                p.kill()
                p.wait()


def test_a_follower_refusing_a_call_keeps_following():
    rank0, rank1 = run_ranks("value")
    try:
        out0, err0 = rank0.communicate(timeout=180)
        assert "rank 1 met rank 0" in out0, err0
        assert rank1.poll() is None  # alive, and it returned from follow at rank 0's None
        rank1.kill()
        out1, _ = rank1.communicate()
        assert "follow returned" in out1
    finally:
        for p in (rank0, rank1):
            if p.poll() is None:
                p.kill()
                p.wait()


# --- `specdec serve`'s local cluster: logical GPUs where there is no CUDA, and it says so --------------------


def never_called() -> dict:
    raise AssertionError("the default pair was built although models were given")


@pytest.mark.parametrize("cuda, num_gpus, gpus, logical", [
    (0, None, 2, True),  # no CUDA: as many logical GPUs as the 2 actors ask for, the models on the CPU
    (0, 5.0, 5, True),
    (4, None, 4, False),  # CUDA: this machine's GPUs, real
])
def test_a_local_cluster_without_cuda_declares_logical_gpus(monkeypatch, cuda, num_gpus, gpus, logical):
    from cluster import local

    monkeypatch.setattr(local, "_local_gpus", lambda: cuda)
    app_args = {"target": "t", "draft": "d"}
    cfg, declared, note = local.local_cluster(app_args, never_called, num_gpus)
    assert declared == gpus and cfg.placement.logical_gpus is logical
    assert app_args.get("logical_gpus") is (True if logical else None)  # what build_app(app_args) serves
    assert (note is not None) is logical
    if logical:
        assert f"local Ray cluster's {gpus} GPUs are logical" in note and "placement.logical_gpus: true" in note


def test_serve_takes_every_override_as_a_flag():
    """serve_main reads each of OVERRIDES from its arguments: --logical-gpus among them, None unless given."""
    from cluster.config import OVERRIDES
    from tools.commands import build_parser

    parser = build_parser()
    args = parser.parse_args(["serve"])
    assert all(getattr(args, flag) is None for flag in OVERRIDES)
    assert parser.parse_args(["serve", "--logical-gpus"]).logical_gpus is True
