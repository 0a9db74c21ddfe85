"""Authentication, over real gRPC and HTTP on loopback.

Internal: the target's specdec.v1.TargetService answers only calls that carry the topology's secret
(and, with TLS files, a certificate from the CA); a refused call changes nothing. Public: with API
keys set, the ingress refuses a missing or wrong key on gRPC (UNAUTHENTICATED) and HTTP (401, also
as the openai client sees it), and /healthz stays open."""

import datetime
import ipaddress
import json
import urllib.error
import urllib.request
from concurrent import futures

import grpc
import openai
import pytest
import ray
from ray import serve

from specdec.scheduler import KvBudget, TargetScheduler
from actors.security import MAX_MESSAGE_BYTES, BearerKeys, LinkSecurity, TlsFiles, bearer, serve_target, target_channel
from actors.target_service import TargetService
from cluster.auth import API_KEYS_ENV, Unauthenticated, api_channel, authorize, load_api_keys
from cluster.config import ConfigError
from cluster.serve_app import build_app
from conftest import served_target, start_serving
from cluster.local import free_port
from protos import specdec_api_pb2 as api
from protos import specdec_api_pb2_grpc as api_grpc
from protos import specdec_tree_pb2 as tree_pb
from protos import specdec_tree_pb2_grpc as tree_grpc
from specdec.errors import InvalidArgument
from specdec.kvcache import CachedLM
from specdec.target import TargetWorker

SECRET = "the-topology-secret"
OPEN = tree_pb.OpenRequest(request_id="r", prompt=[1, 2, 3], params=tree_pb.SamplingParams(), max_new_tokens=4)
REFUSED_INTERNAL = [
    ("Open", OPEN),
    ("Verify", tree_pb.VerifyRequest(trees=[tree_pb.CandidateTree(request_id="r", tokens=[3], parents=[-1],
                                                                  proposal_ids=[-1], from_model=[True])])),
    ("Close", tree_pb.CloseRequest(request_ids=["r"])),
]


# --- bearer keys ---------------------------------------------------------------------------------------------


def test_bearer_keys_accept_only_their_keys():
    keys = BearerKeys(["k1", "k2-longer"])
    assert keys.allows("Bearer k1") and keys.allows("bearer k2-longer") and keys.allows("Bearer  k1 ")
    for header in (None, "", "k1", "Bearer", "Bearer ", "Bearer k3", "Bearer k1x", "Basic k1", "Bearer k2"):
        assert not keys.allows(header), header
    for bad in ([], [""], ["two words"], [" padded"]):
        with pytest.raises(ValueError):
            BearerKeys(bad)


def test_two_authorization_headers_are_refused_before_any_route():
    """The key that lets a request in is the one its cache scope comes from (security.cache_per_api_key): with two
    headers the middleware read the last and the route the first, so a right key let a guessed one pick the scope."""
    import asyncio

    from cluster.serve_app import RequireApiKey

    reached, sent = [], []

    async def app(scope, receive, send):
        reached.append(scope["path"])

    async def receive():
        return {"type": "http.request", "body": b""}

    async def send(message):
        sent.append(message)

    middleware = RequireApiKey(app, lambda: BearerKeys(["key-A"]))
    headers = [(b"authorization", b"Bearer someone-elses-guess"), (b"authorization", b"Bearer key-A")]
    asyncio.run(middleware({"type": "http", "path": "/v1/completions", "headers": headers}, receive, send))
    assert not reached and sent[0]["status"] == 400
    assert b"one Authorization header, got 2" in b"".join(m.get("body", b"") for m in sent)
    asyncio.run(middleware({"type": "http", "path": "/v1/completions", "headers": headers[1:]}, receive, send))
    assert reached == ["/v1/completions"]


def test_api_keys_come_from_the_environment_else_the_file(tmp_path):
    path = tmp_path / "keys"
    path.write_text("#not-a-key\nfile-key-1\n\n  file-key-2  \n")
    from_file = load_api_keys(str(path), {})
    assert len(from_file) == 2 and from_file.allows("Bearer file-key-2") and not from_file.allows("Bearer #not-a-key")
    from_env = load_api_keys(str(path), {API_KEYS_ENV: " env-1, env-2 ,"})  # the variable wins over the file
    assert len(from_env) == 2 and from_env.allows("Bearer env-2") and not from_env.allows("Bearer file-key-1")
    assert load_api_keys(None, {}) is None and load_api_keys(None, {API_KEYS_ENV: " "}) is None  # off
    authorize(None, None)  # no keys: nothing is asked
    with pytest.raises(Unauthenticated, match="missing or wrong API key"):
        authorize(from_file, "Bearer env-1")


def test_unusable_api_keys_stop_the_start_naming_where_they_came_from(tmp_path):
    missing = tmp_path / "absent"
    with pytest.raises(ConfigError, match=f"^security.api_keys_file: cannot read {missing} \\(No such file"):
        load_api_keys(str(missing), {})
    empty = tmp_path / "empty"
    empty.write_text("# nothing yet\n\n")
    with pytest.raises(ConfigError, match=f"^security.api_keys_file: {empty}: holds no keys"):
        load_api_keys(str(empty), {})
    with pytest.raises(ConfigError, match=f"^{API_KEYS_ENV}: holds no keys"):
        load_api_keys(None, {API_KEYS_ENV: ",,"})
    with pytest.raises(ConfigError, match=f"^{API_KEYS_ENV}: a key must be non-empty and contain no whitespace"):
        load_api_keys(None, {API_KEYS_ENV: "a b"})


# --- the internal link: TargetService over real gRPC ---------------------------------------------------------


@pytest.fixture
def scheduler(target):
    scheduler = TargetScheduler(TargetWorker(CachedLM(target)), KvBudget())
    yield scheduler
    scheduler.stop()


def start_target(scheduler, security: LinkSecurity) -> tuple[grpc.Server, str]:
    server, port = serve_target(TargetService(scheduler), tree_grpc.add_TargetServiceServicer_to_server, "127.0.0.1",
                                security)
    return server, f"127.0.0.1:{port}"


def held(scheduler) -> tuple[int, int]:
    stats = scheduler.stats()
    return stats.open_requests, stats.waiting


def call(channel: grpc.Channel, method: str, request):
    with channel:
        return getattr(tree_grpc.TargetServiceStub(channel), method)(request, timeout=10)


def test_calls_without_the_topology_secret_are_refused_and_change_nothing(scheduler):
    server, address = start_target(scheduler, LinkSecurity(SECRET))
    try:
        call(target_channel(address, LinkSecurity(SECRET)), "Open", tree_pb.OpenRequest(
            request_id="kept", prompt=[4, 5], params=tree_pb.SamplingParams(), max_new_tokens=4))
        strangers = [lambda: grpc.insecure_channel(address),  # no credential at all
                     lambda: target_channel(address, LinkSecurity("a-guessed-secret")),
                     lambda: target_channel(address, LinkSecurity(SECRET + "x"))]
        for make_channel in strangers:
            for method, request in REFUSED_INTERNAL + [("Close", tree_pb.CloseRequest(request_ids=["kept"]))]:
                with pytest.raises(grpc.RpcError) as e:
                    call(make_channel(), method, request)
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, (method, e.value)
                assert "topology's secret" in e.value.details()
        assert held(scheduler) == (1, 0)  # nothing opened by them, and "kept" was not closed
        call(target_channel(address, LinkSecurity(SECRET)), "Open", OPEN)  # the secret opens it
        assert held(scheduler) == (2, 0)
        call(target_channel(address, LinkSecurity(SECRET)), "Close", tree_pb.CloseRequest(request_ids=["r", "kept"]))
    finally:
        server.stop(grace=None)


def test_messages_over_the_limit_are_refused_at_both_ends(scheduler):
    server, address = start_target(scheduler, LinkSecurity(SECRET))
    huge = tree_pb.OpenRequest(request_id="x" * (MAX_MESSAGE_BYTES + 1), prompt=[1])
    try:
        with pytest.raises(grpc.RpcError) as sent:  # our channel will not send it
            call(target_channel(address, LinkSecurity(SECRET)), "Open", huge)
        unlimited = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", -1)])
        with pytest.raises(grpc.RpcError) as received:  # and the server will not take it, even with the secret
            with unlimited:
                tree_grpc.TargetServiceStub(unlimited).Open(huge, metadata=[("authorization", bearer(SECRET))],
                                                            timeout=30)
    finally:
        server.stop(grace=None)
    assert sent.value.code() == received.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert held(scheduler) == (0, 0)


# --- mutual TLS on the internal link --------------------------------------------------------------------------


def _pem_pair(common_name: str, issuer=None, server_name: str | None = None):
    """A key and certificate: self-signed CA (issuer None) or signed by issuer = (key, cert)."""
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    signer_key, signer_name = (key, name) if issuer is None else (issuer[0], issuer[1].subject)
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(name).issuer_name(signer_name).public_key(key.public_key())
               .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
               .not_valid_after(now + datetime.timedelta(hours=1))
               .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True))
    if server_name:  # and loopback's address, for clients that connect to 127.0.0.1 by address
        names = [x509.DNSName(server_name), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    cert = builder.sign(signer_key, hashes.SHA256())
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return key, cert, key_pem, cert.public_bytes(serialization.Encoding.PEM)


def tls_files(tmp_path, name: str, server_name: str = "specdec-target") -> TlsFiles:
    """A CA and a certificate it signed for `server_name` (used as server and client certificate)."""
    ca_key, ca_cert, ca_key_pem, ca_pem = _pem_pair(f"{name} CA")
    _, _, key_pem, cert_pem = _pem_pair(server_name, issuer=(ca_key, ca_cert), server_name=server_name)
    paths = {}
    for kind, pem in (("cert", cert_pem), ("key", key_pem), ("ca", ca_pem), ("ca-key", ca_key_pem)):
        paths[kind] = tmp_path / f"{name}-{kind}.pem"
        paths[kind].write_bytes(pem)
    return TlsFiles(str(paths["cert"]), str(paths["key"]), str(paths["ca"]), server_name)


def test_mutual_tls_needs_a_certificate_from_the_ca_and_the_secret(scheduler, tmp_path):
    tls, rogue = tls_files(tmp_path, "ours"), tls_files(tmp_path, "rogue")
    server, address = start_target(scheduler, LinkSecurity(SECRET, tls))
    ca = open(tls.ca, "rb").read()
    try:
        refused = {
            "plaintext": grpc.insecure_channel(address),
            "no client certificate": grpc.secure_channel(address, grpc.ssl_channel_credentials(ca), options=[
                ("grpc.ssl_target_name_override", tls.server_name)]),
            "a certificate from another CA": target_channel(address, LinkSecurity(SECRET, TlsFiles(
                rogue.cert, rogue.key, tls.ca, tls.server_name))),
        }
        for why, channel in refused.items():
            with pytest.raises(grpc.RpcError) as e:
                call(channel, "Open", OPEN)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE, why  # the TLS handshake fails
        with pytest.raises(grpc.RpcError) as e:  # a good certificate is not enough without the secret
            call(target_channel(address, LinkSecurity("wrong", tls)), "Open", OPEN)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert held(scheduler) == (0, 0)
        call(target_channel(address, LinkSecurity(SECRET, tls)), "Open", OPEN)
        assert held(scheduler) == (1, 0)
        with pytest.raises(grpc.RpcError) as e:  # a target whose certificate lacks the expected name
            call(target_channel(address, LinkSecurity(SECRET, TlsFiles(tls.cert, tls.key, tls.ca, "elsewhere"))),
                 "Close", tree_pb.CloseRequest(request_ids=["r"]))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and held(scheduler) == (1, 0)
    finally:
        server.stop(grace=None)


def test_unreadable_tls_files_are_named():
    with pytest.raises(OSError, match="internal TLS private key /nowhere/key.pem: cannot read it"):
        TlsFiles(__file__, "/nowhere/key.pem", __file__, "specdec-target").read()


def test_a_separate_client_certificate_is_what_a_replica_presents(scheduler, tmp_path):
    """TlsFiles.client_cert/client_key (security.internal_tls.client_cert/client_key): the replica presents
    them, not the server's pair; a client pair from another CA is refused even with the server pair right."""
    tls = tls_files(tmp_path, "ours")
    ca_key, ca_cert = _ca(tmp_path, "ours")
    _, _, client_key_pem, client_cert_pem = _pem_pair("specdec-draft", issuer=(ca_key, ca_cert))
    (tmp_path / "client-cert.pem").write_bytes(client_cert_pem)
    (tmp_path / "client-key.pem").write_bytes(client_key_pem)
    rogue = tls_files(tmp_path, "rogue")
    server, address = start_target(scheduler, LinkSecurity(SECRET, tls))
    try:
        ours = TlsFiles(tls.cert, tls.key, tls.ca, tls.server_name, str(tmp_path / "client-cert.pem"),
                        str(tmp_path / "client-key.pem"))
        assert ours.read_client()[0] == client_cert_pem and ours.read()[0] != client_cert_pem
        call(target_channel(address, LinkSecurity(SECRET, ours)), "Open", OPEN)
        assert held(scheduler) == (1, 0)
        theirs = TlsFiles(tls.cert, tls.key, tls.ca, tls.server_name, rogue.cert, rogue.key)
        with pytest.raises(grpc.RpcError) as e:
            call(target_channel(address, LinkSecurity(SECRET, theirs)), "Close", tree_pb.CloseRequest(request_ids=["r"]))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and held(scheduler) == (1, 0)
    finally:
        server.stop(grace=None)


def _ca(tmp_path, name: str):
    """The CA tls_files(tmp_path, name) made, as (key, certificate)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_private_key((tmp_path / f"{name}-ca-key.pem").read_bytes(), None)
    return key, x509.load_pem_x509_certificate((tmp_path / f"{name}-ca.pem").read_bytes())


def test_client_files_are_checked_at_start_and_go_together():
    import pydantic

    from cluster.config import SecurityConfig
    from cluster.placement import link_security

    tls = {"cert": __file__, "key": __file__, "ca": __file__}
    with pytest.raises(pydantic.ValidationError, match="client_cert and client_key go together"):
        SecurityConfig.model_validate({"internal_tls": {**tls, "client_cert": __file__}})
    config = SecurityConfig.model_validate({"internal_tls": {**tls, "client_cert": __file__,
                                                             "client_key": "/nowhere/client.key"}})
    with pytest.raises(ConfigError, match="security.internal_tls.client_key: cannot read /nowhere/client.key"):
        config.check_internal_tls_files()
    files = link_security(SecurityConfig.model_validate({"internal_tls": {**tls, "client_cert": "c.pem",
                                                                          "client_key": "k.pem"}})).tls
    assert (files.client_cert, files.client_key) == ("c.pem", "k.pem")
    assert link_security(SecurityConfig.model_validate({"internal_tls": tls})).tls.client_cert is None


def _target_rank_arguments(security: LinkSecurity) -> tuple:
    """What cluster.placement.start_target_ranks passes to TargetRank's constructor -> (args, kwargs)."""
    import unittest.mock
    from pathlib import Path

    from actors.security import SharedSecurity
    from cluster import placement
    from cluster.config import load_config

    recorded = []

    class Recorder:
        @classmethod
        def options(cls, **_):
            return cls

        @classmethod
        def remote(cls, *args, **kwargs):
            recorded.append((args, kwargs))
            rank = unittest.mock.Mock()
            rank.ready.remote.return_value = ray.put(True)
            rank.address.remote.return_value = ray.put("127.0.0.1:1")
            return rank

    config = load_config(Path(__file__).resolve().parent.parent / "tools" / "bench" / "shared-pair.yaml")
    with unittest.mock.patch.object(placement, "TargetRank", Recorder):
        placement.start_target_ranks(config, object(), "tag", SharedSecurity.put(security), timeout_s=30)  # as start_topology
    (args,) = recorded
    return args


def test_the_secret_is_in_no_repr_and_no_actor_argument(tmp_path):
    """LinkSecurity and Topology do not show the secret; actors get it through Ray's object store
    (SharedSecurity): their creation arguments hold an object reference, not the secret."""
    import pickle

    from actors.security import SharedSecurity, resolve
    from cluster.placement import Topology

    security = LinkSecurity(SECRET, tls_files(tmp_path, "ours"))
    topology = Topology([], [], [], "127.0.0.1:1", "tag", security)
    assert SECRET not in repr(security) and SECRET not in repr(topology) and SECRET not in str(topology)
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        shared = SharedSecurity.put(security)
        assert SECRET.encode() not in pickle.dumps(shared) and SECRET not in repr(shared)

        @ray.remote(num_cpus=0)
        class Holder:
            def __init__(self, *, security):
                self.security = resolve(security)

            def secret_matches(self, secret: str) -> bool:
                return self.security.secret == secret

        holder = Holder.remote(security=shared)
        assert ray.get(holder.secret_matches.remote(SECRET), timeout=120)
        ray.kill(holder)
        # and the target ranks are started that way (the actor class recorded, not started)
        args = _target_rank_arguments(security)
        assert SECRET not in repr(args) and SECRET.encode() not in pickle.dumps(args)
        assert resolve(args[1]["security"]).secret == SECRET
    finally:
        if started:
            ray.shutdown()


# --- the public API: build_app on a local Ray cluster with keys ----------------------------------------------

KEYS = ["key-one", "key-two"]


@pytest.fixture(scope="module")
def keyed_server(model_dirs, tmp_path_factory):
    """The smallest serving topology (one target rank, no drafts) with API keys from a file, each key's
    requests sharing the prefix cache only with its own (security.cache_per_api_key)."""
    root = tmp_path_factory.mktemp("auth")
    keys_file = root / "api-keys"
    keys_file.write_text("# one per line\n" + "\n".join(KEYS) + "\n")
    config = {"models": {"target": {"path": served_target(model_dirs, root)}},
              "speculation": {"drafter": "none"},
              "server": {"grpc_port": free_port(), "http_port": free_port()},
              "security": {"api_keys_file": str(keys_file), "cache_per_api_key": True}}
    path = start_serving(config, root, num_cpus=2, num_gpus=1)
    ports = config["server"]
    serve.run(build_app({"config": str(path)}), name="specdec", route_prefix="/")
    yield f"http://127.0.0.1:{ports['http_port']}", f"127.0.0.1:{ports['grpc_port']}"
    serve.shutdown()
    ray.shutdown()


def http(url: str, body: dict | None = None, key: str | None = None) -> tuple[int, dict, object]:
    headers = {"Content-Type": "application/json"} | ({"Authorization": bearer(key)} if key else {})
    data = json.dumps(body).encode() if body is not None else None
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers), timeout=60) as r:
            return r.status, json.loads(r.read()), r.headers
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), e.headers


def test_http_needs_a_key_except_healthz(keyed_server):
    root, _ = keyed_server
    completion = {"prompt": "w5 w17 w3", "max_tokens": 4, "temperature": 0}
    for path, body in [("/v1/completions", completion), ("/v1/models", None), ("/v1/stats", None), ("/docs", None),
                       ("/v1/nowhere", None), ("/metrics", None), ("/version", None), ("/tokenize", {"prompt": "w5"}),
                       ("/detokenize", {"tokens": [5]})]:
        for key in (None, "key-three", "key-one-"):
            status, reply, headers = http(root + path, body, key)
            assert status == 401, (path, key, reply)
            assert reply["error"]["code"] == "invalid_api_key" and "API key" in reply["error"]["message"]
            assert headers["WWW-Authenticate"] == "Bearer"
    assert http(root + "/healthz")[:2] == (200, {"status": "ok"})
    with urllib.request.urlopen(root + "/health", timeout=60) as r:  # vLLM's probe: open too, an empty 200
        assert (r.status, r.read()) == (200, b"")
    assert http(root + "/tokenize", {"prompt": "w5"}, KEYS[0])[:2][0] == 200
    for key in KEYS:
        status, reply, _ = http(root + "/v1/completions", completion, key)
        assert status == 200 and len(reply["choices"][0]["token_ids"]) == 4
    assert http(root + "/v1/models", key=KEYS[1])[0] == 200


def test_with_cache_per_api_key_no_key_reuses_anothers_cached_prompt(keyed_server):
    """Whatever cache_salt a client sends, its key's requests reuse only prompts cached by requests with the same
    key (and salt), over HTTP and gRPC; the output is the same for every key."""
    root, address = keyed_server
    prompt = " ".join(f"w{(13 * i + 2) % 60 + 1}" for i in range(40))  # past two 16-token blocks

    def hits() -> int:
        return http(root + "/v1/stats", key=KEYS[0])[1]["target"]["prefix_hit_tokens"]

    def over_http(key: str, salt: str | None = None) -> list[int]:
        body = {"prompt": prompt, "max_tokens": 4, "temperature": 0} | ({"cache_salt": salt} if salt else {})
        status, reply, _ = http(root + "/v1/completions", body, key)
        assert status == 200, reply
        return reply["choices"][0]["token_ids"]

    def over_grpc(key: str, salt: str | None = None) -> list[int]:
        with api_channel(address, key) as channel:
            reply = api_grpc.SpecDecodeStub(channel).Generate(
                api.GenerateRequest(prompt=prompt, max_new_tokens=4, cache_salt=salt), timeout=60)
        return list(reply.token_ids)

    want = over_http(KEYS[0])
    before = hits()
    assert over_http(KEYS[1]) == want
    assert over_grpc(KEYS[0], "tenant-a") == want  # a salt within key-one's scope: not its unsalted prompts
    assert hits() == before
    assert over_grpc(KEYS[1]) == want  # key-two's own, cached over HTTP
    assert hits() - before >= 32
    middle = hits()
    assert over_grpc(KEYS[0]) == want  # key-one's own
    assert hits() - middle >= 32
    status, reply, _ = http(root + "/v1/completions", {"prompt": prompt, "cache_salt": ""}, KEYS[1])
    assert status == 400 and reply["error"]["param"] == "cache_salt"


def test_cache_per_api_key_needs_keys_and_scopes_every_salt_by_its_key():
    from cluster.admission import scoped_salt
    from cluster.auth import check_cache_per_api_key, tenant_of

    with pytest.raises(ConfigError, match="security.cache_per_api_key: needs API keys"):
        check_cache_per_api_key(True, None)
    check_cache_per_api_key(True, BearerKeys(KEYS))
    check_cache_per_api_key(False, None)
    one, two = (tenant_of(bearer(key)) for key in KEYS)
    assert one != two and tenant_of(bearer(KEYS[0])) == one and KEYS[0] not in one
    assert scoped_salt("", "mine") == "mine" and scoped_salt("", None) is None  # no scoping: the client's own
    salts = [scoped_salt(t, s) for t in (one, two) for s in (None, "mine", "other")]
    assert len(set(salts)) == 6 and "mine" not in salts
    assert scoped_salt(one, "mine") == scoped_salt(one, "mine")
    for bad in ("", "x" * 257):
        with pytest.raises(InvalidArgument, match="cache_salt"):
            scoped_salt(one, bad)


def test_the_openai_client_needs_a_right_api_key(keyed_server):
    root, _ = keyed_server
    for wrong in ("unused", "key-one " + "x"):
        client = openai.OpenAI(base_url=f"{root}/v1", api_key=wrong, max_retries=0)
        with pytest.raises(openai.AuthenticationError) as e:
            client.completions.create(model="target", prompt="w5 w17", max_tokens=2)
        assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    client = openai.OpenAI(base_url=f"{root}/v1", api_key=KEYS[0], max_retries=0)
    reply = client.completions.create(model="target", prompt="w5 w17", max_tokens=2, temperature=0)
    assert reply.usage.completion_tokens == 2


def test_grpc_needs_a_key(keyed_server):
    _, address = keyed_server
    request = api.GenerateRequest(prompt="w5 w17 w3", max_new_tokens=3)
    calls = [lambda stub: stub.Generate(request, timeout=60),
             lambda stub: list(stub.GenerateStream(request, timeout=60)),
             lambda stub: stub.GetStats(api.GetStatsRequest(), timeout=60)]
    for key in (None, "key-three"):
        with api_channel(address, key) as channel:
            for make_call in calls:
                with pytest.raises(grpc.RpcError) as e:
                    make_call(api_grpc.SpecDecodeStub(channel))
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and "API key" in e.value.details()
    with api_channel(address, KEYS[1]) as channel:
        stub = api_grpc.SpecDecodeStub(channel)
        assert len(stub.Generate(request, timeout=60).token_ids) == 3
        assert [t for chunk in stub.GenerateStream(request, timeout=60) for t in chunk.token_ids]
        assert stub.GetStats(api.GetStatsRequest(), timeout=60).task_types is not None


def test_specdec_client_sends_its_api_key(keyed_server, capsys, monkeypatch):
    from tools.commands import main

    _, address = keyed_server
    base = ["client", "--address", address, "--prompt", "w5 w17", "--max-new-tokens", "2", "--json"]
    with pytest.raises(SystemExit, match="UNAUTHENTICATED: missing or wrong API key"):
        main(base)
    main(base + ["--api-key", KEYS[0]])
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 2
    monkeypatch.setenv("SPECDEC_API_KEY", KEYS[1])
    main(base)  # the key from the environment
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 2


class RecordingSpecDecode(api_grpc.SpecDecodeServicer):
    """GetStats only, remembering each call's authorization metadata."""

    def __init__(self):
        self.authorizations = []

    def GetStats(self, request, context):
        self.authorizations.append(dict(context.invocation_metadata()).get("authorization"))
        return api.GetStatsResponse(task_types=[api.TaskTypeStats(task_type="code", decision="on", k=3)])


def test_specdec_client_speaks_tls_with_a_given_ca(tmp_path, capsys):
    """As through the TLS Ingress: the client trusts the CA in --tls-ca and still sends its key."""
    from tools.commands import main

    tls = tls_files(tmp_path, "edge")
    servicer, server = RecordingSpecDecode(), grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    api_grpc.add_SpecDecodeServicer_to_server(servicer, server)
    credentials = grpc.ssl_server_credentials([(open(tls.key, "rb").read(), open(tls.cert, "rb").read())])
    port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    try:
        main(["client", "--address", f"127.0.0.1:{port}", "--tls-ca", tls.ca, "--api-key", "k1", "--stats"])
        assert json.loads(capsys.readouterr().out)["code"]["k"] == 3
        with pytest.raises(SystemExit, match="UNAVAILABLE"):  # plaintext to a TLS port
            main(["client", "--address", f"127.0.0.1:{port}", "--stats"])
    finally:
        server.stop(grace=None)
    assert servicer.authorizations == ["Bearer k1"]

