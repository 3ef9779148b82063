"""The wire contract between Envoy and extproc (the Endpoint Picker Protocol and ours).

Shared by the Envoy config generator (``extproc.envoyconf``) and the gRPC server, so the
names Envoy is told to send are the names the server reads.
"""

from __future__ import annotations

# The Endpoint Picker Protocol (Gateway API Inference Extension): the ext_proc reply's
# dynamic metadata namespace and key holding the ordered "ip:port,ip:port" list.
DESTINATION_NAMESPACE = "envoy.lb"
DESTINATION_KEY = "x-gateway-destination-endpoint"

# Prefill/decode disaggregation (the llm-d convention): the chosen prefill pod's
# "ip:port", which the decode pod reads from this request header. extproc cannot set
# request headers in its one-round mode, so it puts the value in the reply's envoy.lb
# metadata under the same name and the route adds the header from there.
PREFILL_HEADER = "x-prefiller-host-port"

# How many retries this request gets: one per fallback extproc listed, so that a retry
# never goes past the list to the cluster's round-robin fallback (a pod extproc left out:
# not ready, not serving the model, or filtered). Envoy's router reads this request
# header; like the prefill pod it travels in the reply's envoy.lb metadata under the same
# name and the route adds the header, which overrides the route's num_retries.
MAX_RETRIES_HEADER = "x-envoy-max-retries"
# extproc's own namespace in the reply's dynamic metadata: the request's record (model,
# session, block keys, the pods listed), which Envoy's gRPC access log carries back in
# common_properties.metadata, so that any replica can record any request.
RECORD_NAMESPACE = "extproc.record"
RECORD_KEY = "r"  # its one field: the record as JSON text (wire.record_metadata)

# The Endpoint Picker Protocol's subset hint: a gateway may restrict the candidates by
# setting this filter metadata before ext_proc; Envoy forwards it in
# ProcessingRequest.metadata_context.filter_metadata[SUBSET_HINT_NAMESPACE].
SUBSET_HINT_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_HINT_KEY = "x-gateway-destination-endpoint-subset"  # for the server: a list of ip:port

# Request headers are skipped, so what extproc needs besides the body comes as ext_proc
# attributes on the body message: ProcessingRequest.attributes[ATTRIBUTES_KEY] is a
# Struct keyed by the expression text, e.g. {"request.path": "/v1/completions",
# "request.id": "<x-request-id>", "request.headers['x-session-id']": "abc"}; a header the
# client did not send is absent.
ATTRIBUTES_KEY = "envoy.filters.http.ext_proc"
PATH_ATTRIBUTE = "request.url_path"  # without the query string ("request.path" has it)
REQUEST_ID_ATTRIBUTE = "request.id"  # the x-request-id Envoy generated; also in the access log
ACCESS_LOG_NAME = "extproc"  # StreamAccessLogsMessage.identifier.log_name

# Request headers a client must never get to the pods: the destination header would
# steer traffic under a header-source override_host (we use metadata only, but a
# gateway in front or behind might not), and the "served" header is ours to set.
INTERNAL_HEADERS: tuple[str, ...] = (
    DESTINATION_KEY,
    f"{DESTINATION_KEY}-served",
    PREFILL_HEADER,
)


HEADER_ATTRIBUTE_PREFIX = "request.headers['"
HEADER_ATTRIBUTE_SUFFIX = "']"

# The Gateway API Inference Extension's flow control headers: the request's objective
# (an InferenceObjective's name, which gives its priority) and its fairness key.
OBJECTIVE_HEADER = "x-gateway-inference-objective"
FAIRNESS_HEADER = "x-gateway-inference-fairness-id"


def header_attribute(header: str) -> str:
    """The attribute name (a CEL expression) under which a request header arrives."""
    return f"{HEADER_ATTRIBUTE_PREFIX}{header}{HEADER_ATTRIBUTE_SUFFIX}"


# The gRPC services extproc serves on its one port.
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
PROCESS_PATH = f"/{EXT_PROC_SERVICE}/Process"
ACCESS_LOG_SERVICE = "envoy.service.accesslog.v3.AccessLogService"
ACCESS_LOG_PATH = f"/{ACCESS_LOG_SERVICE}/StreamAccessLogs"
