"""The Ray Serve application: one ingress deployment answering gRPC (specdec.v1.SpecDecode) and
OpenAI-style HTTP, over the Frontend. `build_app` is what `specdec serve` runs and what a Serve
config (KubeRay's serveConfigV2) names by import path: `cluster.serve_app:build_app`. With API keys
configured (cluster/auth.py) every call but GET /healthz must carry one."""

import asyncio
import contextlib
import logging
import os
from pathlib import Path

import grpc
from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse
from ray import serve

from protos import specdec_api_pb2 as api
from specdec.errors import InvalidArgument
from specdec.logprobs import TokenLogprob

from . import auth
from .config import ConfigError, ServeConfig, app_config, parse_live_config
from .detokenizer import token_text
from .frontend import Admitted, Frontend, Request
from .openai_api import HttpError, OpenAIServer, read_body
from .router import Speculation
from .samples import Sample, gather_samples, run_samples
from .statuses import client_error

log = logging.getLogger(__name__)

GRPC_SERVICER = "cluster.grpc_proxy.add_servicer"  # SpecDecode on Serve's gRPC proxy, streams stopped on hang-up


# The helpers come before the deployment: Serve pickles the ingress class as it is decorated.
def _stats_proto(stats: dict) -> api.SpeculationStats:
    return api.SpeculationStats(speculative=stats["speculative"], drafted=stats["drafted"],
                                accepted=stats["accepted"], steps=stats["steps"], alpha=stats["alpha"])


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


def _target_proto(target: dict) -> api.TargetStats:
    """/v1/stats's target section as GetStats's TargetStats (unknown counts, while it is down, left unset)."""
    return api.TargetStats(**{key: value for key, value in target.items() if value is not None})


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
        self.frontend = Frontend(cfg)
        self.openai = OpenAIServer(self.frontend, Path(self.frontend.cfg.models.target.path).name)

    def reconfigure(self, user_config: dict) -> None:
        """Serve calls this with the deployment's user_config at start and whenever it changes (KubeRay
        applies an edited serveConfigV2 in place, without restarting anything). It holds the routing
        section only; an invalid update is refused as a whole, logged naming the key, and the
        running routing kept."""
        try:
            routing = parse_live_config(user_config)
        except ConfigError as e:
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
            job = await self._admit_grpc(request)
            first, *more = [self._sample_proto(s) for s in await gather_samples(self.frontend, job)]
        first.more_samples.extend(more)
        return first

    async def GenerateStream(self, request: api.GenerateRequest, grpc_context):
        self._authorize_grpc(grpc_context)
        with _status(grpc_context):
            job = await self._admit_grpc(request)
            async for index, chunk in run_samples(self.frontend, job):
                yield api.GenerateResponse(index=index, text=chunk.text, token_ids=chunk.token_ids,
                                           finish_reason=chunk.finish_reason or "",
                                           stats=_stats_proto(chunk.stats) if chunk.finish_reason else None,
                                           logprobs=self._logprobs_proto(chunk.logprobs))

    async def GetStats(self, request: api.GetStatsRequest, grpc_context) -> api.GetStatsResponse:
        self._authorize_grpc(grpc_context)
        with _status(grpc_context):
            stats = await self.frontend.stats()
        return api.GetStatsResponse(task_types=[
            api.TaskTypeStats(task_type=name, alpha=s["alpha"], decision=s["decision"], k=s["k"],
                              samples=s["samples"], requests=s["requests"], reason=s["reason"],
                              goodput=s["goodput"] or {})
            for name, s in stats["task_types"].items()], target=_target_proto(stats["target"]),
            in_flight=stats["in_flight"])

    def _authorize_grpc(self, grpc_context) -> None:
        """The call's `authorization` metadata carries one of the API keys (if any are set); else
        UNAUTHENTICATED, before anything else is looked at."""
        try:
            auth.authorize(self.api_keys, dict(grpc_context.invocation_metadata()).get("authorization"))
        except auth.Unauthenticated as e:
            grpc_context.set_code(grpc.StatusCode.UNAUTHENTICATED)
            grpc_context.set_details(str(e))
            raise

    async def _admit_grpc(self, request: api.GenerateRequest) -> Admitted:
        try:
            speculation = Speculation.parse(api.Speculation.Name(request.speculation))
        except ValueError:  # a number the enum does not name (proto3 enums take any)
            raise InvalidArgument("speculation", f"must be one of {', '.join(api.Speculation.keys())}") from None
        req = Request(prompt=request.prompt, task_type=request.task_type, max_new_tokens=request.max_new_tokens,
                      temperature=request.temperature, top_k=request.top_k,
                      top_p=request.top_p if request.HasField("top_p") else 1.0,
                      seed=request.seed if request.HasField("seed") else None,
                      speculation=speculation,
                      stop=tuple(request.stop), n=request.n or 1,
                      logprobs=request.logprobs if request.HasField("logprobs") else None)
        return await self.frontend.admit_async(req)

    def _sample_proto(self, s: Sample) -> api.GenerateResponse:
        return api.GenerateResponse(index=s.index, text=s.text, token_ids=s.token_ids, finish_reason=s.finish_reason,
                                    stats=_stats_proto(s.stats), logprobs=self._logprobs_proto(s.logprobs))

    def _logprobs_proto(self, entries: list[TokenLogprob]) -> list[api.TokenLogprob]:
        def one(token: int, logprob: float, top=()) -> api.TokenLogprob:
            return api.TokenLogprob(token_id=token, token=token_text(self.frontend.tokenizer, token), logprob=logprob,
                                    top=[one(t, lp) for t, lp in top])

        return [one(e.token, e.logprob, e.top) for e in entries]

    # --- HTTP: OpenAI's API (cluster/openai_api.py) ------------------------------------------------

    @http_app.get("/v1/models")
    async def models(self) -> dict:
        return self.openai.models()

    @http_app.get("/v1/models/{model:path}")
    async def model(self, model: str):
        if model != self.openai.model_name:
            return HttpError(404, f"model {model!r} is not served here (it serves {self.openai.model_name!r})",
                             "model").response()
        return self.openai.model_card()

    @http_app.post("/v1/completions")
    async def completions(self, http: HttpRequest):
        try:
            body = await read_body(http, self.frontend.cfg.server.max_request_bytes)
        except Exception as e:  # noqa: BLE001 - 413 over the limit; anything else in OpenAI's shape too
            return HttpError.of(e).response()
        return await self.openai.completions(body)

    @http_app.post("/v1/chat/completions")
    async def chat_completions(self, http: HttpRequest):
        try:
            body = await read_body(http, self.frontend.cfg.server.max_request_bytes)
        except Exception as e:  # noqa: BLE001 - as completions
            return HttpError.of(e).response()
        return await self.openai.chat(body)

    @http_app.get("/v1/stats")
    async def stats(self) -> dict:
        return await self.frontend.stats()

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


def default_models() -> dict[str, str]:
    """The embedded default pair (built on first use): {"target": dir, "draft": dir}."""
    from specdec.default_models import default_pair

    return default_pair()
