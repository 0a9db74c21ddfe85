"""The ingress sends a conversation's next turn to the draft replica that served its last (cluster/affinity.py)."""

import random

from cluster.affinity import ReplicaChooser


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50000) for _ in range(n)]


def serve_turn(chooser: ReplicaChooser, prompt: list[int], answer: list[int], replicas: int = 4) -> int:
    index = chooser.choose(prompt, replicas)
    chooser.done(index, prompt + answer)
    return index


def test_a_conversations_next_turn_goes_where_its_last_turn_went():
    chooser = ReplicaChooser()
    conversations = [(tokens(100, seed), tokens(60, 100 + seed)) for seed in range(6)]
    first = [serve_turn(chooser, prompt, answer) for prompt, answer in conversations]
    assert sorted(set(first)) == [0, 1, 2, 3]  # new conversations: round robin
    for (prompt, answer), index in zip(conversations, first):
        follow_up = tokens(20, 999)
        assert chooser.choose(prompt + answer + follow_up, 4) == index
        chooser.done(index, prompt + answer + follow_up)
    assert chooser.followed == len(conversations)


def test_a_shared_system_prompt_alone_does_not_pull_conversations_together():
    chooser = ReplicaChooser()
    system = tokens(200, 1)
    serve_turn(chooser, system + tokens(40, 2), tokens(40, 3))
    picks = {serve_turn(chooser, system + tokens(300, 10 + i), tokens(10, 4)) for i in range(8)}
    assert len(picks) > 1 and chooser.followed == 0  # 200 of 500 tokens shared: under half


def test_a_busy_replica_is_passed_over():
    chooser = ReplicaChooser(slack=2)
    prompt, answer = tokens(64, 5), tokens(64, 6)
    index = serve_turn(chooser, prompt, answer, replicas=2)
    for _ in range(3):  # the conversation's replica now runs 3 more requests than the other
        chooser.in_flight[index] = chooser.in_flight.get(index, 0) + 1
    assert chooser.choose(prompt + answer, 2) != index


def test_memory_is_bounded():
    chooser = ReplicaChooser(capacity=100, block=16)
    for seed in range(50):
        serve_turn(chooser, tokens(160, seed), tokens(160, seed + 1000))
    assert len(chooser._served) == 100
    assert all(count == 0 for count in chooser.in_flight.values())  # every request was counted out


def test_requests_of_another_cache_salt_never_follow_a_conversation():
    """With security.cache_per_api_key each key's requests carry their own cache salt: they share no cached work,
    and no affinity either. Another key resending a conversation's exact text goes round robin and is not counted
    as following it (the count is in /v1/stats, which any key may read: a hit would tell it the text was sent);
    the same key, or two requests of no salt, still follow."""
    chooser = ReplicaChooser()
    prompt, answer = tokens(100, 1), tokens(60, 2)
    index = chooser.choose(prompt, 4, "tenant-a")
    chooser.done(index, prompt + answer, "tenant-a")
    for salt in ("tenant-b", None):
        chooser.done(chooser.choose(prompt + answer, 4, salt), prompt + answer, salt)
    assert chooser.followed == 0
    assert chooser.choose(prompt + answer + tokens(20, 3), 4, "tenant-a") == index and chooser.followed == 1
    chooser.choose(prompt + answer + tokens(20, 4), 4)  # no salt: follows the no-salt request above
    assert chooser.followed == 2
