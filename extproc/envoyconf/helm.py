"""The Helm chart's Envoy bootstrap: ``extproc envoy-config``'s output as a named template.

``python -m extproc.envoyconf.helm`` writes ``charts/extproc/templates/_envoy-config.tpl``
(``tests/charts`` checks it is current). The bootstrap is built by the same code as
``envoy/envoy.yaml``, with a sentinel in every option the chart's values set; each
sentinel is then swapped for its template expression. Every sentinel must occur exactly
as often as expected, so a generator change that moves, renames or duplicates a field
fails here instead of shipping a half-templated file.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import NamedTuple

from extproc.envoyconf.build import make_bootstrap
from extproc.envoyconf.options import DEFAULT_ATTRIBUTE_HEADERS, EnvoyOptions
from extproc.envoyconf.render import render_bootstrap

TEMPLATE_PATH = Path(__file__).resolve().parents[2] / "charts/extproc/templates/_envoy-config.tpl"
TEMPLATE_NAME = "extproc.envoyConfig"
LISTEN_PORT = 8080  # the Envoy container's port; the Service maps envoy.service.port to it
EXTPROC_PORT = 9002  # the chart's extproc Service port (fixed, like the other two)

ENVOY_EXTPROC_CA_DIR = "/etc/envoy/extproc-ca"  # ca.crt of extproc's Secret, alone
ENVOY_CLIENT_TLS_DIR = "/etc/envoy/client-tls"  # Envoy's own certificate (mtls)

_FULLNAME = '{{ include "extproc.fullname" . }}'
_DOMAIN = "{{ .Release.Namespace }}.svc.{{ .Values.clusterDomain }}"


class Sentinel(NamedTuple):
    text: str  # as the generated YAML writes it
    expression: str  # what the template has instead
    num_occurrences: int  # how often it must occur


# Sentinels are values no real option would have and that cannot match elsewhere.
_OPTIONS = EnvoyOptions(
    extproc_address=f"extproc-sentinel.invalid:{EXTPROC_PORT}",
    pods_dns="pods-sentinel.invalid:59999",
    listen_address="0.0.0.0",
    listen_port=LISTEN_PORT,
    num_fallbacks=37,
    failure_mode_allow=True,
    message_timeout_s=7.125,
    max_message_timeout_s=61.875,
    max_body_bytes=16777259,
    attribute_headers=("sentinel-session-header", *DEFAULT_ATTRIBUTE_HEADERS[1:]),
    # TLS towards extproc in full (mTLS); the parts a mode does not use are cut by
    # conditions around them (_TLS_BLOCKS).
    extproc_tls=True,
    extproc_sni="extproc-sni-sentinel.invalid",
    extproc_ca_file=f"{ENVOY_EXTPROC_CA_DIR}/ca.crt",
    extproc_client_cert_file=f"{ENVOY_CLIENT_TLS_DIR}/tls.crt",
    extproc_client_key_file=f"{ENVOY_CLIENT_TLS_DIR}/tls.key",
    # Tracing in full; cut without tracing.otlpEndpoint (_TRACING_BLOCKS).
    otlp_endpoint="otlp-sentinel.invalid:59998",
    trace_sampling=0.375,
)
_TLS_MODE = '(include "extproc.tlsMode" .)'


class Block(NamedTuple):
    key: str  # the line opening the block, as the generated YAML writes it
    condition: str  # the template condition it is kept under


# Each block is its key's line and every more-indented line after it.
_TLS_BLOCKS = (
    Block("    transport_socket:", f'ne {_TLS_MODE} "off"'),
    # extproc's certificate is verified unless it is self-signed.
    Block("          validation_context:", f'ne {_TLS_MODE} "self-signed"'),
    Block("          tls_certificates:", f'eq {_TLS_MODE} "mtls"'),
)
_TRACING = ".Values.tracing.otlpEndpoint"
_TRACING_BLOCKS = (
    Block("          tracing:", _TRACING),
    Block("  - name: otlp_collector", _TRACING),
)
_SENTINELS = (
    # The headless Service: every replica's address, each ext_proc stream balanced.
    Sentinel("extproc-sentinel.invalid", f"{_FULLNAME}-replicas.{_DOMAIN}", 1),
    # The SNI and the name extproc's certificate must carry: its Service's DNS name.
    Sentinel("extproc-sni-sentinel.invalid", f"{_FULLNAME}.{_DOMAIN}", 2),
    Sentinel("pods-sentinel.invalid", f"{_FULLNAME}-model-servers.{_DOMAIN}", 1),
    Sentinel("port_value: 59999", "port_value: {{ .Values.modelServers.targetPort }}", 1),
    Sentinel("num_retries: 37", "num_retries: {{ .Values.picker.numFallbacks }}", 1),
    Sentinel(
        "failure_mode_allow: true", "failure_mode_allow: {{ .Values.envoy.failureModeAllow }}", 1
    ),
    Sentinel("7.125s", "{{ .Values.envoy.messageTimeoutSeconds }}s", 1),
    Sentinel("61.875s", "{{ .Values.envoy.maxMessageTimeoutSeconds }}s", 1),
    # The listener's buffer limit and the buffer filter's limit.
    Sentinel("16777259", "{{ .Values.picker.maxBodyBytes | int64 }}", 2),
    Sentinel("sentinel-session-header", "{{ .Values.picker.sessionHeader }}", 1),
    Sentinel("otlp-sentinel.invalid", f'{{{{ (split ":" {_TRACING})._0 }}}}', 1),
    Sentinel("port_value: 59998", f'port_value: {{{{ (split ":" {_TRACING})._1 }}}}', 1),
    Sentinel("value: 37.5", "value: {{ mulf .Values.tracing.samplingRatio 100 }}", 1),
)


def render_template() -> str:
    """The bootstrap for the chart's standalone mode, as a Helm ``define`` block.

    Raises:
        ValueError: a sentinel is missing or occurs more often than expected.
    """
    text = render_bootstrap(
        make_bootstrap((), _OPTIONS),
        summary="pods from the chart's headless Service, extproc replicas from theirs",
    )
    if "{{" in text or "}}" in text:
        raise ValueError("the generated bootstrap contains template delimiters")
    for block in (*_TLS_BLOCKS, *_TRACING_BLOCKS):
        text = _wrap(text, block)
    for sentinel in _SENTINELS:
        found = text.count(sentinel.text)
        if found != sentinel.num_occurrences:
            raise ValueError(
                f"sentinel {sentinel.text!r} occurs {found} times, expected {sentinel.num_occurrences}"
            )
        text = text.replace(sentinel.text, sentinel.expression)
    return (
        "{{/* Generated by `python -m extproc.envoyconf.helm` from extproc/envoyconf: do not\n"
        "edit. The standalone Envoy's bootstrap, built by the code that writes envoy/. */}}\n"
        f'{{{{- define "{TEMPLATE_NAME}" -}}}}\n{text}{{{{- end }}}}\n'
        "\n{{/* The port the bootstrap's listener binds, for the container and Service. */}}\n"
        f'{{{{- define "extproc.envoyListenPort" -}}}}{LISTEN_PORT}{{{{- end }}}}\n'
    )


def _wrap(text: str, block: Block) -> str:
    """``text`` with ``block`` kept only under its condition, with the comment lines
    right above it.

    Raises:
        ValueError: the block's key is not one line of ``text``.
    """
    lines = text.split("\n")
    starts = [i for i, line in enumerate(lines) if line == block.key]
    if len(starts) != 1:
        raise ValueError(f"block {block.key.strip()!r} occurs {len(starts)} times, expected 1")
    start = end = starts[0]
    indent = len(block.key) - len(block.key.lstrip())
    while start > 0 and lines[start - 1].startswith(" " * indent + "# "):
        start -= 1
    while end + 1 < len(lines) and (
        len(lines[end + 1]) - len(lines[end + 1].lstrip()) > indent
        or lines[end + 1].lstrip().startswith("- ")
        and len(lines[end + 1]) - len(lines[end + 1].lstrip()) >= indent
    ):
        end += 1
    lines[start : end + 1] = [
        f"{{{{- if {block.condition} }}}}",
        *lines[start : end + 1],
        "{{- end }}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", type=Path, default=TEMPLATE_PATH)
    args = parser.parse_args(argv)
    args.output.write_text(render_template(), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
