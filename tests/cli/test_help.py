"""The command line's help, written for the person running it: each command says what it
does, shows an invocation and where the docs are; serve's flags come in groups, and every
flag of serve, envoy-config and hash states its default."""

from __future__ import annotations

import argparse

import pytest

from extproc.cli import CLI_REFERENCE, build_parser

SERVE_GROUPS = {
    "Envoy and gRPC": {"--address", "--grpc-port", "--protocol", "--grpc-server"},
    "health and metrics": {"--health-port", "--metrics-port"},
    "routing": {"--config", "--num-fallbacks", "--session-header"},
    "pods from a file": {"--pods", "--pods-poll-s"},
    "pods from Kubernetes": {"--k8s-selector", "--k8s-target-port", "--inference-pool"},
    "scraping": {"--scrape-interval-s", "--stale-after-s"},
    "replicas and Redis": {"--record-metadata", "--redis-url"},
    "TLS": {"--grpc-tls", "--tls-cert-file", "--tls-key-file", "--tls-client-ca-file"},
    "KV-cache events": {"--kv-events-topology", "--kv-events-port"},
    "logging": {"--log-level", "--v"},
}


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def _flags(action: argparse.Action) -> set[str]:
    return set(action.option_strings)


def test_extproc_help_is_for_people_not_a_module_docstring() -> None:
    text = build_parser().format_help()
    assert "COMMANDS" not in text and "``" not in text
    assert "extproc serve --pods pods.yaml" in text and CLI_REFERENCE in text


@pytest.mark.parametrize(
    "command", ["serve", "envoy-config", "hash", "demo", "sim-pods", "simulate"]
)
def test_each_command_shows_an_invocation_and_the_docs(command: str) -> None:
    parser = _subparsers()[command]
    description = parser.description or ""
    assert f"extproc {command} " in description, "an example invocation"
    assert "make docs" in description and CLI_REFERENCE in description
    assert "``" not in description, "reStructuredText: a developer's docstring"


def test_serve_flags_are_in_their_groups() -> None:
    serve = _subparsers()["serve"]
    groups = {g.title: g for g in serve._action_groups}
    for title, expected in SERVE_GROUPS.items():
        assert title in groups, f"no group {title!r}"
        found = set().union(*(_flags(a) for a in groups[title]._group_actions))
        assert expected <= found, (title, expected - found)
    help_text = serve.format_help()
    assert all(f"\n{title}:\n" in help_text for title in SERVE_GROUPS)
    ungrouped = [a for a in groups["options"]._group_actions if a.dest != "help"]
    assert not ungrouped, [a.option_strings for a in ungrouped]


@pytest.mark.parametrize("command", ["serve", "envoy-config", "hash"])
def test_every_flag_states_its_default(command: str) -> None:
    parser = _subparsers()[command]
    formatter = parser._get_formatter()
    missing = [
        action.option_strings
        for action in parser._actions
        if action.option_strings
        and action.dest != "help"
        and "(default: " not in formatter._expand_help(action)
    ]
    assert not missing
    assert "(default: None)" not in parser.format_help()
