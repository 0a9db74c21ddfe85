"""The prefix cache's timing side channel, and cache_salt closing it: against a running `specdec serve`, a "victim"
sends a long prompt, then another client sends the same prompt and times its first token. Without salts the
second request is served from the victim's cached blocks, so its time to first token says the prompt was sent
before. With the victim's own cache_salt, the same request under another salt, or under none, is prefilled from
scratch. Prints the median time to first token (one-token completions, speculation off) of each case. Not a test:
numbers for docs/performance.md.

    python -m tools.bench.salt_ttft [--url http://localhost:8000] [--words 900] [--rounds 5] [--api-key KEY]
"""

import argparse
import json
import random
import statistics
import time
import urllib.request

WORDS = "the a of model cache token tenant prompt secret document quarterly revenue forecast memo".split()
CASES = ("no salts: the victim's prompt again", "the victim's salt", "another salt", "no salt")


def first_token_s(url: str, prompt: str, salt: str | None, api_key: str | None) -> float:
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "speculation": "off"}
    if salt is not None:
        body["cache_salt"] = salt
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {api_key}"} if api_key else {})
    request = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(), headers)
    t0 = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as reply:
        reply.read()
    return time.perf_counter() - t0


def measure(url: str, words: int, rounds: int, api_key: str | None, seed: int = 0) -> dict[str, list[float]]:
    """-> each case's times, a fresh prompt per round and case (nothing cached but what the round's victim sent)."""
    rng = random.Random(seed)
    times = {case: [] for case in CASES}

    def prompt(tag: str) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(words)) + f" {tag}"

    for i in range(rounds):
        shared = prompt(f"open {i}")
        first_token_s(url, shared, None, api_key)  # a victim without a salt
        times[CASES[0]].append(first_token_s(url, shared, None, api_key))
        salted = prompt(f"salted {i}")
        first_token_s(url, salted, f"victim-{i}", api_key)  # a victim with its own salt
        times[CASES[1]].append(first_token_s(url, salted, f"victim-{i}", api_key))
        times[CASES[2]].append(first_token_s(url, salted, f"attacker-{i}", api_key))
        times[CASES[3]].append(first_token_s(url, salted, None, api_key))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://localhost:8000")
    parser.add_argument("--words", type=int, default=900, help="words of each prompt")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--api-key")
    args = parser.parse_args()
    for case, xs in measure(args.url, args.words, args.rounds, args.api_key).items():
        print(f"{case:38s} median {statistics.median(xs) * 1e3:8.1f} ms   all {[round(x * 1e3) for x in xs]}")


if __name__ == "__main__":
    main()
