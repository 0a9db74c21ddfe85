"""Every example config in configs/ serves as it is in a clone: `specdec serve --config X` (a real process,
its own local Ray cluster, free ports) answers one request, then stops on SIGTERM.

The examples serve the embedded default pair, SmolLM2-135M-Instruct and its draft: built on first use (by the
quick recipe in the suite, conftest.py: a few minutes on 2 CPU cores, then cached under the user's cache
directory), so the first run of this test on a
machine takes that long. On the README's own `specdec serve`, a greedy chat through the OpenAI client equals
plain decoding of the same model."""

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from cluster.local import free_port
from protos import specdec_api_pb2 as api
from protos import specdec_api_pb2_grpc as api_grpc

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "configs").rglob("*.yaml"))
READY_S = 1500  # a first run builds the default pair
PROMPT = "def parse_header(line):\n    "
# not up yet; DEADLINE_EXCEEDED: the request waited out its 60 s for an ingress still loading its models (a busy
# machine), so it is sent again until READY_S, which still bounds a server that never answers
STARTING = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.NOT_FOUND,
            grpc.StatusCode.DEADLINE_EXCEEDED)


def test_there_are_examples():
    assert EXAMPLES, "configs/ holds no example config"
    assert readme_commands("serve")[0] == ["serve"] and readme_commands("client"), "the README's commands moved"


def readme_commands(program: str) -> list[list[str]]:
    """The README's shell lines that run `specdec <program>`, as argument lists."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    lines = [re.sub(r"\s+#.*$", "", line).strip() for block in blocks for line in block.splitlines()]
    commands = [shlex.split(line.removesuffix("&"))[1:] for line in lines if line.startswith(f"specdec {program}")]
    return [c for i, c in enumerate(commands) if c not in commands[:i]]  # `specdec serve &` is `specdec serve`


SERVES = [["serve", "--config", str(p)] for p in EXAMPLES] + readme_commands("serve")


@pytest.mark.timeout(READY_S + 300)  # past the suite's per-test timeout: a first run builds the default pair
@pytest.mark.parametrize("command", SERVES, ids=[" ".join(c).replace(str(ROOT) + "/", "") for c in SERVES])
def test_serve_answers_a_request_with_each_example_config(command, tmp_path):
    """Each example config, and the README's own `specdec serve` lines; on its set-up's, the README's
    `specdec client` lines too, as written (but the address)."""
    grpc_port, http_port = free_port(), free_port()
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "tools.commands", *command, "--grpc-port", str(grpc_port),
             "--http-port", str(http_port)],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        reply = first_reply(server, f"127.0.0.1:{grpc_port}", log)
        assert reply.token_ids and reply.finish_reason in ("length", "stop"), reply
        if command == readme_commands("serve")[0]:  # the set-up's; the results' serve answers a request
            check_chat_is_plain_decoding(f"http://127.0.0.1:{http_port}/v1")
            for client in readme_commands("client"):
                run = subprocess.run([sys.executable, "-m", "tools.commands", *client, "--address",
                                      f"127.0.0.1:{grpc_port}"], cwd=ROOT, capture_output=True, text=True,
                                     timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
                assert run.returncode == 0 and run.stdout.strip(), (client, run.stdout, run.stderr)
        stop_cleanly(server, log)
    finally:
        kill_if_running(server)


def stop_cleanly(server: subprocess.Popen, log: Path) -> None:
    """SIGTERM stops `specdec serve` with exit status 0."""
    server.send_signal(signal.SIGTERM)
    assert server.wait(timeout=120) == 0, log.read_text()[-3000:]


def kill_if_running(server: subprocess.Popen) -> None:
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


CHAT = [{"role": "user", "content": "Write a Python function that reverses a string."}]


def check_chat_is_plain_decoding(base_url: str, max_tokens: int = 48) -> None:
    """A greedy chat through the official client answers in English, token for token what transformers'
    generate() makes of the chat template's rendering on the served target."""
    from openai import OpenAI

    from specdec.default_models import default_target
    from specdec.loading import eos_ids, load_model, load_tokenizer
    from specdec.plain import hf_greedy

    client = OpenAI(base_url=base_url, api_key="unused", timeout=300)
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(model=model, messages=CHAT, max_tokens=max_tokens, temperature=0,
                                           extra_body={"speculation": "on"})
    text = reply.choices[0].message.content
    served = default_target(log=lambda _: None)  # built by the server, under this user's cache as well
    assert model == Path(served).name
    tokenizer, target = load_tokenizer(served), load_model(served)
    prompt = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
    plain = hf_greedy(target, prompt, max_tokens, sorted(eos_ids(target.generation_config, tokenizer)))
    assert text == tokenizer.decode(plain, skip_special_tokens=True), (text, tokenizer.decode(plain))
    words = re.findall(r"[A-Za-z]+", text)
    assert {"def", "string"} & {w.lower() for w in words} and len(words) >= 5, text  # English and Python, not noise


def first_reply(server: subprocess.Popen, address: str, log: Path) -> api.GenerateResponse:
    """One greedy request, sent until the server answers it (it is starting) -> the reply."""
    request = api.GenerateRequest(prompt=PROMPT, task_type="code", max_new_tokens=8)
    deadline = time.monotonic() + READY_S
    with grpc.insecure_channel(address) as channel:
        stub = api_grpc.SpecDecodeStub(channel)
        while True:
            assert server.poll() is None, f"specdec serve exited {server.returncode}:\n{log.read_text()[-4000:]}"
            try:
                return stub.Generate(request, timeout=60)
            except grpc.RpcError as e:
                if e.code() not in STARTING or time.monotonic() > deadline:
                    raise AssertionError(f"{e.code().name}: {e.details()}\n{log.read_text()[-4000:]}") from None
            time.sleep(2)
