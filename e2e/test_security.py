"""Nobody steers around extproc: client-sent routing headers neither steer nor reach a
pod, tenants' salts never share prefixes (also under concurrency), and every port binds
where it was told to, nowhere else. (The EPP variant of the header test is in
test_gateway_epp.py, on its stacks; the chart's NetworkPolicy in tests/charts.)"""

from __future__ import annotations

import ipaddress
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from e2e.support import (
    RECORDED,
    body_for,
    client_routing_headers,
    metric,
    send_and_wait_recorded,
    served_by,
    unique_prefix,
)
from extproc.sim.launch import SimPods, Stack
from extproc.wire.protocol import INTERNAL_HEADERS
from testkit.waiting import wait_until

API = "/v1/completions"
MISSES = ("kthena_router_prefix_cache_match_ratio_bucket", 'le="0.0",model="sim-llm"')


def test_client_routing_headers_never_steer_and_never_reach_a_pod(
    stack: Stack, client: httpx.Client, sim: SimPods
) -> None:
    prefix = unique_prefix()
    owner = send_and_wait_recorded(stack, client, API, body_for(API, prefix, "q"))
    for other in (p for p in sim.pods if p.name != owner):
        headers = client_routing_headers(f"127.0.0.1:{other.port}")
        assert (
            served_by(client.post(API, json=body_for(API, prefix, "q"), headers=headers)) == owner
        )
    for seen in sim.stats(owner)["recent"][-3:]:
        # what extproc and the route set is stripped; the subset hint is metadata in the
        # protocol, so a header of that name means nothing to anyone and goes through
        assert not set(seen["routing_headers"]) & set(INTERNAL_HEADERS), seen


def test_salts_never_share_prefixes_under_concurrency(stack: Stack, client: httpx.Client) -> None:
    """Eight tenants send one prompt at once: all eight miss. Then each sends four more
    at once while eight new tenants arrive: exactly the eight newcomers miss (the 32
    others match, and a salted chain can only match its own salt's records)."""
    prompt = unique_prefix()
    old = [f"tenant-{i}-{prompt[:9]}" for i in range(8)]
    new = [f"newcomer-{i}-{prompt[:9]}" for i in range(8)]

    def send(salt: str) -> str:
        return served_by(client.post(API, json=body_for(API, prompt, "q", cache_salt=salt)))

    misses, recorded = metric(stack, *MISSES), metric(stack, *RECORDED)
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(send, old))
    assert metric(stack, *MISSES) == misses + 8
    wait_until(lambda: metric(stack, *RECORDED) >= recorded + 8)
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(send, [*new, *(salt for salt in old for _ in range(4))]))
    assert metric(stack, *MISSES) == misses + 16


def listening(pid: int) -> set[tuple[str, int]]:
    """The (address, port) of each TCP socket ``pid`` listens on, from /proc."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        target = (
            os.readlink(f"/proc/{pid}/fd/{fd}") if os.path.exists(f"/proc/{pid}/fd/{fd}") else ""
        )
        if match := re.fullmatch(r"socket:\[(\d+)\]", target):
            inodes.add(match.group(1))
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            host, port = local.split(":")
            raw = bytes.fromhex(host)
            # /proc prints each 32-bit word in host (little-endian) order
            packed = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            address = ipaddress.ip_address(packed)
            if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
                address = address.ipv4_mapped
            found.add((str(address), int(port, 16)))
    return found


def test_every_port_binds_where_configured_and_nowhere_else(stack: Stack) -> None:
    health = int(re.search(r"health on :(\d+)", stack.extproc.log_tail(200_000)).group(1))  # type: ignore[union-attr]
    assert listening(stack.extproc.pid) == {
        ("127.0.0.1", stack.grpc_port),
        ("127.0.0.1", health),
        ("127.0.0.1", stack.metrics_port),
    }
    assert listening(stack.envoy.pid) == {
        ("127.0.0.1", stack.listen_port),
        ("127.0.0.1", stack.admin_port),
    }
