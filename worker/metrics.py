"""Worker metrics (DESIGN.md §6 worker names), labelled ``worker`` and ``role``."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from k3serve.prometheus import render


class WorkerMetrics:
    """The worker metrics of DESIGN.md §6, labelled ``worker`` and ``role``, on their own
    registry. Counters may be incremented from any thread; gauges are set at scrape time.

    Families (prometheus-client appends ``_total`` to counters)::

        k3serve:prefix_cache_queries_total{worker,role}         prompt tokens looked up
        k3serve:prefix_cache_hits_total{worker,role,source}     tokens reused (local|store)
        k3serve:kv_transfer_bytes_total{worker,role}            bytes written (prefill side)
        k3serve:kv_transfer_seconds{worker,role}                histogram, admission → done
        k3serve:kv_transfer_write_bytes_total{worker,role}      bytes of successful transfers
        k3serve:kv_transfer_write_seconds_total{worker,role}    their last layer ready → last
                                                                write confirmed, summed (the
                                                                in-stack rate is bytes / this)
        k3serve:kda_snapshots{worker,role}                      gauge, snapshots held
        k3serve:cache_usage_ratio{worker,role}                  gauge, referenced pages / all
        k3serve:num_requests_running{worker,role}               gauge
        k3serve:num_requests_waiting{worker,role}               gauge
        k3serve:kv_transfer_fallbacks_total{worker,role}        decode recomputed the prefill
        k3serve:kv_transfers_total{worker,role,outcome}         finished transfers by outcome
        k3serve:kv_transfer_expiries_total{worker,role}         transfers past their deadline
                                                                (decode: ticket; prefill: sender)
        k3serve:kv_faults_injected_total{worker,role,kind}      K3SERVE_KV_FAULT_* (fail|hang|pair)
        k3serve:requests_resumed_total{worker,role}             migrated requests resumed here
        k3serve:expert_routed_tokens_total{worker,role,layer,expert}  routed tokens
        k3serve:spec_proposed_tokens_total{worker,role}         speculative tokens proposed
        k3serve:spec_accepted_tokens_total{worker,role}         … and accepted by the target
        k3serve:spec_emitted_tokens_total{worker,role}          tokens verify steps appended
        k3serve:spec_verify_rows_total{worker,role}             sequence-steps verified
        k3serve:spec_verify_steps_total{worker,role}            verify forwards
        k3serve:spec_accepted_tokens_per_position_total{worker,role,position}
                                                                rows accepting the proposal at
                                                                ``position`` (0-based)
        k3serve:spec_acceptance_rate{worker,role}               gauge, accepted / proposed
        k3serve:spec_mean_accepted_length{worker,role}          gauge, emitted / verify rows
                                                                (decode workers that speculate)

    Transfers are counted once, by the side that owns the figure: bytes, seconds and outcomes
    by the sender (prefill worker), fallbacks by the decode worker.
    """

    def __init__(self, worker: str, role: str) -> None:
        self.labels = {"worker": worker, "role": role}
        r = self.registry = CollectorRegistry()
        lab = ["worker", "role"]
        self._queries = Counter("k3serve:prefix_cache_queries",
                                "Prompt tokens looked up in the prefix cache.", lab, registry=r)
        self._hits = Counter("k3serve:prefix_cache_hits",
                             "Prompt tokens reused from the prefix cache, by source.",
                             lab + ["source"], registry=r)
        self._bytes = Counter("k3serve:kv_transfer_bytes",
                              "Cache bytes written to decode workers.", lab, registry=r)
        self._seconds = Histogram(
            "k3serve:kv_transfer_seconds", "Cache transfer time, admission to completion.",
            lab, registry=r,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                     10.0, 30.0, 60.0))
        self._write_bytes = Counter("k3serve:kv_transfer_write_bytes",
                                    "Bytes of successful transfers (prefill side).", lab,
                                    registry=r)
        self._write_seconds = Counter(
            "k3serve:kv_transfer_write_seconds",
            "Seconds from each successful transfer's last layer ready to its last write "
            "confirmed, summed.", lab, registry=r)
        self._snapshots = Gauge("k3serve:kda_snapshots", "KDA snapshots held.", lab, registry=r)
        self._usage = Gauge("k3serve:cache_usage_ratio", "Referenced cache pages / all pages.",
                            lab, registry=r)
        self._running = Gauge("k3serve:num_requests_running", "Requests running.", lab,
                              registry=r)
        self._waiting = Gauge("k3serve:num_requests_waiting",
                              "Requests waiting (queued, or waiting for their cache).", lab,
                              registry=r)
        self._fallbacks = Counter("k3serve:kv_transfer_fallbacks",
                                  "Failed transfers recomputed by the decode worker.", lab,
                                  registry=r)
        self._transfers = Counter("k3serve:kv_transfers", "Finished transfers by outcome.",
                                  lab + ["outcome"], registry=r)
        self._expiries = Counter("k3serve:kv_transfer_expiries",
                                 "Transfers that did not complete before their deadline.", lab,
                                 registry=r)
        self._faults = Counter("k3serve:kv_faults_injected",
                               "Transfer faults injected by K3SERVE_KV_FAULT_*_FRACTION.",
                               lab + ["kind"], registry=r)
        self._resumed = Counter("k3serve:requests_resumed",
                                "Requests resumed here after their decode worker failed "
                                "mid-stream (request migration).", lab, registry=r)
        self._shed = Counter("k3serve:requests_shed",
                             "Admissions refused with 503 busy + Retry-After: the worker's "
                             "queue (--max-queued) was full.", lab, registry=r)
        self._spec = {k: Counter(f"k3serve:spec_{k}", doc, lab, registry=r) for k, doc in (
            ("proposed_tokens", "Speculative tokens proposed (and verified)."),
            ("accepted_tokens", "Speculative tokens the target accepted."),
            ("emitted_tokens", "Tokens speculative verify steps appended."),
            ("verify_rows", "Sequence-steps verified speculatively."),
            ("verify_steps", "Speculative verify forwards."))}
        self._spec_pos = Counter("k3serve:spec_accepted_tokens_per_position",
                                 "Verified rows whose proposal at this position (0-based) "
                                 "was accepted.", lab + ["position"], registry=r)
        self._spec_rate = Gauge("k3serve:spec_acceptance_rate",
                                "Speculative tokens accepted / proposed, since start.", lab,
                                registry=r)
        self._spec_len = Gauge("k3serve:spec_mean_accepted_length",
                               "Tokens emitted per speculative sequence-step, since start.", lab,
                               registry=r)
        self._spec_seen: dict[str, float] = {}
        for fam in (self._queries, self._bytes, self._write_bytes, self._write_seconds,
                    self._fallbacks, self._expiries, self._resumed,
                    self._shed):
            fam.labels(**self.labels)
        for src in ("local", "store"):
            self._hits.labels(**self.labels, source=src)
        for oc in ("success", "failed"):
            self._transfers.labels(**self.labels, outcome=oc)
        self._seconds.labels(**self.labels)

    def add_expert_load(self, model: object) -> None:
        """Export the expert load counters of ``model`` (rank 0's ``K3ForCausalLM``; every
        rank routes every token, so rank 0 counts the instance's load) as
        ``k3serve:expert_routed_tokens_total{worker,role,layer,expert}``, read at scrape time
        (``k3serve.parallel.counters.ExpertLoadCollector``). A model without MoE layers adds
        no samples."""
        from k3serve.parallel.counters import ExpertLoadCollector, expert_load

        self.registry.register(ExpertLoadCollector(lambda: expert_load(model), self.labels))

    def prefix_query(self, prompt_tokens: int, cached_tokens: int, source: str = "local") -> None:
        self._queries.labels(**self.labels).inc(prompt_tokens)
        self._hits.labels(**self.labels, source=source).inc(cached_tokens)

    def transfer(self, ok: bool, nbytes: int, seconds: float | None,
                 write_tail_s: float | None = None) -> None:
        """A finished transfer: ``nbytes`` sent, ``seconds`` from admission to done, and
        ``write_tail_s`` from its last layer ready to its last write confirmed."""
        self._bytes.labels(**self.labels).inc(nbytes)
        self._transfers.labels(**self.labels, outcome="success" if ok else "failed").inc()
        if ok and seconds is not None:
            self._seconds.labels(**self.labels).observe(seconds)
        if ok and write_tail_s is not None:
            self._write_bytes.labels(**self.labels).inc(nbytes)
            self._write_seconds.labels(**self.labels).inc(write_tail_s)

    def fallback(self) -> None:
        self._fallbacks.labels(**self.labels).inc()

    def expiry(self) -> None:
        """A transfer ticket (decode) or sender (prefill) reached its deadline."""
        self._expiries.labels(**self.labels).inc()

    def fault(self, kind: str) -> None:
        """A transfer fault was injected (``fail`` or ``hang``)."""
        self._faults.labels(**self.labels, kind=kind).inc()

    def resumed(self) -> None:
        """A migrated request was resumed here."""
        self._resumed.labels(**self.labels).inc()

    def shed(self) -> None:
        """An admission was refused: the queue was full."""
        self._shed.labels(**self.labels).inc()

    def set_gauges(self, g: dict[str, float]) -> None:
        if "spec_proposed_tokens" in g:  # cumulative engine counters → counter increments
            for k, fam in self._spec.items():
                v = g[f"spec_{k}"]
                fam.labels(**self.labels).inc(max(0.0, v - self._spec_seen.get(k, 0.0)))
                self._spec_seen[k] = v
            j = 0
            while f"spec_accepted_position_{j}" in g:
                key = f"spec_accepted_position_{j}"
                self._spec_pos.labels(**self.labels, position=str(j)).inc(
                    max(0.0, g[key] - self._spec_seen.get(key, 0.0)))
                self._spec_seen[key] = g[key]
                j += 1
            p, rows = g["spec_proposed_tokens"], g["spec_verify_rows"]
            self._spec_rate.labels(**self.labels).set(
                g["spec_accepted_tokens"] / p if p else 0.0)
            self._spec_len.labels(**self.labels).set(
                g["spec_emitted_tokens"] / rows if rows else 0.0)
        self._snapshots.labels(**self.labels).set(g["kda_snapshots"])
        self._usage.labels(**self.labels).set(g["cache_usage_ratio"])
        self._running.labels(**self.labels).set(g["num_requests_running"])
        self._waiting.labels(**self.labels).set(g["num_requests_waiting"])

    def render(self) -> tuple[bytes, str]:
        """``(body, content type)``: the families above, without prometheus-client's
        ``*_created`` timestamp series (DESIGN.md §6 names only, as the router does)."""
        return render(self.registry)


__all__ = ["WorkerMetrics"]
