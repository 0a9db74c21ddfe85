"""The paged kernel (specdec/csrc/paged_attention.cpp) against torch's sdpa over the same keys and values
gathered densely: grouped and plain heads, one query to a prefill's many, rows whose blocks run on in the
pool and rows whose blocks are scattered, tree masks with holes, a mask shared by every row; and the errors
it gives for what it cannot read."""

import pytest
import torch

from specdec import paged_kernel

BLOCK = 16


@pytest.fixture(scope="module")
def kernel():
    if reason := paged_kernel.unavailable():
        pytest.skip(f"the paged kernel cannot run here: {reason}")
    built = paged_kernel.paged_attention()
    assert built is not None, "the paged kernel did not build (the log says why)"
    return built


def pool_of(B, Hkv, L, D, scattered: bool, g: torch.Generator):
    """Rows of L keys and values in a pool of 16-slot blocks, laid out in order or scattered -> pool_k,
    pool_v [P, Hkv, D], read [B, L] and the dense keys, values [B, Hkv, L, D]."""
    blocks = -(-L // BLOCK)
    order = torch.randperm(B * blocks, generator=g) if scattered else torch.arange(B * blocks)
    read = ((order.view(B, blocks) + 2)[:, :, None] * BLOCK + torch.arange(BLOCK)).reshape(B, -1)[:, :L].contiguous()
    pool_k = torch.randn((B * blocks + 3) * BLOCK, Hkv, D, generator=g)  # slots no row reads hold noise
    pool_v = torch.randn_like(pool_k)
    k = pool_k[read.flatten()].view(B, L, Hkv, D).transpose(1, 2)
    v = pool_v[read.flatten()].view(B, L, Hkv, D).transpose(1, 2)
    return pool_k, pool_v, read, k, v


def tree_mask(B, T, L, g: torch.Generator) -> torch.Tensor:
    """[B, 1, T, L]: the committed slots visible but for some holes, then a random tree over the T new slots
    (each node sees itself and a random set of the nodes before it)."""
    S = L - T
    mask = torch.rand(B, 1, T, L, generator=g) > 0.1
    mask[..., S:] = torch.tril(torch.rand(B, 1, T, T, generator=g) > 0.5)
    mask[..., S:] |= torch.eye(T, dtype=torch.bool)
    return mask


@pytest.mark.parametrize("B, Hq, Hkv, T, S", [
    (1, 4, 2, 1, 40),  # one decode query
    (3, 4, 2, 8, 300),  # a verify step: two chunks of keys
    (2, 8, 8, 5, 700),  # plain heads, several chunks
    (4, 9, 3, 8, 90),  # groups of 3 (the default target)
    (1, 4, 4, 100, 0),  # a prefill: several blocks of queries
    (2, 6, 2, 33, 513),  # ragged sizes everywhere
])
@pytest.mark.parametrize("scattered", [False, True])
def test_kernel_equals_sdpa_over_gathered_kv(kernel, B, Hq, Hkv, T, S, scattered):
    g = torch.Generator().manual_seed(B * 1000 + T * 10 + S)
    D, L = 32, S + T
    pool_k, pool_v, read, k, v = pool_of(B, Hkv, L, D, scattered, g)
    query = torch.randn(B, Hq, T, D, generator=g)
    mask = tree_mask(B, T, L, g)
    ours = kernel(query, pool_k, pool_v, read, mask, 0.3)  # [B, T, Hq, D]
    theirs = torch.nn.functional.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(ours, theirs.transpose(1, 2), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("T", [1, 3, 8])  # 1 and 3: dot products, four keys at a time and the rest; 8: sgemm
def test_the_bench_targets_plain_heads_in_64_key_chunks(kernel, T):
    """8 rows of 8 plain heads of 64: a task reads all 8 heads, so its chunks are 64 keys (kept in L2)."""
    g = torch.Generator().manual_seed(T)
    B, H, S, D = 8, 8, 301, 64
    pool_k, pool_v, read, k, v = pool_of(B, H, S + T, D, True, g)
    query = torch.randn(B, H, T, D, generator=g)
    mask = tree_mask(B, T, S + T, g)
    ours = kernel(query, pool_k, pool_v, read, mask, D**-0.5)
    theirs = torch.nn.functional.scaled_dot_product_attention(query, k, v, attn_mask=mask)
    torch.testing.assert_close(ours, theirs.transpose(1, 2), atol=2e-6, rtol=1e-5)


def test_a_mask_shared_by_every_row_and_a_causal_prefill(kernel):
    """A [1, 1, T, L] mask serves every row; a causal prefill's later chunks are skipped for early queries
    and the result is still exact."""
    g = torch.Generator().manual_seed(7)
    B, Hq, Hkv, T, D = 2, 4, 2, 600, 16
    pool_k, pool_v, read, k, v = pool_of(B, Hkv, T, D, True, g)
    query = torch.randn(B, Hq, T, D, generator=g)
    causal = torch.ones(T, T, dtype=torch.bool).tril().view(1, 1, T, T)
    ours = kernel(query, pool_k, pool_v, read, causal, D**-0.5)
    theirs = torch.nn.functional.scaled_dot_product_attention(query, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(ours, theirs.transpose(1, 2), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("S", [40, 700])  # 700: the keys split across tasks and merged
def test_ragged_rows_run_only_their_real_queries(kernel, S):
    """Rows of a mixed batch (a prompt's 70-token chunk beside trees of 1 to 9 nodes, one row sitting out),
    padded to T: each row's real queries equal sdpa's; the padding's output is zeros, whatever its mask says."""
    g = torch.Generator().manual_seed(S)
    B, Hq, Hkv, T, D = 5, 9, 3, 70, 32
    real = torch.tensor([9, 70, 1, 0, 4])
    pool_k, pool_v, read, k, v = pool_of(B, Hkv, S + T, D, True, g)
    query = torch.randn(B, Hq, T, D, generator=g)
    mask = tree_mask(B, T, S + T, g)
    ours = kernel(query, pool_k, pool_v, read, mask, 0.3, real)  # [B, T, Hq, D]
    theirs = torch.nn.functional.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=0.3,
                                                              enable_gqa=True).transpose(1, 2)
    for b, n in enumerate(real.tolist()):
        torch.testing.assert_close(ours[b, :n], theirs[b, :n], atol=2e-6, rtol=1e-5)
        assert not ours[b, n:].any()
    with pytest.raises(RuntimeError, match="queries"):
        kernel(query, pool_k, pool_v, read, mask, 0.3, torch.tensor([1, 2, 3, 4, T + 1]))


@pytest.mark.parametrize("L", [20, 600])  # 600: the keys split across tasks and merged
def test_a_query_that_sees_nothing_gets_zeros(kernel, L):
    """(A padding query of a ragged block; its output is never read.)"""
    g = torch.Generator().manual_seed(3)
    pool_k, pool_v, read, _, _ = pool_of(1, 2, L, 8, False, g)
    mask = torch.ones(1, 1, 2, L, dtype=torch.bool)
    mask[0, 0, 1] = False
    out = kernel(torch.randn(1, 2, 2, 8, generator=g), pool_k, pool_v, read, mask, 0.5)
    assert out[0, 1].abs().max() == 0 and out[0, 0].abs().max() > 0


def test_what_the_kernel_cannot_read_is_refused_by_name(kernel):
    g = torch.Generator().manual_seed(5)
    pool_k, pool_v, read, _, _ = pool_of(1, 2, 20, 8, False, g)
    query, mask = torch.randn(1, 2, 1, 8, generator=g), torch.ones(1, 1, 1, 20, dtype=torch.bool)
    outside = read.clone()
    outside[0, 3] = pool_k.shape[0]
    with pytest.raises(RuntimeError, match="a slot outside the pool"):
        kernel(query, pool_k, pool_v, outside, mask, 0.5)
    with pytest.raises(RuntimeError, match="float32 only"):
        kernel(query.double(), pool_k, pool_v, read, mask, 0.5)
    with pytest.raises(RuntimeError, match="read or mask do not match"):
        kernel(query, pool_k, pool_v, read, mask[..., :19], 0.5)
    with pytest.raises(RuntimeError, match="heads or head size"):
        kernel(torch.randn(1, 3, 1, 8), pool_k, pool_v, read, mask, 0.5)


def test_the_switch_turns_the_kernel_off(monkeypatch):
    monkeypatch.setenv(paged_kernel.SWITCH, "off")
    assert paged_kernel.unavailable() == f"{paged_kernel.SWITCH}=off"


def test_a_failed_build_leaves_the_gathering_path_and_says_why(monkeypatch, caplog):
    import torch.utils.cpp_extension

    def fails(**kwargs):
        raise RuntimeError("no such compiler")

    monkeypatch.setattr(paged_kernel, "_loaded", {})
    monkeypatch.setattr(paged_kernel, "unavailable", lambda: None)
    monkeypatch.setattr(torch.utils.cpp_extension, "load", fails)
    with caplog.at_level("WARNING", logger=paged_kernel.__name__):
        assert paged_kernel.paged_attention() is None
    assert "gathers each row's KV first" in caplog.text and "no such compiler" in caplog.text


def test_a_build_killed_midway_leaves_no_lock_the_next_one_waits_on(monkeypatch, tmp_path):
    """A builder killed mid-build (kill -9: no clean-up runs) leaves torch's `lock` file behind; the next process
    takes the builder's lock at once (the OS dropped it with its holder), removes the stale file, and builds,
    where torch's own builder would wait for that file forever (it did, after a Ctrl-C during a first build)."""
    import os
    import subprocess
    import sys
    import time
    from types import SimpleNamespace

    import torch.utils.cpp_extension
    from torch.utils.file_baton import FileBaton

    monkeypatch.setenv(paged_kernel.PLACE, str(tmp_path))  # for the builder below and the one killed
    killed = subprocess.Popen(
        [sys.executable, "-c", "import time\nfrom specdec.paged_kernel import build_folder, builder_lock\n"
         "folder = build_folder(); folder.mkdir(parents=True)\n"
         "with builder_lock(folder):\n    (folder / 'lock').touch(); print('building', flush=True); time.sleep(120)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert killed.stdout.readline().strip() == "building"
    finally:
        killed.kill()  # SIGKILL
        killed.wait(timeout=30)
    folder = paged_kernel.build_folder()
    assert (folder / "lock").exists()  # what the killed build left

    def load(name, build_directory, **kwargs):  # torch's builder, as far as its lock file goes
        baton = FileBaton(os.path.join(build_directory, "lock"))
        assert baton.try_acquire(), "torch's builder would wait forever for a lock file no builder holds"
        baton.release()
        return SimpleNamespace(paged_attention="the kernel")

    monkeypatch.setattr(paged_kernel, "_loaded", {})
    monkeypatch.setattr(paged_kernel, "unavailable", lambda: None)
    monkeypatch.setattr(torch.utils.cpp_extension, "load", load)
    t0 = time.monotonic()
    assert paged_kernel.paged_attention() == "the kernel"
    assert time.monotonic() - t0 < 10
    assert not (folder / "lock").exists()


def test_each_torch_install_builds_in_a_folder_of_its_own(monkeypatch):
    """torch's build file names the include paths of the torch it builds against: two environments (a clone's
    venv beside another's) sharing one folder would rebuild the kernel in turn, each over the other's."""
    import torch

    here = paged_kernel.build_folder()
    monkeypatch.setattr(torch, "__file__", "/elsewhere/site-packages/torch/__init__.py")
    elsewhere = paged_kernel.build_folder()
    assert elsewhere != here and elsewhere.parent == here.parent
    assert elsewhere.name.startswith("specdec_paged_attention_")


def test_each_checkout_builds_in_a_folder_of_its_own(monkeypatch, tmp_path):
    """torch's build file names the source's path: two checkouts of specdec sharing one kernel folder (a CI clone
    beside the working tree) would rebuild the kernel in turn, as two torch installs would."""
    here = paged_kernel.build_folder()
    copy = tmp_path / "paged_attention.cpp"
    copy.write_bytes(paged_kernel.SOURCE.read_bytes())
    monkeypatch.setattr(paged_kernel, "SOURCE", copy)
    assert paged_kernel.build_folder() != here
