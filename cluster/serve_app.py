"""The Ray Serve application: one ingress deployment answering gRPC (specdec.v1.SpecDecode) and
OpenAI-style HTTP, over the Frontend. `build_app` is what `specdec serve` runs and what a Serve
config (KubeRay's serveConfigV2) names by import path: `cluster.serve_app:build_app`."""

import json
import logging
import time
import uuid
from pathlib import Path
from typing import Annotated, Literal

import grpc
from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationError
from ray import serve

from protos import specdec_api_pb2 as api
from specdec.errors import InvalidArgument

from .config import ConfigError, ServeConfig, app_config, parse_live_config
from .frontend import Admitted, Chunk, Frontend, QueueFull, Request
from .router import Speculation

log = logging.getLogger(__name__)

GRPC_SERVICER = "protos.specdec_api_pb2_grpc.add_SpecDecodeServicer_to_server"
_HTTP_NAMES = {"max_new_tokens": "max_tokens"}  # a Request field -> its name in the OpenAI body


class CompletionBody(BaseModel):
    """POST /v1/completions: OpenAI's fields that specdec serves, plus task_type, speculation, top_k."""

    model_config = ConfigDict(extra="forbid")
    prompt: str
    model: str | None = None  # accepted and ignored: the server serves one model
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stream: bool = False
    n: Literal[1] = 1
    task_type: str = ""
    speculation: Annotated[Speculation, BeforeValidator(Speculation.parse)] = Speculation.AUTO


# The helpers come before the deployment: Serve pickles the ingress class as it is decorated.
def _stats_proto(stats: dict) -> api.SpeculationStats:
    return api.SpeculationStats(speculative=stats["speculative"], drafted=stats["drafted"],
                                accepted=stats["accepted"], steps=stats["steps"], alpha=stats["alpha"])


def _sse_event(head: dict, chunk: Chunk) -> dict:
    event = {**head, "choices": [{"index": 0, "text": chunk.text, "token_ids": chunk.token_ids,
                                  "finish_reason": chunk.finish_reason, "logprobs": None}]}
    return event | ({"speculation": chunk.stats} if chunk.finish_reason else {})


def _http_error(status: int, message: str, param: str | None, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}},
                        status_code=status)


http_app = FastAPI(title="specdec", summary="Speculative decoding, OpenAI-style completions")


def _parse_body(raw: bytes) -> CompletionBody | JSONResponse:
    """The body as JSON whatever its content type (curl -d sends a form type), or a 400 naming the field."""
    try:
        return CompletionBody.model_validate_json(raw)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(part) for part in err["loc"]) or "body"
        reason = "is not valid JSON" if err["type"] == "json_invalid" else err["msg"]
        return _http_error(400, f"{field}: {reason}", field)


@serve.deployment(ray_actor_options={"num_cpus": 0}, health_check_period_s=10)
@serve.ingress(http_app)
class SpecDecodeIngress:
    def __init__(self, config: dict):
        self.frontend = Frontend(ServeConfig.model_validate(config))
        self.model_name = Path(self.frontend.cfg.models.target.path).name

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
        await self.frontend.topology.target.ready.remote()  # raises when the target group is gone

    # --- gRPC: specdec.v1.SpecDecode ---------------------------------------------------------------

    async def Generate(self, request: api.GenerateRequest, grpc_context) -> api.GenerateResponse:
        job = self._admit_grpc(request, grpc_context)
        chunks = [chunk async for chunk in self.frontend.generate(job)]
        last = chunks[-1]
        return api.GenerateResponse(text="".join(c.text for c in chunks),
                                    token_ids=[t for c in chunks for t in c.token_ids],
                                    finish_reason=last.finish_reason, stats=_stats_proto(last.stats))

    async def GenerateStream(self, request: api.GenerateRequest, grpc_context):
        job = self._admit_grpc(request, grpc_context)
        async for chunk in self.frontend.generate(job):
            yield api.GenerateResponse(text=chunk.text, token_ids=chunk.token_ids,
                                       finish_reason=chunk.finish_reason or "",
                                       stats=_stats_proto(chunk.stats) if chunk.finish_reason else None)

    async def GetStats(self, request: api.GetStatsRequest, grpc_context) -> api.GetStatsResponse:
        return api.GetStatsResponse(task_types=[
            api.TaskTypeStats(task_type=name, alpha=s["alpha"], decision=s["decision"], k=s["k"],
                              samples=s["samples"], requests=s["requests"])
            for name, s in self.frontend.router.stats().items()])

    def _admit_grpc(self, request: api.GenerateRequest, grpc_context) -> Admitted:
        req = Request(prompt=request.prompt, task_type=request.task_type, max_new_tokens=request.max_new_tokens,
                      temperature=request.temperature, top_k=request.top_k,
                      top_p=request.top_p if request.HasField("top_p") else 1.0,
                      seed=request.seed if request.HasField("seed") else None,
                      speculation=Speculation.parse(api.Speculation.Name(request.speculation)))
        try:
            return self.frontend.admit(req)
        except (InvalidArgument, QueueFull) as e:
            code = grpc.StatusCode.INVALID_ARGUMENT if isinstance(e, InvalidArgument) else grpc.StatusCode.RESOURCE_EXHAUSTED
            grpc_context.set_code(code)
            grpc_context.set_details(str(e))
            raise

    # --- HTTP: OpenAI-style ------------------------------------------------------------------------

    @http_app.post("/v1/completions")
    async def completions(self, http: HttpRequest):
        body = _parse_body(await http.body())
        if isinstance(body, JSONResponse):
            return body
        req = Request(prompt=body.prompt, task_type=body.task_type, max_new_tokens=body.max_tokens,
                      temperature=body.temperature, top_k=body.top_k, top_p=body.top_p, seed=body.seed,
                      speculation=body.speculation)
        try:
            job = self.frontend.admit(req)
        except InvalidArgument as e:
            name = _HTTP_NAMES.get(e.field, e.field)
            return _http_error(400, f"{name}: {e.reason}", name)
        except QueueFull as e:
            return _http_error(429, str(e), None, "rate_limit_exceeded")
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": body.model or self.model_name}
        if body.stream:
            return StreamingResponse(self._sse(job, head), media_type="text/event-stream")
        chunks = [chunk async for chunk in self.frontend.generate(job)]
        tokens = [t for c in chunks for t in c.token_ids]
        choice = {"index": 0, "text": "".join(c.text for c in chunks), "token_ids": tokens,
                  "finish_reason": chunks[-1].finish_reason, "logprobs": None}
        usage = {"prompt_tokens": len(job.prompt_ids), "completion_tokens": len(tokens),
                 "total_tokens": len(job.prompt_ids) + len(tokens)}
        return {**head, "choices": [choice], "usage": usage, "speculation": chunks[-1].stats}

    async def _sse(self, job: Admitted, head: dict):
        async for chunk in self.frontend.generate(job):
            yield f"data: {json.dumps(_sse_event(head, chunk))}\n\n"
        yield "data: [DONE]\n\n"

    @http_app.get("/v1/stats")
    async def stats(self) -> dict:
        return await self.frontend.stats()

    @http_app.get("/healthz")
    async def healthz(self):
        try:
            await self.check_health()
        except Exception as e:  # noqa: BLE001 - any failure reaching the target means not healthy
            return JSONResponse({"status": "unhealthy", "reason": repr(e)}, status_code=503)
        return {"status": "ok"}


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
