"""The public API's keys, off unless configured: where they come from, the check the ingress makes on
both transports (cluster/serve_app.py), and a client channel that presents one.

Keys come from the environment variable SPECDEC_API_KEYS (comma separated) when it is set and not
empty, else from the file `security.api_keys_file` (one key per line; blank lines and lines starting
with # are skipped); with neither, no key is asked for. A caller presents a key as
`authorization: Bearer <key>`, an HTTP header or gRPC metadata. Keys are read once, when the ingress
starts: a changed key needs a restart of the ingress."""

import hashlib
import logging
from collections.abc import Mapping
from pathlib import Path

import grpc

from actors.security import BearerKeys, presented, with_bearer

from .config import ConfigError, check_readable

log = logging.getLogger(__name__)

API_KEYS_ENV = "SPECDEC_API_KEYS"  # the server's keys, comma separated (wins over security.api_keys_file)
API_KEY_ENV = "SPECDEC_API_KEY"  # the one key a client (specdec client, bench-served) presents
OPEN_PATHS = frozenset({"/healthz", "/health"})  # HTTP paths answered without a key (load balancers' probes)
REFUSAL = "missing or wrong API key: send one of the server's keys as 'Authorization: Bearer <key>'"


class Unauthenticated(PermissionError):
    """A call without one of the server's keys (gRPC UNAUTHENTICATED, HTTP 401)."""


def load_api_keys(api_keys_file: str | None, environ: Mapping[str, str]) -> BearerKeys | None:
    """The server's keys (see the module's docstring), or None when none are configured."""
    if environ.get(API_KEYS_ENV, "").strip():
        keys = [key.strip() for key in environ[API_KEYS_ENV].split(",") if key.strip()]
        source = API_KEYS_ENV + (f" (security.api_keys_file {api_keys_file} is ignored)" if api_keys_file else "")
        return _keys(keys, API_KEYS_ENV, source)
    if api_keys_file is None:
        log.warning("the public API asks for no key (neither security.api_keys_file nor %s is set)", API_KEYS_ENV)
        return None
    check_readable(api_keys_file, "security.api_keys_file")
    lines = (line.strip() for line in Path(api_keys_file).read_text(encoding="utf-8").splitlines())
    keys = [line for line in lines if line and not line.startswith("#")]
    return _keys(keys, f"security.api_keys_file: {api_keys_file}", f"security.api_keys_file {api_keys_file}")


def _keys(keys: list[str], where: str, source: str) -> BearerKeys:
    if not keys:
        raise ConfigError(f"{where}: holds no keys (leave it unset to serve without keys)")
    try:
        api_keys = BearerKeys(keys)
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None
    log.info("the public API asks for a key: %d key(s) from %s", len(api_keys), source)
    return api_keys


def authorize(keys: BearerKeys | None, authorization: str | None) -> None:
    """An `authorization` header or metadata value carries one of the keys (or none are configured);
    else Unauthenticated."""
    if keys is not None and not keys.allows(authorization):
        raise Unauthenticated(REFUSAL)


def check_cache_per_api_key(enabled: bool, keys: BearerKeys | None) -> None:
    """ConfigError when security.cache_per_api_key is on and the public API asks for no key."""
    if enabled and keys is None:
        raise ConfigError(f"security.cache_per_api_key: needs API keys (security.api_keys_file or {API_KEYS_ENV}); "
                          f"without them every request is one client's")


def tenant_of(authorization: str | None) -> str:
    """The scope of the key an authorized `authorization` value presents (security.cache_per_api_key): a digest
    of the key, the same for every call with it and unlike any other key's; the key itself goes nowhere."""
    _, key = presented(authorization)
    return hashlib.sha256(f"specdec-tenant:{key}".encode()).hexdigest()


def api_channel(address: str, api_key: str | None, tls: bool = False, ca_file: str | None = None) -> grpc.Channel:
    """A channel to specdec.v1.SpecDecode at host:port that presents `api_key` on every call (if given);
    over TLS with `tls` or a `ca_file` (the CA certificates to trust; default: the system's)."""
    if tls or ca_file:
        roots = Path(ca_file).read_bytes() if ca_file else None
        channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(roots))
    else:
        channel = grpc.insecure_channel(address)
    return with_bearer(channel, api_key) if api_key else channel
