"""specdec.compute: the models run on one thread per process, which alone has torch's threads on a CPU."""

import contextvars
import os
import threading
import time

import pytest
import torch

from conftest import NEW_TOKENS, threads_for_new_threads
from specdec import CachedLM, SpecConfig, SpeculativeEngine
from specdec.compute import on_compute, single_threaded
from specdec.drafter_factory import make_drafter
from specdec.plain import hf_greedy

COLOUR = contextvars.ContextVar("colour", default="none")


def test_calls_from_any_thread_run_on_one_compute_thread():
    names = set()

    def where() -> str:
        names.add(threading.current_thread().name)
        return threading.current_thread().name

    def caller():
        on_compute("cpu", where)

    threads = [threading.Thread(target=caller) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    on_compute("cpu", where)
    assert names == {"torch-compute"}
    assert on_compute("cpu", lambda: on_compute("cpu", where)) == "torch-compute"  # nested: no deadlock


def test_a_call_keeps_the_callers_context_and_modes_and_raises_its_errors():
    COLOUR.set("red")
    with torch.inference_mode():
        seen = on_compute("cpu", lambda: (COLOUR.get(), torch.is_inference_mode_enabled()))
    assert seen == ("red", True)
    with torch.no_grad():
        assert on_compute("cpu", torch.is_grad_enabled) is False
    assert on_compute("cpu", torch.is_grad_enabled) is True
    with pytest.raises(ZeroDivisionError):
        on_compute("cpu", lambda: 1 / 0)
    assert on_compute("cpu", lambda: 7) == 7  # the thread goes on after a failure


def test_a_single_threaded_thread_leaves_the_others_their_threads():
    before = torch.get_num_threads()
    seen = {}

    def body():
        single_threaded()
        seen["own"] = torch.get_num_threads()

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert seen["own"] == 1
    assert torch.get_num_threads() == before
    assert on_compute("cpu", torch.get_num_threads) >= 1


def test_the_engines_forwards_run_on_the_compute_thread(target, draft, reference):
    """Both loops' forwards (target and draft model) run on the compute thread, none on a loop's own; the
    output is plain decoding's."""
    names: dict[str, set[str]] = {"target": set(), "draft": set()}
    hooks = [m.register_forward_hook(lambda *_, n=n: names[n].add(threading.current_thread().name))
             for n, m in (("target", target), ("draft", draft))]
    try:
        engine = SpeculativeEngine(CachedLM(target), make_drafter("model", CachedLM(draft), 1), SpecConfig(depth=3))
        outs = engine.generate(reference.prompts[:3], NEW_TOKENS)
    finally:
        for h in hooks:
            h.remove()
    assert names == {"target": {"torch-compute"}, "draft": {"torch-compute"}}
    assert [o.token_ids for o in outs] == [hf_greedy(target, p, NEW_TOKENS) for p in reference.prompts[:3]]


def test_a_forked_child_gets_a_compute_thread_of_its_own():
    """A fork copies only the forking thread: the child starts its own compute thread instead of waiting on the
    parent's, which it does not have."""
    on_compute("cpu", lambda: None)  # the parent's, started
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only if a call returns
        try:
            os._exit(0 if on_compute("cpu", lambda: 7) == 7 else 1)
        finally:
            os._exit(2)
    status, t0 = None, time.monotonic()
    while time.monotonic() - t0 < 30:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child's call never returned")
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.parametrize("which", ["eagle3", "medusa"])
def test_heads_load_on_the_compute_thread(monkeypatch, smooth, trained_head, trained_medusa, which):
    """A head's loading (its weights read, cast and moved) runs torch on the compute thread, as a draft model's
    does: once any other thread has opened a parallel region, every forward waits for OpenMP's wake-ups (the
    bench target's generate() measured 8.1-9.3 against 14.7-18.3 ms a token, the head loaded on the main thread)."""
    import specdec.eagle3
    import specdec.loading

    threads = []
    module, name = (specdec.eagle3, "load_head") if which == "eagle3" else (specdec.loading, "load_medusa")
    load = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: (threads.append(threading.current_thread().name), load(*a, **k))[1])
    path = trained_head.path if which == "eagle3" else trained_medusa.path
    specdec.loading.load_draft(path, smooth.model, served=True)
    assert threads == ["torch-compute"]


def test_the_engines_caller_runs_torch_on_one_thread_while_it_generates(monkeypatch, target, draft, reference):
    """generate() runs on the caller's thread the little the models' thread does not (the draft's prompt masks,
    say) with torch on one thread there, and gives the thread its own setting back after: a second team of
    torch's threads would make every forward on the compute thread wait for OpenMP's wake-ups (bench pair,
    bench modes from a script: a chain-k4 step 35.6 against 21.8 ms)."""
    from specdec.draft_loop import DraftLoop

    seen = []
    prefill = DraftLoop.prefill
    monkeypatch.setattr(DraftLoop, "prefill", lambda self, *a: (seen.append(torch.get_num_threads()), prefill(self, *a))[1])
    before, result = torch.get_num_threads(), {}

    def caller():
        engine = SpeculativeEngine(CachedLM(target), make_drafter("model", CachedLM(draft), 1), SpecConfig(depth=3))
        outs = engine.generate(reference.prompts[:2], NEW_TOKENS)
        result["tokens"], result["after"] = [o.token_ids for o in outs], torch.get_num_threads()

    threads_for_new_threads(2)
    try:
        thread = threading.Thread(target=caller)
        thread.start(), thread.join()
    finally:
        threads_for_new_threads(before)
    assert seen and set(seen) == {1}
    assert result["after"] == 2  # its own setting, back
    assert result["tokens"] == [hf_greedy(target, p, NEW_TOKENS) for p in reference.prompts[:2]]
