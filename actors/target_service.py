"""The target's gRPC face, specdec.v1.TargetService: Open, Verify, Close over a TargetWorker.

One thread owns the worker. Verify calls that arrive while it runs a forward (or within
`batch_window_s` of the first) are merged into one forward, so the trees of concurrent requests are
verified together."""

import contextlib
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from protos import specdec_tree_pb2 as tree_pb
from protos import specdec_tree_pb2_grpc as tree_grpc
from specdec.acceptance import Verdict
from specdec.errors import RequestExists, UnknownRequest
from specdec.sampling import SamplingParams
from specdec.target import TargetWorker
from specdec.tree import TokenTree

from . import wire


@dataclass
class _Op:
    run: Callable  # () -> result, on the worker's thread; verify ops merge instead
    trees: dict | None = None  # verify ops: request id -> TokenTree
    done: threading.Event = field(default_factory=threading.Event)
    result: object = None
    error: Exception | None = None


class TargetService(tree_grpc.TargetServiceServicer):
    """Open/Verify/Close over gRPC, and the same three in-process as open/verify/close (the target
    rank decodes its plain requests through those, so both run one code path)."""

    def __init__(self, worker: TargetWorker, batch_window_s: float = 0.0,
                 on_forward: Callable[[float], None] = lambda seconds: None):
        self.worker, self.window, self.on_forward = worker, batch_window_s, on_forward
        self.ops: queue.Queue[_Op | None] = queue.Queue()
        self.forwards = 0  # verify forwards run
        self.largest_batch = 0  # most requests verified in one forward
        self.forward_time_s = 0.0  # spent in verify forwards (acceptance included)
        self._thread = threading.Thread(target=self._serve, name="target-worker", daemon=True)
        self._thread.start()

    # --- in-process: errors are the core's typed errors ---------------------------------------------

    def open(self, request_id: str, prompt: list[int], params: SamplingParams, stream: int = 0) -> None:
        self._submit(_Op(lambda: self.worker.add([(request_id, list(prompt), params, stream)])))

    def verify(self, request_id: str, tree: TokenTree) -> Verdict:
        return self.verify_many({request_id: tree})[request_id]

    def verify_many(self, trees: dict[str, TokenTree]) -> dict[str, Verdict]:
        return self._submit(_Op(run=None, trees=trees))

    def close(self, request_id: str) -> None:
        self._submit(_Op(lambda: self.worker.remove([request_id] if request_id in self.worker.requests else [])))

    # --- gRPC: specdec.v1.TargetService ---------------------------------------------------------------

    def Open(self, request, context):
        with _status(context):
            self.open(request.request_id, list(request.prompt), wire.sampling_from_proto(request.params),
                      request.stream)
        return tree_pb.OpenResponse()

    def Verify(self, request, context):
        with _status(context):
            trees = dict(wire.tree_from_proto(t) for t in request.trees)
            if len(trees) != len(request.trees):
                raise ValueError("a request id appears twice in one VerifyRequest")
            verdicts = self.verify_many(trees)
        return tree_pb.VerifyResponse(results=[wire.verdict_to_proto(rid, verdicts[rid]) for rid in trees])

    def Close(self, request, context):
        with _status(context):
            for rid in request.request_ids:
                self.close(rid)
        return tree_pb.CloseResponse()

    def stop(self) -> None:
        self.ops.put(None)
        self._thread.join()

    def _submit(self, op: _Op):
        self.ops.put(op)
        op.done.wait()
        if op.error is not None:
            raise op.error
        return op.result

    def _serve(self) -> None:
        while (op := self.ops.get()) is not None:
            if op.trees is None:
                self._finish(op)
                continue
            batch, later = self._gather_verifies(op)
            self._verify(batch)
            for other in later:
                self._finish(other)
            if None in later:
                break

    def _gather_verifies(self, first: _Op) -> tuple[list[_Op], list]:
        """The first verify plus every verify queued meanwhile (or within the window) whose requests
        are checked and not already in the batch; other ops run after the forward."""
        batch, later, ids = [], [], set()
        op, deadline_wait = first, self.window
        while True:
            if op is None or op.trees is None:
                later.append(op)
            elif ids & op.trees.keys():  # the same request twice: its second tree goes in a forward of its own
                later.append(_Op(run=lambda o=op: self._verify([o])))
            else:
                try:
                    self.worker.check(op.trees)
                    batch.append(op)
                    ids |= op.trees.keys()
                except (KeyError, ValueError) as e:
                    op.error = e
                    op.done.set()
            try:
                op = self.ops.get(timeout=deadline_wait) if deadline_wait else self.ops.get_nowait()
                deadline_wait = 0
            except queue.Empty:
                return batch, later

    def _verify(self, batch: list[_Op]) -> None:
        if not batch:
            return
        merged = {rid: tree for op in batch for rid, tree in op.trees.items()}
        try:
            t0 = time.perf_counter()
            verdicts, _ = self.worker.verify(merged)
            elapsed = time.perf_counter() - t0
            self.forward_time_s += elapsed
            self.on_forward(elapsed)
            self.forwards += 1
            self.largest_batch = max(self.largest_batch, len(merged))
            for op in batch:
                op.result = verdicts
        except Exception as e:  # noqa: BLE001 - handed to each caller as a gRPC error
            for op in batch:
                op.error = e
        for op in batch:
            op.done.set()

    @staticmethod
    def _finish(op: _Op | None) -> None:
        if op is None:
            return
        try:
            op.result = op.run()
        except Exception as e:  # noqa: BLE001 - handed to the caller as a gRPC error
            op.error = e
        op.done.set()


_CODES = [(UnknownRequest, grpc.StatusCode.NOT_FOUND), (RequestExists, grpc.StatusCode.ALREADY_EXISTS),
          (ValueError, grpc.StatusCode.INVALID_ARGUMENT)]  # by type, most specific first


@contextlib.contextmanager
def _status(context):
    """The core's typed errors as gRPC status codes; anything else is INTERNAL."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - every error reaches the caller as a status
        code = next((code for kind, code in _CODES if isinstance(e, kind)), grpc.StatusCode.INTERNAL)
        context.abort(code, str(e) if code != grpc.StatusCode.INTERNAL else repr(e))
