"""Authentication, over real gRPC on loopback.

Internal: the target's specdec.v1.TargetService answers only calls that carry the topology's secret
(and, with TLS files, a certificate from the CA); a refused call changes nothing."""

import datetime

import grpc
import pytest

from actors.scheduler import KvBudget, TargetScheduler
from actors.security import MAX_MESSAGE_BYTES, BearerKeys, LinkSecurity, TlsFiles, bearer, serve_target, target_channel
from actors.target_service import TargetService
from protos import specdec_tree_pb2 as tree_pb
from protos import specdec_tree_pb2_grpc as tree_grpc
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
    return stats["open_requests"], stats["waiting"]


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
    if server_name:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(server_name)]), critical=False)
    cert = builder.sign(signer_key, hashes.SHA256())
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return key, cert, key_pem, cert.public_bytes(serialization.Encoding.PEM)


def tls_files(tmp_path, name: str, server_name: str = "specdec-target") -> TlsFiles:
    """A CA and a certificate it signed for `server_name` (used as server and client certificate)."""
    ca_key, ca_cert, _, ca_pem = _pem_pair(f"{name} CA")
    _, _, key_pem, cert_pem = _pem_pair(server_name, issuer=(ca_key, ca_cert), server_name=server_name)
    paths = {}
    for kind, pem in (("cert", cert_pem), ("key", key_pem), ("ca", ca_pem)):
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
    with pytest.raises(FileNotFoundError, match="internal TLS private key /nowhere/key.pem: cannot read it"):
        TlsFiles(__file__, "/nowhere/key.pem", __file__, "specdec-target").read()
