"""Simulated vLLM pods over HTTP: N independent engines on N ports of 127.0.0.1.

Each pod serves, on its own port:

    POST /v1/completions, /v1/chat/completions, /v1/responses   (see api.py)
    POST the same paths + ``/render``   the prompt's token ids, as vLLM's render endpoints
                                       (what vllm-router's cache_aware policy asks for)
    GET  /v1/models, /health, /metrics                           (vLLM's shapes and names)
    POST /v1/load_lora_adapter, /v1/unload_lora_adapter          (LoRA on: lora.py)
    GET|POST|DELETE /admin/faults    read / merge into / clear the pod's faults (faults.py)
    GET  /admin/stats                the pod's counters and engine stats as JSON
    POST /admin/reset_cache          empty the prefix cache (409 while requests run)

With ``--enable-lora`` a pod serves the adapters of ``--lora-modules`` (each pod its own
registry: loading at run time changes one pod), listed in ``/v1/models`` with their
``parent``; the load and unload endpoints are there as on a vLLM started with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``.

Every response carries the header ``x-sim-pod: NAME``. A refusing pod cannot be reached on
its own port, so the group also serves an admin port with ``GET /pods`` and the same
admin routes per pod under ``/pods/{name}/``, e.g. ``POST /pods/sim-0/faults``.
Only 127.0.0.1 is ever bound.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from extproc.errors import ConfigError
from extproc.request.parse import DEFAULT_MAX_BODY_BYTES
from extproc.request.tokens import SegmentTokenizer
from extproc.sim.api import (
    ApiError,
    GenerationRequest,
    Kind,
    ResponseFormat,
    decode_body,
    error_body,
    fit_context,
    parse_lora_load,
    parse_lora_unload,
    parse_request,
    render_body,
)
from extproc.sim.engine import (
    Engine,
    EngineConfig,
    FinishedRequest,
    QueueFull,
    RequestRejected,
    SimRequest,
    StepResult,
)
from extproc.sim.faults import ErrorSchedule, Faults
from extproc.sim.lora import LoraError, LoraModule, LoraRegistry, LoraRequest
from extproc.sim.metrics import PodMetrics
from extproc.sim.runner import EngineRunner, EngineStopped, RequestStream

if TYPE_CHECKING:  # pyzmq and msgpack are the optional ``sim`` extra: imported when used
    from extproc.sim.kv_events import Layout, ZmqEventPublisher

HOST = "127.0.0.1"
# What a pod's /metrics answers under the "garbage" fault: a vLLM series name with a
# value that is no number, binary junk, and lines cut in the middle.
GARBAGE_METRICS = (
    b'vllm:num_requests_waiting{model_name="x"} many\n\x00\xff\xfe<html>\n'
    b'vllm:kv_cache_usage_perc{model_name="x" 0.5\n# TYPE\n'
)
MAX_BODY_BYTES = DEFAULT_MAX_BODY_BYTES  # 4M tokens of text, far over any max_model_len
MAX_PODS = 256
RECENT_REQUESTS = 256  # per pod, for /admin/stats
SHUTDOWN_TIMEOUT_S = 2.0


@dataclass(frozen=True, slots=True)
class KvEventsSettings:
    endpoint: str  # e.g. tcp://127.0.0.1:5557: the publisher connects, the subscriber binds
    topic: str = "kv@{host}:{port}@{model}"  # {host} {port} {model} {name} are filled in
    layout: Layout = "map"


@dataclass(frozen=True, slots=True)
class GroupSettings:
    num_pods: int = 2
    port: int = 0  # first pod's port; 0 gives every pod (and the admin port) a free port
    admin_port: int | None = None  # default: port + num_pods, or a free port when port is 0
    model: str = "sim-llm"
    name_prefix: str = "sim"
    engine: EngineConfig = field(default_factory=EngineConfig)
    default_max_tokens: int = 16
    faults: Faults = field(default_factory=Faults)  # a pod's faults at start
    fault_pods: frozenset[int] | None = None  # indexes of the pods ``faults`` applies to; None: all
    kv_events: KvEventsSettings | None = None
    tokenizer: str | None = None  # a Hugging Face tokenizer's directory (``api``); None: pseudo
    lora_modules: tuple[LoraModule, ...] = ()  # adapters every pod serves from the start

    def __post_init__(self) -> None:
        if not 1 <= self.num_pods <= MAX_PODS:
            raise ConfigError(f"num_pods must be within 1..{MAX_PODS}, got {self.num_pods}")
        last = self.port + self.num_pods if self.port else 0
        if not 0 <= self.port or last > 65535:
            raise ConfigError(f"port {self.port} with {self.num_pods} pods is out of range")
        if self.default_max_tokens < 1:
            raise ConfigError(f"default_max_tokens must be >= 1, got {self.default_max_tokens}")
        if self.fault_pods is not None and not self.fault_pods <= set(range(self.num_pods)):
            raise ConfigError(f"fault_pods names pods outside 0..{self.num_pods - 1}")
        if self.lora_modules and not self.engine.enable_lora:
            raise ConfigError("--lora-modules needs --enable-lora")
        LoraRegistry(self.model, self.lora_modules)  # a duplicate or base-model name fails here

    def pod_faults(self, index: int) -> Faults:
        if self.fault_pods is None or index in self.fault_pods:
            return self.faults
        return Faults()

    def pod_port(self, index: int) -> int:
        return self.port + index if self.port else 0

    def admin_port_or_default(self) -> int:
        if self.admin_port is not None:
            return self.admin_port
        return self.port + self.num_pods if self.port else 0


@dataclass(frozen=True, slots=True)
class Tokenizing:
    """The group's real tokenizer and the one thread it runs on (its memo is not
    thread-safe)."""

    tokenizer: SegmentTokenizer
    thread: ThreadPoolExecutor


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


INLINE_PARSE_BYTES = 1 << 20  # larger request bodies are parsed off the event loop


class SimPod:
    """One pod: an engine, its runner, metrics, faults and HTTP site."""

    def __init__(
        self,
        name: str,
        port: int,
        settings: GroupSettings,
        faults: Faults,
        tokenizer: Tokenizing | None = None,
    ) -> None:
        self.name = name
        self.port = port
        self.model = settings.model
        self._settings = settings
        self._tokenizer = tokenizer
        engine_config = settings.engine
        if settings.kv_events is not None:
            engine_config = dataclasses.replace(engine_config, enable_kv_cache_events=True)
        self.engine = Engine(engine_config)
        self.loras = LoraRegistry(settings.model, settings.lora_modules)
        self.metrics = PodMetrics(self.engine, settings.model)
        self.runner = EngineRunner(self.engine, self._on_step)
        self.faults = faults
        self._errors = ErrorSchedule(self.faults.error_rate)
        self.publisher: ZmqEventPublisher | None = None
        self.counters = dict.fromkeys(
            ("num_requests", "num_served", "num_injected_errors", "num_cut_streams",
             "num_rejected", "cached_tokens_total"), 0,
        )  # fmt: skip
        self.recent: deque[dict[str, Any]] = deque(maxlen=RECENT_REQUESTS)
        self.app = web.Application(client_max_size=MAX_BODY_BYTES)
        self.app.on_response_prepare.append(self._tag_response)
        for path, kind in (
            ("/v1/completions", "completion"),
            ("/v1/chat/completions", "chat"),
            ("/v1/responses", "responses"),
        ):
            self.app.router.add_post(path, self._generate_handler(kind))  # type: ignore[arg-type]
            self.app.router.add_post(path + "/render", self._render_handler(kind))  # type: ignore[arg-type]
        self.app.router.add_get("/health", self._health)
        self.app.router.add_get("/v1/models", self._models)
        self.app.router.add_get("/metrics", self._metrics)
        self.app.router.add_get("/metrics/", self._metrics)
        if engine_config.enable_lora:
            self.app.router.add_post("/v1/load_lora_adapter", self._load_lora)
            self.app.router.add_post("/v1/unload_lora_adapter", self._unload_lora)
        add_admin_routes(self.app.router, "/admin", lambda _: self)
        self._app_runner = web.AppRunner(
            self.app, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S
        )
        self._site: web.TCPSite | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def listening(self) -> bool:
        return self._site is not None

    async def start(self) -> None:
        await self._app_runner.setup()
        await self._open_port()
        self.runner.start()
        kv = self._settings.kv_events
        if kv is not None:
            from extproc.sim.kv_events import ZmqEventPublisher

            topic = kv.topic.format(host=HOST, port=self.port, model=self.model, name=self.name)
            self.publisher = ZmqEventPublisher(kv.endpoint, topic, kv.layout)
        if self.faults.refuse_connections:
            await self._close_port()

    async def stop(self) -> None:
        await self.runner.stop()
        await self._app_runner.cleanup()
        self._site = None
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None

    async def set_faults(self, faults: Faults, spare: asyncio.BaseTransport | None = None) -> None:
        """Apply new faults; opens or closes the port as ``refuse_connections`` says.

        ``spare`` is a connection to leave open while closing: the admin request's own.
        """
        self.faults = faults
        self._errors = ErrorSchedule(faults.error_rate)
        if faults.refuse_connections:
            await self._close_port(spare)
        else:
            await self._open_port()

    def reset_cache(self) -> bool:
        ok = self.engine.reset_prefix_cache()
        self._publish_kv_events()
        return ok

    def stats(self) -> dict[str, Any]:
        return {
            "pod": self.name,
            "model": self.model,
            "url": self.url,
            "listening": self.listening,
            "adapters": list(self.loras.names()),
            "lora_slots": [a.name for a in self.engine.lora_slots.resident],
            **self.counters,
            "engine": dataclasses.asdict(self.engine.stats()),
            "faults": self.faults.to_json(),
            "recent": list(self.recent),
        }

    async def _open_port(self) -> None:
        if self._site is not None:
            return
        site = web.TCPSite(self._app_runner, HOST, self.port, reuse_address=True)
        await site.start()
        self._site = site
        self.port = site.port

    async def _close_port(self, spare: asyncio.BaseTransport | None = None) -> None:
        """Stop listening and abort open connections: clients see refused connections."""
        if self._site is None:
            return
        await self._site.stop()
        self._site = None
        server = self._app_runner.server
        if server is not None:
            for handler in server.connections:
                if handler.transport is not None and handler.transport is not spare:
                    handler.transport.abort()

    def _on_step(self, result: StepResult) -> None:
        self.metrics.observe(result)
        self._publish_kv_events()

    def _publish_kv_events(self) -> None:
        events = self.engine.take_kv_events()
        if events and self.publisher is not None:
            self.publisher.publish(time.time(), events)

    async def _tag_response(self, request: web.Request, response: web.StreamResponse) -> None:
        response.headers["x-sim-pod"] = self.name

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _models(self, request: web.Request) -> web.Response:
        card = {
            "id": self.model, "object": "model", "created": 0, "owned_by": "vllm",
            "root": self.model, "parent": None, "max_model_len": self.engine.config.max_model_len,
        }  # fmt: skip
        return _json({"object": "list", "data": [card, *self.loras.cards()]})

    async def _load_lora(self, request: web.Request) -> web.Response:
        """vLLM's ``/v1/load_lora_adapter``: 200 and its success text, or its error body.
        A reload in place empties the adapter's slot: its new weights are read at next use."""
        try:
            name, path, inplace = parse_lora_load(await self._json_body(request))
            adapter = self.loras.load(name, path, inplace)
        except ApiError as e:
            return _json(e.body(), e.status)
        except LoraError as e:
            return _json(error_body(e.status, e.message, err_type=e.err_type), e.status)
        self.engine.lora_slots.drop(adapter.int_id)
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def _unload_lora(self, request: web.Request) -> web.Response:
        """vLLM's ``/v1/unload_lora_adapter``."""
        try:
            name = parse_lora_unload(await self._json_body(request))
            self.loras.unload(name)
        except ApiError as e:
            return _json(e.body(), e.status)
        except LoraError as e:
            return _json(error_body(e.status, e.message, err_type=e.err_type), e.status)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    async def _json_body(self, request: web.Request) -> Any:
        try:
            return orjson.loads(await request.read())
        except orjson.JSONDecodeError as e:
            raise ApiError(400, f"the body is not valid JSON: {e}") from None

    def _adapter(self, parsed: GenerationRequest) -> LoraRequest | None:
        """The adapter a parsed request names, None for the base model.

        Raises:
            ApiError: 404, the adapter was unloaded since the request was parsed.
        """
        if parsed.model == self.model:
            return None
        adapter = self.loras.get(parsed.model)
        if adapter is None:
            raise ApiError(404, f"The model `{parsed.model}` does not exist. Valid aliases: "
                           f"{self.model}.", "model")  # fmt: skip
        return adapter

    async def _metrics(self, request: web.Request) -> web.Response:
        if self.faults.metrics == "error":
            return web.Response(status=500, text="metrics unavailable")
        if self.faults.metrics == "garbage":
            return web.Response(body=GARBAGE_METRICS, headers={"Content-Type": CONTENT_TYPE_LATEST})
        # As vLLM: prometheus_client's app under /metrics/ honours name[]; the plain
        # /metrics route renders everything.
        names = request.query.getall("name[]", []) if request.path == "/metrics/" else []
        return web.Response(
            body=self.metrics.render(names), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    def _render_handler(self, kind: Kind) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handler(request: web.Request) -> web.Response:
            return await self._render(request, kind)

        return handler

    async def _render(self, request: web.Request, kind: Kind) -> web.Response:
        """vLLM's ``GenerateRequest`` (completions: a list of one), token ids and all."""
        try:
            raw = await request.read()
            parsed = await self._parse(kind, decode_body(raw), len(raw))
        except ApiError as e:
            return _json(e.body(), e.status)
        rendered = render_body(parsed)
        return _json([rendered] if kind == "completion" else rendered)

    async def _parse(self, kind: Kind, body: Any, size: int) -> GenerationRequest:
        """``parse_request``; a real tokenizer's, which takes milliseconds on a long
        prompt, runs off the pods' event loop (on the group's one tokenizing thread), and
        so does rendering a body of ``size`` bytes over ``INLINE_PARSE_BYTES`` (a chat of
        thousands of messages takes seconds), so the pods keep answering meanwhile."""
        parse = functools.partial(
            parse_request,
            kind,
            body,
            self.model,
            self._settings.default_max_tokens,
            adapters=self.loras.names(),
        )
        if self._tokenizer is None:
            if size <= INLINE_PARSE_BYTES:
                return parse()
            return await asyncio.get_running_loop().run_in_executor(None, parse)
        tok = self._tokenizer
        return await asyncio.get_running_loop().run_in_executor(
            tok.thread, functools.partial(parse, tokenizer=tok.tokenizer)
        )

    def _error(self, status: int, message: str, param: str | None = None) -> web.Response:
        return _json(error_body(status, message, param), status)

    def _generate_handler(
        self, kind: Kind
    ) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def handler(request: web.Request) -> web.StreamResponse:
            return await self._generate(request, kind)

        return handler

    async def _generate(self, request: web.Request, kind: Kind) -> web.StreamResponse:
        self.counters["num_requests"] += 1
        faults = self.faults
        if faults.delay_s:
            await asyncio.sleep(faults.delay_s)
        if self._errors.next_fails():
            self.counters["num_injected_errors"] += 1
            return self._error(faults.error_status, f"injected fault on pod {self.name}")
        try:
            raw = await request.read()
            parsed = fit_context(
                await self._parse(kind, decode_body(raw), len(raw)),
                self.engine.config.max_model_len,
            )
            req = SimRequest(
                request_id=f"{kind}-{uuid.uuid4().hex}",
                prompt_token_ids=parsed.prompt_token_ids,
                max_tokens=parsed.num_output_tokens,
                cache_salt=parsed.cache_salt,
                seed=parsed.seed,
                output_words=parsed.output_words,
                lora=self._adapter(parsed),
            )
            stream = self.runner.submit(req)
        except ApiError as e:
            self.counters["num_rejected"] += 1
            return _json(e.body(), e.status)
        except RequestRejected as e:
            self.counters["num_rejected"] += 1
            return self._error(503 if isinstance(e, QueueFull) else 400, str(e))
        except EngineStopped as e:
            return self._error(503, f"pod {self.name}: {e}")
        except ValueError as e:
            self.counters["num_rejected"] += 1
            return self._error(400, str(e))
        fmt = ResponseFormat(parsed, self.name)
        try:
            if not parsed.stream:
                try:
                    fin = await stream.result()
                except EngineStopped:
                    return self._error(503, f"pod {self.name} is shutting down")
                self._record(request, parsed, fin)
                return _json(fmt.full(fin))
            return await self._stream(request, parsed, stream, fmt)
        finally:
            if stream.finished is None:
                self.runner.abort(req.request_id)

    async def _stream(
        self,
        request: web.Request,
        parsed: GenerationRequest,
        stream: RequestStream,
        fmt: ResponseFormat,
    ) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        cut_after = self.faults.die_mid_stream_after_chunks
        num_sent = 0

        async def send(frames: list[bytes]) -> bool:
            """Write SSE events; False once the stream is cut by the fault."""
            nonlocal num_sent
            for frame in frames:
                if cut_after is not None and num_sent >= cut_after:
                    self.counters["num_cut_streams"] += 1
                    if request.transport is not None:
                        request.transport.abort()
                    return False
                await resp.write(frame)
                num_sent += 1
            return True

        try:
            if not await send(fmt.head()):
                return resp
            async for out in stream.tokens():
                if not await send(fmt.token(out)):
                    return resp
            assert stream.finished is not None
            if await send(fmt.tail(stream.finished)):
                await resp.write_eof()
                self._record(request, parsed, stream.finished)
        except (ConnectionError, EngineStopped):
            pass  # client gone, or the pod is stopping: the stream just ends
        return resp

    def _record(
        self, request: web.Request, parsed: GenerationRequest, fin: FinishedRequest
    ) -> None:
        self.counters["num_served"] += 1
        self.counters["cached_tokens_total"] += fin.num_cached_tokens
        self.recent.append(
            {
                "request_id": fin.request_id,
                "x_request_id": request.headers.get("x-request-id"),
                # lets tests check which routing headers reach a pod, and their values
                "routing_headers": {
                    h.lower(): v
                    for h, v in request.headers.items()
                    if h.lower().startswith(("x-gateway-", "x-prefiller-"))
                },
                "kind": parsed.kind,
                "stream": parsed.stream,
                "cache_salt": parsed.cache_salt,
                "prompt_tokens": fin.num_prompt_tokens,
                "cached_tokens": fin.num_cached_tokens,
                "completion_tokens": len(fin.output_token_ids),
                "ttft_s": fin.ttft_s,
                "e2e_s": fin.e2e_s,
            }
        )


def add_admin_routes(
    router: web.UrlDispatcher, prefix: str, get_pod: Callable[[web.Request], SimPod]
) -> None:
    """The admin routes under ``prefix``, for the pod ``get_pod`` finds for a request."""

    async def get_faults(request: web.Request) -> web.Response:
        return _json(get_pod(request).faults.to_json())

    async def post_faults(request: web.Request) -> web.Response:
        pod = get_pod(request)
        try:
            faults = pod.faults.updated(orjson.loads(await request.read()))
        except (orjson.JSONDecodeError, ValueError, TypeError) as e:
            return _json(error_body(400, str(e)), 400)
        await pod.set_faults(faults, spare=request.transport)
        resp = _json(faults.to_json())
        resp.force_close()  # the spared connection, if it was the pod's, closes after this
        return resp

    async def delete_faults(request: web.Request) -> web.Response:
        pod = get_pod(request)
        await pod.set_faults(Faults())
        return _json(pod.faults.to_json())

    async def stats(request: web.Request) -> web.Response:
        return _json(get_pod(request).stats())

    async def reset_cache(request: web.Request) -> web.Response:
        if not get_pod(request).reset_cache():
            return _json(error_body(409, "requests are running; the cache was not reset"), 409)
        return _json({"reset": True})

    router.add_get(f"{prefix}/faults", get_faults)
    router.add_post(f"{prefix}/faults", post_faults)
    router.add_delete(f"{prefix}/faults", delete_faults)
    router.add_get(f"{prefix}/stats", stats)
    router.add_post(f"{prefix}/reset_cache", reset_cache)


class PodGroup:
    """The pods of one process plus its admin port."""

    def __init__(self, settings: GroupSettings) -> None:
        self.settings = settings
        self.tokenizing: Tokenizing | None = None
        if settings.tokenizer is not None:
            try:
                tokenizer = SegmentTokenizer(settings.tokenizer)
            except ValueError as e:
                raise ConfigError(str(e)) from None
            self.tokenizing = Tokenizing(tokenizer, ThreadPoolExecutor(1, "sim-tokenizer"))
        self.pods = [
            SimPod(
                f"{settings.name_prefix}-{i}",
                settings.pod_port(i),
                settings,
                settings.pod_faults(i),
                self.tokenizing,
            )
            for i in range(settings.num_pods)
        ]
        self._by_name = {pod.name: pod for pod in self.pods}
        self.admin_app = web.Application()
        self.admin_app.router.add_get("/pods", self._list_pods)
        add_admin_routes(self.admin_app.router, "/pods/{pod}", self._pod_of)
        self._admin_runner = web.AppRunner(self.admin_app, access_log=None, shutdown_timeout=1.0)
        self.admin_port = settings.admin_port_or_default()

    def _pod_of(self, request: web.Request) -> SimPod:
        pod = self._by_name.get(request.match_info["pod"])
        if pod is None:
            raise web.HTTPNotFound(
                text=orjson.dumps(
                    error_body(404, f"no pod {request.match_info['pod']!r}")
                ).decode(),
                content_type="application/json",
            )
        return pod

    async def _list_pods(self, request: web.Request) -> web.Response:
        return _json(self.describe()["pods"])

    async def start(self) -> None:
        """Start every pod, then the admin port; on failure, stop what started."""
        try:
            for pod in self.pods:
                await pod.start()
            await self._admin_runner.setup()
            site = web.TCPSite(self._admin_runner, HOST, self.admin_port, reuse_address=True)
            await site.start()
            self.admin_port = site.port
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        for pod in self.pods:
            await pod.stop()
        await self._admin_runner.cleanup()
        if self.tokenizing is not None:
            self.tokenizing.thread.shutdown(wait=False)

    def describe(self) -> dict[str, Any]:
        """What a client needs: pod names and URLs, the model, the admin URL, and where
        each pod publishes its KV events (the endpoint it bound, or connects to)."""
        return {
            "model": self.settings.model,
            "admin_url": f"http://{HOST}:{self.admin_port}",
            "pods": [
                {
                    "name": p.name,
                    "url": p.url,
                    "port": p.port,
                    "listening": p.listening,
                    "kv_events_endpoint": p.publisher.endpoint if p.publisher else None,
                    "adapters": list(p.loras.names()),
                }
                for p in self.pods
            ],
        }
