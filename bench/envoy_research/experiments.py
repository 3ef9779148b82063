"""The measurements behind envoy/README.md, (a) to (e); prints one JSON line per finding.

Run from the repository root: ``python bench/envoy_research/experiments.py [a b c d e f g]``
"""

from __future__ import annotations

import copy
import http.client
import json
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from google.protobuf import json_format

from bench.envoy_research import harness as h

POD0, POD1, POD2 = (f"127.0.0.1:{p}" for p in h.POD_PORTS)


def report(name: str, **data: Any) -> None:
    print(json.dumps({"finding": name, **data}, default=str), flush=True)


def post(
    body: dict[str, Any] | bytes,
    path: str = "/v1/chat/completions",
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], bytes, float]:
    """POST through Envoy; returns status, headers, body, monotonic time of the last byte."""
    conn = http.client.HTTPConnection("127.0.0.1", h.LISTEN_PORT, timeout=10)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request(
        "POST", path, body=data, headers={"content-type": "application/json", **(headers or {})}
    )
    resp = conn.getresponse()
    payload = resp.read()
    done = time.monotonic()
    conn.close()
    return resp.status, dict(resp.getheaders()), payload, done


def first_body_message() -> dict[str, Any]:
    assert h.wait_for(lambda: bool(h.REC.processing))
    _, req = h.REC.processing[0]
    d: dict[str, Any] = json_format.MessageToDict(req, preserving_proto_field_name=True)
    if "request_body" in d:
        d["request_body"] = {k: v for k, v in d["request_body"].items() if k != "body"}
    return d


# --- (a) what the body message carries ----------------------------------------------


def exp_a() -> None:
    headers = {"x-session-id": "sess-1", "x-request-id": "client-chosen-id"}
    body = {"model": "m", "messages": [], "route": [POD1]}

    cfg = h.base_config()
    with h.run_envoy(cfg):
        h.REC.clear()
        status, _, _, _ = post(body, headers=headers)
        report(
            "a.default",
            status=status,
            kinds=[r.WhichOneof("request") for _, r in h.REC.processing],
            message=first_body_message(),
            pod=h.REC.pod_requests[0]["port"],
            pod_saw_request_id=h.REC.pod_requests[0]["headers"].get("x-request-id"),
        )

    cfg = h.base_config()
    h.ext_proc_filter(cfg)["request_attributes"] = [
        "request.path",
        "request.id",
        "request.headers['x-session-id']",
        "request.method",
    ]
    with h.run_envoy(cfg):
        for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses"):
            h.REC.clear()
            status, _, _, _ = post(body, path=path, headers=headers)
            report("a.request_attributes", path=path, status=status, message=first_body_message())
        h.REC.clear()
        post(body, headers={})  # no session header at all
        report("a.request_attributes.no_session_header", message=first_body_message())

    cfg = h.base_config()
    set_metadata = {
        "name": "envoy.filters.http.set_metadata",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config",
            "metadata": [
                {
                    "metadata_namespace": "envoy.lb.subset_hint",
                    "value": {"x-gateway-destination-endpoint-subset": [POD1, POD2]},
                }
            ],
        },
    }
    h.hcm(cfg)["http_filters"].insert(0, set_metadata)
    with h.run_envoy(cfg):
        h.REC.clear()
        status, _, _, _ = post(body, headers=headers)
        report(
            "a.generated_attributes_and_subset_hint", status=status, message=first_body_message()
        )

    cfg = h.base_config()
    h.ext_proc_filter(cfg)["request_attributes"] = ["request.headers"]
    with h.run_envoy(cfg):
        h.REC.clear()
        status, _, _, _ = post(body, headers=headers)
        report("a.request_attributes.all_headers", status=status, message=first_body_message())


# --- (b) removing a client-sent destination header --------------------------------------


def exp_b() -> None:
    body = {"model": "m", "route": [POD1]}
    steer = {"x-gateway-destination-endpoint": POD2}
    for variant in ("both", "ext_proc_only", "route_only"):
        cfg = h.base_config()
        vhost = h.hcm(cfg)["route_config"]["virtual_hosts"][0]
        if variant == "ext_proc_only":
            del vhost["request_headers_to_remove"]
        with h.run_envoy(cfg):
            h.REC.clear()
            status, _, _, _ = post(
                {**body, "no_header_removal": variant == "route_only"}, headers=steer
            )
            seen = h.REC.pod_requests[0]
            report(
                "b." + variant,
                status=status,
                served_port=seen["port"],
                pod_saw_header=seen["headers"].get("x-gateway-destination-endpoint"),
            )


# --- (c) access-log entries -----------------------------------------------------------------


def _await_log(n: int = 1, timeout_s: float = 3.0) -> list[dict[str, Any]]:
    h.wait_for(lambda: len(h.REC.logs) >= n, timeout_s)
    return [h.summarize_log(e) for _, e in h.REC.logs]


def stream(
    body: dict[str, Any], *, disconnect_after: int | None = None
) -> tuple[int, bytes, float, str]:
    """POST and read the SSE body; optionally close the socket after N chunks."""
    sock = socket.create_connection(("127.0.0.1", h.LISTEN_PORT), timeout=10)
    data = json.dumps(body).encode()
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        + f"content-length: {len(data)}\r\n\r\n".encode()
        + data
    )
    received = b""
    outcome = "eof"
    for _ in range(10_000):  # bounded read loop
        try:
            chunk = sock.recv(65536)
        except OSError as exc:
            outcome = f"error {exc}"
            break
        if not chunk:
            break
        received += chunk
        if disconnect_after is not None and received.count(b"data: ") >= disconnect_after:
            outcome = "client closed"
            break
        if received.endswith(b"0\r\n\r\n"):
            outcome = "complete"
            break
    done = time.monotonic()
    sock.close()
    status = int(received.split(b" ", 2)[1]) if received.startswith(b"HTTP/") else 0
    return status, received, done, outcome


def exp_c() -> None:
    cfg = h.base_config()
    h.hcm(cfg)["access_log"][0].pop("filter")  # log everything, to see ImmediateResponse too
    with h.run_envoy(cfg):
        cases: list[tuple[str, Any]] = [
            ("200 json", lambda: post({"route": [POD0]})),
            ("200 sse complete", lambda: stream({"route": [POD0], "mode": "sse"})),
            ("upstream dies mid-stream", lambda: stream({"route": [POD0], "mode": "die"})),
            (
                "upstream dies mid-stream, content-length response",
                lambda: stream({"route": [POD0], "mode": "die_length"}),
            ),
            (
                "client disconnects mid-stream",
                lambda: stream({"route": [POD0], "mode": "slow"}, disconnect_after=2),
            ),
            (
                "503 on first, retried on second",
                lambda: post({"route": [POD0, POD1], "fail_ports": [h.POD_PORTS[0]]}),
            ),
            (
                "503 everywhere (retries exhausted)",
                lambda: post({"route": [POD0, POD1, POD2], "fail_ports": list(h.POD_PORTS)}),
            ),
            (
                "connect refused on first, second serves",
                lambda: post({"route": ["127.0.0.1:1", POD1]}),
            ),
            ("400 ImmediateResponse", lambda: post({"immediate": 400})),
        ]
        for name, action in cases:
            h.REC.clear()
            result = action()
            entries = _await_log()
            served = [r["port"] for r in h.REC.pod_requests]
            status = result[0]
            extra = {"client_outcome": result[3]} if isinstance(result[3], str) else {}
            report("c." + name, client_status=status, pods_tried=served, log=entries, **extra)
        # "connect refused" used a host outside the cluster; also a cluster member down:
    dead_cfg = copy.deepcopy(cfg)
    dead_cfg["static_resources"]["clusters"][1]["load_assignment"]["endpoints"][0][
        "lb_endpoints"
    ].append(
        {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 18199}}}}
    )
    with h.run_envoy(dead_cfg):
        h.REC.clear()
        status, _, _, _ = post({"route": ["127.0.0.1:18199", POD1]})
        report(
            "c.member refuses connection, second serves",
            client_status=status,
            pods_tried=[r["port"] for r in h.REC.pod_requests],
            log=_await_log(),
        )


# --- (d) how fast the entry arrives -------------------------------------------------------


def exp_d() -> None:
    cfg = h.base_config()
    with h.run_envoy(cfg):
        lags_ms: list[float] = []
        lags_sse_ms: list[float] = []
        ids_match = 0
        for idx in range(60):
            h.REC.clear()
            if idx % 2:
                _, _, _, done = post({"route": [POD0]})
                target = lags_ms
            else:
                _, _, done, _ = stream({"route": [POD1], "mode": "sse"})
                target = lags_sse_ms
            assert h.wait_for(lambda: bool(h.REC.logs), 2.0), "no access log entry"
            target.append((h.REC.logs[0][0] - done) * 1e3)
            attributes = h.REC.processing[0][1].attributes["envoy.filters.http.ext_proc"]
            ids_match += attributes["request.id"] == h.REC.logs[0][1].request.request_id
        report(
            "d.log_lag_after_client_got_last_byte_ms",
            json_p50=round(statistics.median(lags_ms), 2),
            json_max=round(max(lags_ms), 2),
            sse_p50=round(statistics.median(lags_sse_ms), 2),
            sse_max=round(max(lags_sse_ms), 2),
            log_names=sorted(set(h.REC.log_names)),
            same_grpc_port=True,
            request_id_matches=f"{ids_match}/60",
        )


# --- (e) errors and failure modes -----------------------------------------------------------


def exp_e() -> None:
    with h.run_envoy(h.base_config()):
        h.REC.clear()
        status, headers, payload, _ = post({"immediate": 400})
        time.sleep(0.3)
        report(
            "e.immediate_response",
            status=status,
            content_type=headers.get("content-type"),
            body=payload.decode(),
            access_log_entries=len(h.REC.logs),
        )
        h.REC.clear()
        status, _, payload, _ = post({"route": [POD0], "sleep_s": 1.5})
        report("e.message_timeout.fail_closed", status=status, body=payload.decode()[:200])
        big = {"route": [POD0, POD1], "fail_ports": [h.POD_PORTS[0]], "pad": "x" * 8_000_000}
        h.REC.clear()
        status, _, _, _ = post(big)
        report(
            "e.8MB_body_with_retry",
            status=status,
            pod_bytes=[(r["port"], r["bytes"]) for r in h.REC.pod_requests],
            extproc_body_bytes=len(h.REC.processing[0][1].request_body.body),
        )


def exp_e_down() -> None:
    """extproc not listening: fail closed vs fail open; then it comes back."""
    for allow in (False, True):
        with h.run_envoy(h.base_config(failure_mode_allow=allow)):
            h.REC.clear()
            status, _, payload, _ = post({"route": [POD2]})
            report(
                "e.extproc_down",
                failure_mode_allow=allow,
                status=status,
                body=payload.decode()[:120],
                served=[r["port"] for r in h.REC.pod_requests],
            )
        with h.run_envoy(h.base_config(failure_mode_allow=allow)):
            h.REC.clear()
            restarted = h.start_grpc()
            try:
                time.sleep(0.2)
                statuses = []
                for _ in range(5):
                    statuses.append(post({"route": [POD2]})[0])
                report(
                    "e.extproc_restarted",
                    failure_mode_allow=allow,
                    statuses=statuses,
                    served=[r["port"] for r in h.REC.pod_requests],
                )
            finally:
                restarted.stop(0).wait()


def exp_g() -> None:
    """The access-log stream across an extproc restart with Envoy running; 4 MiB grpcio cap."""
    with h.run_envoy(h.base_config()):
        server = h.start_grpc()
        h.REC.clear()
        before = post({"route": [POD0]})[0]
        h.wait_for(lambda: bool(h.REC.logs))
        logs_before = len(h.REC.logs)
        server.stop(0).wait()
        during = post({"route": [POD0]})[0]
        server = h.start_grpc()
        try:
            h.REC.clear()
            after = [post({"route": [POD0]})[0] for _ in range(3)]
            h.wait_for(lambda: len(h.REC.logs) >= 3, 3.0)
            report(
                "g.access_log_after_restart",
                status_before=before,
                logs_before=logs_before,
                status_while_down=during,
                statuses_after=after,
                logs_after=len(h.REC.logs),
            )
        finally:
            server.stop(0).wait()
        server = h.start_grpc(max_receive_bytes=None)
        try:
            h.REC.clear()
            status, _, _, _ = post({"route": [POD0], "pad": "x" * 5_000_000})
            report(
                "g.5MB_body_default_grpcio_limit",
                status=status,
                extproc_messages=len(h.REC.processing),
            )
        finally:
            server.stop(0).wait()


def exp_f() -> None:
    """The one-round server shape: stream-unary handler (reply + OK status, stream closed)."""
    with h.run_envoy(h.base_config()):
        for path in ("/v1/chat/completions",):
            h.REC.clear()
            status, _, _, _ = post({"route": [POD2]}, path=path)
            report(
                "f.stream_unary",
                status=status,
                served=[r["port"] for r in h.REC.pod_requests],
                log=_await_log(),
            )
            h.REC.clear()
            status, _, _, _ = post({"route": [POD0, POD2], "fail_ports": [h.POD_PORTS[0]]})
            report(
                "f.stream_unary.retry",
                status=status,
                served=[r["port"] for r in h.REC.pod_requests],
            )


def main(argv: list[str]) -> None:
    wanted = set(argv) or {"a", "b", "c", "d", "e", "f", "g"}
    pods = h.Pods()
    pods.start()
    try:
        server = h.start_grpc()
        try:
            for name, fn in (("a", exp_a), ("b", exp_b), ("c", exp_c), ("d", exp_d), ("e", exp_e)):
                if name in wanted:
                    fn()
        finally:
            server.stop(0).wait()
        if "f" in wanted:
            unary = h.start_grpc(unary=True)
            try:
                exp_f()
            finally:
                unary.stop(0).wait()
        if "e" in wanted:
            exp_e_down()
        if "g" in wanted:
            exp_g()
    finally:
        pods.stop()


if __name__ == "__main__":
    main(sys.argv[1:])
