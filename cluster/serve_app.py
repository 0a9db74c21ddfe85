"""The Ray Serve application: one ingress deployment answering gRPC (specdec.v1.SpecDecode) and
OpenAI-style HTTP, over the Frontend. `build_app` is what `specdec serve` runs and what a Serve
config (KubeRay's serveConfigV2) names by import path: `cluster.serve_app:build_app`. With API keys
configured (cluster/auth.py) every call but GET /healthz and GET /health must carry one."""

import asyncio
import contextlib
import logging
import os
from dataclasses import replace
from functools import partial
from pathlib import Path

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from ray import serve

from protos import specdec_api_pb2 as api

from . import auth, grpc_api, metrics
from .admission import Admitted
from .config import ConfigError, ServeConfig, app_config, default_models, parse_live_config
from .frontend import Frontend, check_served_models
from .openai_api import HttpError, OpenAIServer, read_body
from .placement import start_topology
from .samples import gather_samples, run_samples
from .statuses import client_error

log = logging.getLogger(__name__)

GRPC_SERVICER = "cluster.grpc_proxy.add_servicer"  # SpecDecode on Serve's gRPC proxy, streams stopped on hang-up


# The helpers come before the deployment: Serve pickles the ingress class as it is decorated.
def _header(scope, name: bytes) -> str | None:
    value = dict(scope["headers"]).get(name)  # ASGI gives header names lower-cased
    return value.decode("latin-1") if value is not None else None


class RequireApiKey:
    """ASGI middleware: with API keys configured, an HTTP request to any path but auth.OPEN_PATHS
    (/healthz) must carry one (`Authorization: Bearer <key>`), else it gets 401 with an OpenAI-style
    error and reaches no route. A middleware rather than a per-route check, so a route added later
    (or FastAPI's own /docs) is covered too. `keys()` -> the ingress's keys, or None: none asked."""

    def __init__(self, app, keys):
        self.app, self.keys = app, keys

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in auth.OPEN_PATHS:
            if (sent := sum(name == b"authorization" for name, _ in scope["headers"])) > 1:
                # one key decides both who may call and whose cache scope it uses (cache_per_api_key): never two
                await HttpError(400, f"send one Authorization header, got {sent}", None).response()(scope, receive, send)
                return
            try:
                auth.authorize(self.keys(), _header(scope, b"authorization"))
            except auth.Unauthenticated as e:
                response = HttpError(401, str(e), None, code="invalid_api_key").response()
                response.headers["WWW-Authenticate"] = "Bearer"
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _ingress_api_keys():
    """The keys of the ingress replica this runs in (its process serves one ingress)."""
    return serve.get_replica_context().servable_object.api_keys


HEALTH_TIMEOUT_S = 5.0  # rank 0 must answer /healthz's ping within this


@contextlib.contextmanager
def _status(grpc_context):
    """Any error as a gRPC status (cluster/statuses.py): a typed one's code and message as the details,
    anything else INTERNAL with a generic message (logged in full under the id it names). Serve's proxy
    answers with a code and details set before the handler raises. What is raised is a builtin
    RuntimeError with the same message: the proxy unpickles it, and one of specdec's own types would make
    the proxy import specdec, torch and transformers first, holding up every request it serves for seconds."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - every error leaves as a status; none with its internals
        seen = client_error(e)
        grpc_context.set_code(seen.status.grpc)
        grpc_context.set_details(seen.message)
        raise RuntimeError(seen.message) from None


def _death_line(reason: str) -> str:
    """The outage's first clause, which names the rank that died ("target rank 0 died (...)"), without
    what a failed rebuild raised after it (that is logged)."""
    return reason.split(";")[0].strip()


http_app = FastAPI(title="specdec", summary="Speculative decoding, OpenAI-compatible")
http_app.add_middleware(RequireApiKey, keys=_ingress_api_keys)


@serve.deployment(ray_actor_options={"num_cpus": 0}, health_check_period_s=10)
@serve.ingress(http_app)
class SpecDecodeIngress:
    def __init__(self, config: dict):
        cfg = ServeConfig.model_validate(config)
        self.api_keys = auth.load_api_keys(cfg.security.api_keys_file, os.environ)  # before the slow start
        auth.check_cache_per_api_key(cfg.security.cache_per_api_key, self.api_keys)
        check_served_models(cfg)  # before any actor takes a GPU
        self.frontend = Frontend(cfg, start_topology(cfg))  # the actors are this replica's: they go with it
        self.openai = OpenAIServer(self.frontend, Path(self.frontend.cfg.models.target.path).name)
        self.responses = grpc_api.Responses(self.frontend.tokenizer)

    def reconfigure(self, user_config: dict) -> None:
        """Serve calls this with the deployment's user_config at start and whenever it changes (KubeRay
        applies an edited serveConfigV2 in place, without restarting anything). It holds the routing
        section only; an invalid update is refused as a whole, logged naming the key, and the
        running routing kept."""
        try:
            routing = parse_live_config(user_config)
            routing.check_drafters(self.frontend.cfg.speculation.kinds())
        except (ConfigError, ValueError) as e:
            log.error("routing update refused, the running routing is kept:\n%s", e)
            return
        self.frontend.reconfigure(routing)
        log.info("routing updated")

    async def check_health(self) -> None:
        """Serve's health check fails only when the ingress itself is broken (Serve then restarts it): a lost
        target group is rebuilt in place by the frontend's supervisor, so its loss is not a failure here
        unless it stays down (cluster/supervisor.py)."""
        if problem := self.frontend.supervisor.broken():
            raise RuntimeError(problem)

    # --- gRPC: specdec.v1.SpecDecode ---------------------------------------------------------------

    async def Generate(self, request: api.GenerateRequest, grpc_context) -> api.GenerateResponse:
        """Sample 0 in the response's own fields, samples 1..n-1 in more_samples."""
        self._authorize_grpc(grpc_context)
        with _status(grpc_context):
            job = await self._admit_grpc(request, grpc_context)
            first, *more = [self.responses.sample(s) for s in await gather_samples(self.frontend, [job])]
        first.more_samples.extend(more)
        return first

    async def GenerateStream(self, request: api.GenerateRequest, grpc_context):
        self._authorize_grpc(grpc_context)
        with _status(grpc_context):
            job = await self._admit_grpc(request, grpc_context)
            async for index, chunk in run_samples(self.frontend, [job]):
                yield self.responses.chunk(index, chunk)

    async def GetStats(self, request: api.GetStatsRequest, grpc_context) -> api.GetStatsResponse:
        self._authorize_grpc(grpc_context)
        with _status(grpc_context):
            stats = await self.frontend.stats()
        return grpc_api.stats_response(stats)

    def _authorize_grpc(self, grpc_context) -> None:
        """The call's `authorization` metadata carries one of the API keys (if any are set); else
        UNAUTHENTICATED, before anything else is looked at."""
        try:
            auth.authorize(self.api_keys, dict(grpc_context.invocation_metadata()).get("authorization"))
        except auth.Unauthenticated as e:
            seen = client_error(e)
            grpc_context.set_code(seen.status.grpc)
            grpc_context.set_details(seen.message)
            raise

    async def _admit_grpc(self, request: api.GenerateRequest, grpc_context) -> Admitted:
        tenant = self._tenant(dict(grpc_context.invocation_metadata()).get("authorization"))
        return await self.frontend.admission.admit_async(replace(grpc_api.request_from_proto(request), tenant=tenant))

    def _tenant(self, authorization: str | None) -> str:
        """The scope of the caller's API key, with security.cache_per_api_key (an authorized call's); else none."""
        return auth.tenant_of(authorization) if self.frontend.cfg.security.cache_per_api_key else ""

    # --- HTTP: OpenAI's API (cluster/openai_api.py) ------------------------------------------------

    @http_app.get("/v1/models")
    async def models(self) -> dict:
        return self.openai.models()

    @http_app.get("/v1/models/{model:path}")
    async def model(self, model: str):
        try:
            self.openai.check_model(model)
        except HttpError as e:
            return e.response()
        return self.openai.model_card()

    @http_app.post("/v1/completions")
    async def completions(self, http: HttpRequest):
        return await self._with_body(http, partial(self.openai.completions,
                                                   tenant=self._tenant(http.headers.get("authorization"))))

    @http_app.post("/v1/chat/completions")
    async def chat_completions(self, http: HttpRequest):
        return await self._with_body(http, partial(self.openai.chat,
                                                   tenant=self._tenant(http.headers.get("authorization"))))

    @http_app.post("/v1/admin/forget_outputs")
    async def forget_outputs(self):
        """The draft replicas forget the outputs of earlier requests (their suffix drafts' store):
        {"forgotten_tokens": n}; 403 unless server.allow_forget_outputs."""
        return await self._forget("outputs", self.frontend.cfg.server.allow_forget_outputs,
                                  self.frontend.forget_outputs)

    @http_app.post("/v1/admin/forget_prefixes")
    async def forget_prefixes(self):
        """The target and the draft replicas empty their prefix caches, as a fresh server's: {"forgotten_tokens": n};
        403 unless server.allow_forget_prefixes."""
        return await self._forget("prefixes", self.frontend.cfg.server.allow_forget_prefixes,
                                  self.frontend.forget_prefixes)

    @staticmethod
    async def _forget(what: str, allowed: bool, forget):
        """An admin route that makes the server forget `what`: {"forgotten_tokens": n}, or 403 naming the key
        (server.allow_forget_<what>) that allows it."""
        if not allowed:
            return HttpError(403, f"forgetting {what} is off on this server: set server.allow_forget_{what}: true",
                             None, "permission_error").response()
        return {"forgotten_tokens": await forget()}

    @http_app.get("/v1/stats")
    async def stats(self) -> dict:
        return (await self.frontend.stats()).to_json()

    @http_app.post("/tokenize")
    async def tokenize(self, http: HttpRequest):
        return await self._with_body(http, self.openai.tokenize)

    @http_app.post("/detokenize")
    async def detokenize(self, http: HttpRequest):
        return await self._with_body(http, self.openai.detokenize)

    @http_app.get("/version")
    async def version(self) -> dict:
        return {"version": metrics.served_version()}

    @http_app.get("/metrics")
    async def prometheus(self):
        """The Prometheus metrics this node's Ray metrics agent exports (vLLM serves its own at /metrics):
        the ingress's, and the actors' placed on this node; 503 while the agent does not answer."""
        try:
            text = await asyncio.to_thread(metrics.node_metrics_text)
        except OSError as e:
            log.warning("/metrics: this node's Ray metrics agent did not answer: %s", e)
            return PlainTextResponse("this node's Ray metrics agent does not answer\n", status_code=503)
        return PlainTextResponse(text, media_type=metrics.PROMETHEUS_TEXT)

    @http_app.get("/health")
    async def health(self):
        """vLLM's /health: 200 (empty) while the target group and the replicas serve, else 503 with the
        reason (as /healthz)."""
        reason = await self._unhealthy()
        if reason is not None:
            return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)
        return Response(status_code=200)

    async def _with_body(self, http: HttpRequest, answer):
        """`answer(body)` with the request's body read under server.max_request_bytes (413 over it)."""
        try:
            body = await read_body(http, self.frontend.cfg.server.max_request_bytes)
        except Exception as e:  # noqa: BLE001 - 413 over the limit; anything else in OpenAI's shape too
            return HttpError.of(e).response()
        return await answer(body)

    @http_app.get("/healthz")
    async def healthz(self):
        """200 {"status": "ok"} while the target group serves; 503 {"status": "unavailable", "reason": ...}
        while it is down (being rebuilt), or the ingress is broken, or rank 0 does not answer. Open to
        anyone (no key): the reason is a line in words, the details (Ray's errors) go to the log."""
        reason = await self._unhealthy()
        if reason is not None:
            return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)
        return {"status": "ok"}

    async def _unhealthy(self) -> str | None:
        supervisor = self.frontend.supervisor
        if supervisor.broken() is not None:
            log.warning("/healthz: the ingress cannot serve: %s", supervisor.broken())
            return "ingress broken: the target group cannot be kept up (it will be restarted)"
        if (outage := supervisor.outage) is not None:
            log.warning("/healthz: the target group is down: %s", outage.reason)
            return f"target group unavailable: {_death_line(outage.reason)}; being rebuilt"
        try:
            await asyncio.wait_for(self.frontend.topology.target.ready.remote(), HEALTH_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - any failure means not serving; the log has what it was
            log.warning("/healthz: target rank 0 did not answer", exc_info=True)
            return "target group unavailable: its rank 0 does not answer"
        return None


def build_app(args: dict) -> serve.Application:
    """The application for a Serve config: args {"config": path to the operator YAML} (optional; without
    it the models given as target/draft, else the embedded default pair), plus overrides of `specdec
    serve`'s flags. The routing section goes in as the deployment's user_config, so a Serve config
    (KubeRay's serveConfigV2) can change it in place: see reconfigure."""
    cfg = app_config(args, default_models)
    ingress = SpecDecodeIngress.options(max_ongoing_requests=cfg.server.max_queued_requests + 16,
                                        user_config={"routing": cfg.routing.model_dump()})
    return ingress.bind(cfg.model_dump())
