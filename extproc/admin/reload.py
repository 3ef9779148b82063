"""Live reload of the scheduler configuration (``--config``): on a change of the file's
content (polled every ``--config-poll-s``; a Kubernetes ConfigMap volume swaps a symlink,
so the content is compared, through the link) and on SIGHUP (``reload_now``).

A new file is validated completely first: parsed, its flowControl and modelRewrites
sections parsed (a rewrite's target must be served by a known pod), and a scheduler
built from it on a scratch registry. Then the scheduler is built again on the
live registry, each plugin taking over the state of the plugin of its type in force
(``Reloadable.adopt``: the prefix views, the arriving prompts, precise-prefix-cache's
KV-event view; the router's in-flight counters, pending records and session bindings are
the router's and are handed to it), and swapped in between two requests
(``Router.set_scheduler``), with the new rewrite rules (``Router.set_rewrites``).

Refused, the configuration in force staying (one log line naming the file):

* ``invalid``: the file cannot be read or parsed, a plugin's arguments are bad, a rewrite
  rule is malformed or names a target no known pod serves;
* ``refused``: it changes what only a restart can: the flowControl section (the flow
  controller holds the requests queued under the old one), or adds or removes
  precise-prefix-cache (its KV-event subscriber is made at start-up).

Metrics: ``extproc_config_reloads_total{result=applied|invalid|refused|unchanged}``
(``unchanged``: a SIGHUP with the content in force; the poll does not count it),
``extproc_config_last_reload_success`` (1: the file is the configuration in force),
``extproc_config_last_reload_timestamp_seconds`` and ``extproc_config_info{hash,source}``
(1, for the content in force: its SHA-256's first 16 hex digits). The first load counts
as applied.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from extproc.errors import ConfigError
from extproc.routing.flow.config import parse_flow_control
from extproc.routing.rewrites import check_targets, parse_model_rewrites
from extproc.routing.router import Router
from extproc.scheduling.config import (
    SchedulerConfig,
    build_scheduler,
    config_text,
    parse_config,
    plugins_of,
)
from extproc.scheduling.plugins.precise_prefix_cache import PrecisePrefixCache

log = logging.getLogger("extproc.reload")

DEFAULT_POLL_S = 2.0
RESULTS = ("applied", "invalid", "refused", "unchanged")


def add_reload_arguments(p: argparse.ArgumentParser, env: Callable[[str, Any], Any]) -> None:
    """``serve``'s reload flag (``env``: its ``EXTPROC_<FLAG>`` default)."""
    g = p.add_argument_group(
        "configuration reload", "the --config file applied live when it changes, or on SIGHUP"
    )
    g.add_argument(
        "--config-poll-s",
        type=float,
        default=env("config-poll-s", str(DEFAULT_POLL_S)),
        help="how often the --config file is checked for a new content, applied live when "
        "valid (also on SIGHUP); 0: only on SIGHUP (default: %(default)s s)",
    )


def content_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class Refused(Exception):
    """A valid configuration that only a restart can apply."""


class ReloadMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        reloads = Counter(
            "extproc_config_reloads",
            "Scheduler configuration loads, by result: applied (the first load too), "
            "invalid, refused (needs a restart), unchanged (a SIGHUP with the same content).",
            ["result"],
            registry=registry,
        )
        self.reloads = {result: reloads.labels(result) for result in RESULTS}
        self.success = Gauge(
            "extproc_config_last_reload_success",
            "1 when the last load of the configuration file was applied (or its content "
            "is the one in force), 0 when it was refused.",
            registry=registry,
        )
        self.timestamp = Gauge(
            "extproc_config_last_reload_timestamp_seconds",
            "When the configuration was last loaded or refused (Unix time).",
            registry=registry,
        )
        self.info = Gauge(
            "extproc_config_info",
            "1 for the scheduler configuration in force: its content's hash and its source.",
            ["hash", "source"],
            registry=registry,
        )

    def count(self, result: str, success: bool) -> None:
        self.reloads[result].inc()
        self.success.set(1 if success else 0)
        self.timestamp.set(time.time())

    def in_force(self, digest: str, source: str) -> None:
        self.info.clear()
        self.info.labels(digest, source).set(1)


class ConfigReloader:
    """Watches ``path`` and applies its valid changes to ``router`` (module doc)."""

    def __init__(
        self,
        router: Router,
        path: str | Path | None,
        text: str,
        config: SchedulerConfig,
        registry: CollectorRegistry,
        poll_s: float = DEFAULT_POLL_S,
    ) -> None:
        """``text`` and ``config``: the configuration ``router`` was started with."""
        self.router = router
        self.path = path
        self.registry = registry
        self.poll_s = poll_s
        self.config = config
        # A file to watch: not the embedded default nor a shipped one chosen by name.
        self.watching = path is not None and config.source == str(path)
        self.digest = self._seen = content_hash(text)
        self._seen_result = "applied"  # what the content last seen came to
        self.metrics = ReloadMetrics(registry)
        self.metrics.count("applied", True)
        self.metrics.in_force(self.digest, config.source)
        self._lock = threading.Lock()  # one reload at a time (poll and SIGHUP)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Poll the file on a thread of its own (not with no file or ``poll_s`` 0)."""
        if self.watching and self.poll_s > 0:
            self._thread = threading.Thread(target=self._poll, name="config-reload", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def _poll(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.reload(counted_unchanged=False)
            except Exception:  # the watcher must outlive any surprise
                log.exception("configuration reload failed")

    def reload_now(self) -> str:
        """Load the file now (SIGHUP); the result (``RESULTS``)."""
        if not self.watching:
            log.info("reload: the configuration is %s, not a file: nothing to reload", self.path)
            return "unchanged"
        return self.reload(counted_unchanged=True)

    def reload(self, counted_unchanged: bool) -> str:
        with self._lock:
            return self._reload(counted_unchanged)

    def _reload(self, counted_unchanged: bool) -> str:
        source = str(self.path)
        try:
            text, source = config_text(self.path)
        except ConfigError as exc:
            key = f"unreadable: {exc}"  # said once, while it stays unreadable alike
            return self._refuse("invalid", source, str(exc), key, counted_unchanged)
        digest = content_hash(text)
        if digest == self.digest:
            if counted_unchanged or self._seen != digest:  # asked, or back to the one in force
                self._seen = digest
                self.metrics.count("unchanged", True)
                log.info("reload: %s unchanged (%s)", source, digest)
            return "unchanged"
        if digest == self._seen and not counted_unchanged:
            return self._seen_result  # refused already: said once
        try:
            config = parse_config(text, source)
            self._check(config)
            rewrites = parse_model_rewrites(config.model_rewrites, config.source)
            check_targets(rewrites, self.router.pods)
            # Validated completely on a scratch registry before the live one is touched.
            build_scheduler(config, CollectorRegistry(auto_describe=True))
        except Refused as exc:
            return self._refuse("refused", source, str(exc), digest, True)
        except (ConfigError, ValueError, TypeError, OSError) as exc:  # a plugin's own too
            error = str(exc) or type(exc).__name__
            return self._refuse("invalid", source, error, digest, True)
        old = self.router.scheduler
        try:
            new = build_scheduler(config, self.registry, old.in_flight, old.sessions, old)
        except (ConfigError, ValueError, TypeError, OSError) as exc:  # the live registry's
            return self._refuse("invalid", source, str(exc), digest, True)
        self.router.set_scheduler(new)
        self.router.set_rewrites(rewrites)
        self.config, self.digest, self._seen = config, digest, digest
        self.metrics.count("applied", True)
        self.metrics.in_force(digest, source)
        log.info("reload: applied %s (%s)", source, digest)
        return "applied"

    def _check(self, config: SchedulerConfig) -> None:
        """Refuse what a restart alone can apply (module doc).

        Raises:
            ConfigError: the new flowControl section is invalid.
            Refused: it changed, or precise-prefix-cache was added or removed.
        """
        new_flow = parse_flow_control(config.flow_control, config.source)
        if new_flow != parse_flow_control(self.config.flow_control, self.config.source):
            raise Refused("the flowControl section changed: restart extproc to apply it")
        name = PrecisePrefixCache.type_name
        had = name in plugins_of(self.router.scheduler)
        has = name in config.filters or any(s.name == name for s in config.scores)
        if had != has:
            raise Refused(
                f"{name} {'removed' if had else 'added'}: its KV-event subscriber is made at "
                "start-up; restart extproc to apply it"
            )

    def _refuse(self, result: str, source: str, error: str, key: str, new: bool) -> str:
        """Count and log a refusal of the content ``key`` (``new``: not refused already)."""
        if not new and key == self._seen:
            return self._seen_result
        self._seen, self._seen_result = key, result
        self.metrics.count(result, False)
        # One line: the error may span several (YAML's).
        log.error(
            "reload: %s %s, the configuration in force (%s) stays: %s",
            source,
            result,
            self.digest,
            " ".join(error.split()),
        )
        return result
