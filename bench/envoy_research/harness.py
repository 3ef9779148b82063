"""Throwaway-grade harness behind envoy/README.md: real Envoy, a scripted extproc, pods.

One process holds everything but Envoy: a grpcio server on one port serving both
``ExternalProcessor/Process`` and ``AccessLogService/StreamAccessLogs`` (recording every
message with its arrival time), three aiohttp "pods", and the client. The request body
scripts the scripted picker and pods:

    {"route": ["ip:port", ...],      # the envoy.lb list the picker replies with
     "immediate": 400,               # answer with an ImmediateResponse instead
     "sleep_s": 0.5,                 # picker sleeps before replying (message timeout)
     "mode": "json|sse|die|die_length|slow",  # what the pod does
     "fail_ports": [18101],          # pods on these ports answer 503
     "no_header_removal": true}      # the picker does not remove the destination header

Envoy is started from ``extproc.envoyconf`` output (variants patch the dict) with its
own base id and ports 18000/18901/18002/18101-18103, so it can run next to a demo.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import yaml
from aiohttp import web
from envoy.config.core.v3 import base_pb2
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import json_format, struct_pb2

from extproc.envoyconf.build import EnvoyOptions, make_bootstrap
from extproc.envoyconf.render import to_dict
from extproc.types import Pod, PodId

LISTEN_PORT = 18000
ADMIN_PORT = 18901
EXTPROC_PORT = 18002
POD_PORTS = (18101, 18102, 18103)
ENVOY = Path(sys.executable).with_name("envoy")


@dataclass
class Recorder:
    """Everything the scripted extproc saw, with monotonic arrival times."""

    processing: list[tuple[float, ep.ProcessingRequest]] = field(default_factory=list)
    logs: list[tuple[float, Any]] = field(default_factory=list)  # HTTPAccessLogEntry
    log_names: list[str] = field(default_factory=list)
    pod_requests: list[dict[str, Any]] = field(default_factory=list)
    process_streams_closed: list[tuple[float, str]] = field(default_factory=list)

    def clear(self) -> None:
        self.processing.clear()
        self.logs.clear()
        self.pod_requests.clear()
        self.process_streams_closed.clear()


REC = Recorder()


def _body_reply(body: dict[str, Any]) -> ep.ProcessingResponse:
    if status := body.get("immediate"):
        error = {"error": {"message": "scripted", "type": "invalid_request_error", "code": "x"}}
        return ep.ProcessingResponse(
            immediate_response=ep.ImmediateResponse(
                status=http_status_pb2.HttpStatus(code=status),
                headers=ep.HeaderMutation(
                    set_headers=[
                        base_pb2.HeaderValueOption(
                            header=base_pb2.HeaderValue(
                                key="content-type", raw_value=b"application/json"
                            )
                        )
                    ]
                ),
                body=json.dumps(error).encode(),
                details="scripted_error",
            )
        )
    metadata = struct_pb2.Struct()
    route = ",".join(body.get("route", [f"127.0.0.1:{POD_PORTS[0]}"]))
    metadata.update({"envoy.lb": {"x-gateway-destination-endpoint": route}})
    remove = [] if body.get("no_header_removal") else ["x-gateway-destination-endpoint"]
    return ep.ProcessingResponse(
        request_body=ep.BodyResponse(
            response=ep.CommonResponse(header_mutation=ep.HeaderMutation(remove_headers=remove))
        ),
        dynamic_metadata=metadata,
    )


def _reply_for(req: ep.ProcessingRequest) -> ep.ProcessingResponse:
    kind = req.WhichOneof("request")
    if kind == "request_body":
        body = json.loads(req.request_body.body or b"{}")
        if sleep_s := body.get("sleep_s"):
            time.sleep(sleep_s)
        return _body_reply(body)
    # Not expected with the one-round mode; answer neutrally so the stream goes on.
    return ep.ProcessingResponse(
        **{kind: ep.HeadersResponse() if "headers" in kind else ep.BodyResponse()}
    )


class ExtProc(ep_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def Process(
        self, request_iterator: Iterator[ep.ProcessingRequest], context: grpc.ServicerContext
    ) -> Iterator[ep.ProcessingResponse]:
        last = "none"
        try:
            for req in request_iterator:
                REC.processing.append((time.monotonic(), req))
                last = req.WhichOneof("request") or "none"
                yield _reply_for(req)
        finally:
            REC.process_streams_closed.append((time.monotonic(), last))


def stream_unary_process(
    request_iterator: Iterator[ep.ProcessingRequest], context: grpc.ServicerContext
) -> ep.ProcessingResponse:
    """The one-round server shape: read one message, reply, end the stream with OK."""
    req = next(request_iterator)
    REC.processing.append((time.monotonic(), req))
    return _reply_for(req)


class AccessLog(als_pb2_grpc.AccessLogServiceServicer):  # type: ignore[misc]
    def StreamAccessLogs(
        self,
        request_iterator: Iterator[als_pb2.StreamAccessLogsMessage],
        context: grpc.ServicerContext,
    ) -> als_pb2.StreamAccessLogsResponse:
        for msg in request_iterator:
            now = time.monotonic()
            if msg.HasField("identifier"):
                REC.log_names.append(msg.identifier.log_name)
            for entry in msg.http_logs.log_entry:
                REC.logs.append((now, entry))
        return als_pb2.StreamAccessLogsResponse()


def start_grpc(
    port: int = EXTPROC_PORT, *, unary: bool = False, max_receive_bytes: int | None = 64 << 20
) -> grpc.Server:
    options: list[tuple[str, int]] = [("grpc.so_reuseport", 0)]
    if max_receive_bytes is not None:  # grpcio's default is 4 MiB
        options.append(("grpc.max_receive_message_length", max_receive_bytes))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=32), options=options)
    if unary:
        handler = grpc.method_handlers_generic_handler(
            "envoy.service.ext_proc.v3.ExternalProcessor",
            {
                "Process": grpc.stream_unary_rpc_method_handler(
                    stream_unary_process,
                    request_deserializer=ep.ProcessingRequest.FromString,
                    response_serializer=ep.ProcessingResponse.SerializeToString,
                )
            },
        )
        server.add_generic_rpc_handlers((handler,))
    else:
        ep_grpc.add_ExternalProcessorServicer_to_server(ExtProc(), server)
    als_pb2_grpc.add_AccessLogServiceServicer_to_server(AccessLog(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server


# --- pods --------------------------------------------------------------------------


async def _pod_handler(request: web.Request) -> web.StreamResponse:
    port = request.transport.get_extra_info("sockname")[1] if request.transport else 0
    raw = await request.read()
    body = json.loads(raw or b"{}")
    REC.pod_requests.append(
        {
            "port": port,
            "path": request.path,
            "headers": {k.lower(): v for k, v in request.headers.items()},
            "bytes": len(raw),
        }
    )
    if port in body.get("fail_ports", []):
        return web.json_response({"error": "scripted 503"}, status=503)
    mode = body.get("mode", "json")
    if mode == "json":
        return web.json_response({"port": port, "path": request.path})
    resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
    if mode == "die_length":  # a response with a length, cut short
        resp.content_length = 1_000_000
    await resp.prepare(request)
    num_chunks = {"sse": 5, "die": 3, "die_length": 3, "slow": 50}[mode]
    for idx in range(num_chunks):
        await resp.write(f"data: {json.dumps({'port': port, 'idx': idx})}\n\n".encode())
        await asyncio.sleep(0.1 if mode == "slow" else 0.01)
    if mode.startswith("die"):
        assert request.transport is not None
        request.transport.abort()  # the pod dies mid-stream: no terminating chunk
        return resp
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


class Pods:
    """aiohttp pods on POD_PORTS, in a background event loop."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.runners: list[web.AppRunner] = []
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def start(self) -> None:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)

    async def _start(self) -> None:
        for port in POD_PORTS:
            app = web.Application(client_max_size=64 * 1024 * 1024)
            app.router.add_route("*", "/{tail:.*}", _pod_handler)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            self.runners.append(runner)

    def stop(self) -> None:
        async def _stop() -> None:
            for runner in self.runners:
                await runner.cleanup()

        asyncio.run_coroutine_threadsafe(_stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


# --- envoy -------------------------------------------------------------------------


def pods_for_envoy() -> tuple[Pod, ...]:
    return tuple(
        Pod(id=PodId("default", f"p{i}"), address=f"127.0.0.1:{port}", models=frozenset({"m"}))
        for i, port in enumerate(POD_PORTS)
    )


def base_config(**options: Any) -> dict[str, Any]:
    opts = EnvoyOptions(
        extproc_address=f"127.0.0.1:{EXTPROC_PORT}",
        listen_port=LISTEN_PORT,
        admin_port=ADMIN_PORT,
        **options,
    )
    return to_dict(make_bootstrap(pods_for_envoy(), opts))


def hcm(config: dict[str, Any]) -> dict[str, Any]:
    chain = config["static_resources"]["listeners"][0]["filter_chains"][0]
    return chain["filters"][0]["typed_config"]  # type: ignore[no-any-return]


def ext_proc_filter(config: dict[str, Any]) -> dict[str, Any]:
    return hcm(config)["http_filters"][0]["typed_config"]  # type: ignore[no-any-return]


@contextlib.contextmanager
def run_envoy(config: dict[str, Any]) -> Iterator[subprocess.Popen[bytes]]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "envoy.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        log = open(Path(tmp) / "envoy.log", "wb")  # noqa: SIM115 - closed below
        proc = subprocess.Popen(
            [
                str(ENVOY),
                "-c",
                str(path),
                "--use-dynamic-base-id",
                "-l",
                "warning",
                "--concurrency",
                "2",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            _wait_ready(proc)
            yield proc
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
            log.close()
            if os.environ.get("SHOW_ENVOY_LOG"):
                print((Path(tmp) / "envoy.log").read_text()[-3000:])


def _wait_ready(proc: subprocess.Popen[bytes]) -> None:
    import urllib.request

    for _ in range(200):  # bounded: 10 s
        if proc.poll() is not None:
            raise RuntimeError(f"envoy exited with {proc.returncode}")
        url = f"http://127.0.0.1:{ADMIN_PORT}/ready"
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=1) as r:
            if r.status == 200:
                return
        time.sleep(0.05)
    raise RuntimeError("envoy not ready after 10 s")


def wait_for(predicate: Callable[[], bool], timeout_s: float = 2.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.002)
    return predicate()


def summarize_log(entry: Any) -> dict[str, Any]:
    d = json_format.MessageToDict(entry, preserving_proto_field_name=True)
    common = d.get("common_properties", {})
    return {
        "response_code": d.get("response", {}).get("response_code"),
        "response_code_details": d.get("response", {}).get("response_code_details"),
        "response_body_bytes": d.get("response", {}).get("response_body_bytes"),
        "response_flags": common.get("response_flags", {}),
        "upstream_remote_address": common.get("upstream_remote_address", {})
        .get("socket_address", {})
        .get("port_value"),
        "upstream_request_attempt_count": common.get("upstream_request_attempt_count"),
        "time_to_last_downstream_tx_byte": common.get("time_to_last_downstream_tx_byte"),
        "time_to_last_upstream_rx_byte": common.get("time_to_last_upstream_rx_byte"),
        "connection_termination_details": common.get("connection_termination_details"),
        "upstream_transport_failure_reason": common.get("upstream_transport_failure_reason"),
        "metadata": common.get("metadata"),
        "request_id": d.get("request", {}).get("request_id"),
        "path": d.get("request", {}).get("path"),
        "access_log_type": common.get("access_log_type"),
    }
