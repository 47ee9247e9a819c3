"""Prometheus metrics on the server's own CollectorRegistry (never the process-global one).

Engine state (queues, KV pool, prefix cache, token counts) is read at scrape time by a collector;
per-request latencies are histograms observed as outputs arrive."""
from __future__ import annotations

import ctypes
import ctypes.util
import sys

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, \
    generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4,
                0.5, 0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0,
                120.0, 300.0)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _mallinfo2():
    """glibc's mallinfo2 (2.33+), or None: malloc's own count of the bytes in use."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        f = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    f.restype = _MallInfo2
    return f


_MALLINFO2 = _mallinfo2()


def heap_in_use_bytes() -> int | None:
    """Bytes malloc has handed out and not had back (small chunks and mmapped ones), or None
    where glibc's mallinfo2 is missing. Unlike RSS it has no high-water marks: it falls back when
    memory is freed, so a leak shows as growth from one idle moment to the next."""
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()
    return info.uordblks + info.hblkhd


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, async_engine, inflight=lambda: 0):
        self.async_engine = async_engine
        self.inflight = inflight  # engine requests the HTTP server is serving now
        self.registry = CollectorRegistry()
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.registry.register(_EngineCollector(self))
        r = self.registry
        self.ttft = Histogram("luceio_time_to_first_token_seconds",
                              "time from arrival to the first output token", buckets=_TTFT_BUCKETS,
                              registry=r)
        self.itl = Histogram("luceio_inter_token_latency_seconds",
                             "time between consecutive outputs of a request",
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("luceio_e2e_request_latency_seconds",
                             "time from arrival to the last output", buckets=_E2E_BUCKETS,
                             registry=r)
        self.requests = Counter("luceio_requests", "finished sequences by finish reason",
                                ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("luceio_prompt_tokens", "prompt tokens of admitted requests",
                                     registry=r)
        self.generation_tokens = Counter("luceio_generation_tokens",
                                         "tokens generated and sent back", registry=r)
        self.http_errors = Counter("luceio_http_errors", "error responses by status code",
                                   ["status"], registry=r)

    def record_speculation(self, num_draft: int, num_accepted: int) -> None:
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    def __init__(self, m: ServerMetrics):
        self.m = m

    def collect(self):
        m = self.m
        st = m.async_engine.stats()

        def gauge(name, doc, value):
            return GaugeMetricFamily(name, doc, value=value)

        def counter(name, doc, value):
            return CounterMetricFamily(name, doc, value=value)

        yield gauge("luceio_num_requests_running", "sequences running in the engine",
                    st.num_running)
        yield gauge("luceio_num_requests_waiting", "sequences waiting (queued or preempted)",
                    st.num_waiting)
        # open per-request state at each layer: all three are 0 when the server is idle
        yield gauge("luceio_server_inflight_requests", "engine requests the HTTP server is "
                    "serving", m.inflight())
        yield gauge("luceio_engine_request_states", "requests the engine holds output state for",
                    st.num_request_states)
        yield gauge("luceio_engine_output_streams", "open async output streams",
                    m.async_engine.num_open_streams())
        # process memory in use now (no high-water marks): flat from one idle moment to the next
        yield gauge("luceio_process_python_allocated_blocks", "blocks Python's small-object "
                    "allocator has handed out (sys.getallocatedblocks)", sys.getallocatedblocks())
        heap = heap_in_use_bytes()
        if heap is not None:
            yield gauge("luceio_process_heap_in_use_bytes", "bytes malloc has handed out (glibc "
                        "mallinfo2: uordblks + hblkhd)", heap)
        yield gauge("luceio_kv_blocks_total", "KV cache blocks in the pool", st.kv_blocks_total)
        yield gauge("luceio_kv_blocks_used", "KV cache blocks held by requests", st.kv_blocks_used)
        yield gauge("luceio_kv_blocks_free", "KV cache blocks free (cached-free included)",
                    st.kv_blocks_free)
        yield gauge("luceio_kv_cache_usage_ratio", "fraction of KV blocks in use", st.kv_usage)
        if st.offloaded_blocks is not None:
            yield gauge("luceio_kv_offloaded_blocks", "blocks whose KV waits in host memory "
                        "(bounded residency)", st.offloaded_blocks)
            yield counter("luceio_kv_offloads", "blocks moved to host memory", st.kv_offloads)
            yield counter("luceio_kv_reloads", "blocks brought back from host memory",
                          st.kv_reloads)
        if st.experts is not None:
            yield gauge("luceio_expert_slots", "device slots per sparse layer for experts "
                        "(--expert-memory)", st.experts.num_slots)
            yield counter("luceio_expert_cache_hits", "experts a step needed that were on the "
                          "device (all sparse layers)", st.experts.hits)
            yield counter("luceio_expert_cache_misses", "experts a step needed that were "
                          "copied from host memory", st.experts.misses)
            yield counter("luceio_expert_bytes_loaded", "bytes of expert weights copied from "
                          "host to device", st.experts.bytes_loaded)
        yield counter("luceio_prefix_cache_queries", "prefix-cache block lookups",
                      st.prefix_cache_lookups)
        yield counter("luceio_prefix_cache_hits", "prefix-cache block hits", st.prefix_cache_hits)
        yield gauge("luceio_prefix_cache_hit_rate", "prefix-cache hits / lookups (0 before any)",
                    st.prefix_cache_hit_rate)
        yield counter("luceio_engine_prompt_tokens", "prompt tokens the engine computed "
                      "(prefill; engine stats)", st.prompt_tokens)
        yield counter("luceio_engine_generation_tokens", "tokens the engine sampled (engine "
                      "stats)", st.generation_tokens)
        yield counter("luceio_engine_steps", "engine steps run", st.steps)
        yield counter("luceio_num_preemptions", "sequences preempted (recomputed later)",
                      st.preemptions)
        yield counter("luceio_spec_decode_draft_tokens", "draft tokens proposed (finished "
                      "requests)", m.num_draft_tokens)
        yield counter("luceio_spec_decode_accepted_tokens", "draft tokens accepted (finished "
                      "requests)", m.num_accepted_tokens)
        yield gauge("luceio_spec_decode_acceptance_rate", "accepted / proposed draft tokens "
                    "(0 when speculation is off)",
                    m.num_accepted_tokens / m.num_draft_tokens if m.num_draft_tokens else 0.0)
