"""The simulated pods decode and refuse bodies as vLLM 0.32 does: every body of the edge
corpus (``testkit.edge_bodies``) gets the status class vLLM answered it with
(``VLLM_STATUS``, measured on a real pod), from a pod set up as that pod was (its model
name, a 512-token context), and vLLM's error body when refused, never a 5xx."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import httpx
import pytest

from extproc.sim.launch import SimPods
from extproc.sim.pods import GroupSettings
from testkit.edge_bodies import VLLM_STATUS, edge_bodies
from testkit.factories import FAST_ENGINE
from testkit.harness import run_sim_pods

MODEL = "qwen3-tiny"
CORPUS = {e.name: e for e in edge_bodies(MODEL)}
MAX_MODEL_LEN = 512  # the real-vLLM tests' pods (e2e/real_vllm/pods.py)


@pytest.fixture(scope="module")
def pod() -> Iterator[httpx.Client]:
    engine = replace(FAST_ENGINE, max_model_len=MAX_MODEL_LEN)
    group: SimPods
    with (
        run_sim_pods(GroupSettings(num_pods=1, model=MODEL, engine=engine)) as group,
        httpx.Client(base_url=group.pods[0].url, timeout=30) as client,
    ):
        yield client


def test_every_corpus_body_has_vllms_status() -> None:
    assert sorted(VLLM_STATUS) == sorted(CORPUS)


@pytest.mark.parametrize("name", list(CORPUS))
def test_the_sim_answers_as_vllm(pod: httpx.Client, name: str) -> None:
    edge = CORPUS[name]
    answer = pod.post(
        edge.api.value, content=edge.body, headers={"content-type": "application/json"}
    )
    outcome = f"vLLM {VLLM_STATUS[name]}; sim {answer.status_code} {answer.text[:300]!r}"
    assert answer.status_code // 100 == VLLM_STATUS[name] // 100, outcome
    if answer.status_code >= 400:
        error = answer.json()["error"]
        assert error["code"] == answer.status_code and error["message"], outcome
