"""A simulated vLLM: engine model (no network) and simulated pods over HTTP.

    tokenizer.py  text and chat -> tokens; the deterministic "model output"
    kv_cache.py   block hashes, the block pool with vLLM's prefix cache, KV-cache events
    engine.py     EngineConfig and Engine: vLLM V1's scheduler (chunked prefill, preemption), counters
    runner.py     drives an Engine in real time on an asyncio loop
    api.py        OpenAI request parsing and response / stream shapes, as vLLM serves them
    metrics.py    one Prometheus registry per pod with vLLM's metric names
    kv_events.py  vLLM's KV-cache event wire format over ZMQ
    lora.py       LoRA adapters: the registry of served adapters, the GPU slots, --lora-modules
    faults.py     injected failures: errors, refused connections, cut streams, delay
    pods.py       N pods on N ports of 127.0.0.1 (aiohttp) plus an admin port
    pods_cli.py   ``extproc sim-pods``
    launch.py     start pods, extproc and Envoy as local processes (``extproc demo``)
    demo.py       ``extproc demo``
    workloads.py  seeded workloads for the offline simulator: multi-tenant burst, chats
    traces.py     Mooncake request traces as workloads
    policies.py   routing policies that see pods as a router does, the real scheduler one
    offline.py    discrete-event replay of a workload through N engines, no network
    report.py     per-policy summary: table, JSON, PNG
    simulate_cli.py  ``extproc simulate``

The engine is deterministic and driven by explicit time (``Engine.step(now)``), so the
same model serves both a discrete-event simulator with a virtual clock and the HTTP pods,
whose runner calls it with the loop's clock.
"""
