# syntax=docker/dockerfile:1
# The extproc image: `docker build -t extproc:0.1.0 .` (the chart's default image is
# extproc:<appVersion>). Only `extproc serve`'s runtime dependencies and the tracing
# extra (the chart's tracing.otlpEndpoint): no simulator, no tests.

# Builder: the extproc wheel (its kernels compiled: this image has a C compiler, the slim
# one does not) and a wheel of every runtime dependency, so the final stage installs
# offline and never compiles.
FROM python:3.11 AS builder
WORKDIR /build
COPY pyproject.toml setup.py README.md ./
COPY extproc/ extproc/
RUN pip wheel --wheel-dir /wheels '.[tracing]'

# Runtime: the wheels installed from a bind mount (they do not stay in a layer), then a
# non-root user; 65532 is the chart's podSecurityContext.runAsUser. opentelemetry-proto
# goes in again last: xds-protos ships an old copy of its files, which the OTLP exporter
# cannot import, and pip's order decides whose files stay.
FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index --find-links=/wheels 'extproc[tracing]' && \
    pip install --no-cache-dir --no-index --find-links=/wheels --no-deps --force-reinstall \
      opentelemetry-proto
USER 65532:65532
# ext_proc and the access log (gRPC), gRPC health, Prometheus metrics: the chart's ports.
# serve refuses to start without a pods source: the chart adds --k8s-selector or
# --inference-pool; with `docker run`, set EXTPROC_PODS to a mounted pods file (or give
# the whole serve command, with --pods FILE).
EXPOSE 9002 9003 9090
ENTRYPOINT ["extproc"]
CMD ["serve", "--address=0.0.0.0", "--grpc-port=9002", "--health-port=9003", "--metrics-port=9090"]
