"""PNGs of a run: TTFT and ITL CDFs, hit rate over time against the oracle, queue depth."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from cli.bench.client import RunOutcome


def _cdf(ax, xs: list[float], label: str) -> None:
    if xs:
        s = np.sort(np.asarray(xs))
        ax.step(s * 1000.0, np.arange(1, len(s) + 1) / len(s), where="post", label=label)


def hit_rate_series(run: RunOutcome, oracle: bool = True
                    ) -> list[tuple[str, list[float], np.ndarray]]:
    """The lines of ``hit_rate.png``: ``(label, time since start s, cumulative hit rate %)``
    over the finished requests by first-token time — the actual one, then the trace's token
    oracle when ``oracle`` (a random load has none, and its summary says n/a)."""
    ok = sorted((x for x in run.results if x.ok), key=lambda x: x.first_s)
    if not ok:
        return []
    t = [x.first_s for x in ok]
    p = np.cumsum([x.prompt_tokens for x in ok])
    out = [("actual (cached_tokens)", t, 100 * np.cumsum([x.cached_tokens for x in ok]) / p)]
    if oracle:
        out.append(("token oracle (infinite cache)", t,
                    100 * np.cumsum([x.oracle_cached for x in ok]) / p))
    return out


def write_plots(run: RunOutcome, out_dir: str | Path, title: str = "k3serve bench",
                others: dict[str, RunOutcome] | None = None,
                label: str = "this run", oracle: bool = True) -> list[Path]:
    """Write ``ttft_cdf.png``, ``itl_cdf.png``, ``hit_rate.png``, ``queue_depth.png`` into
    ``out_dir`` (created); ``others``: more runs drawn on the CDFs beside this one; ``oracle``:
    draw the trace's token oracle on the hit-rate plot (a random load has none).

    Returns:
        The files written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    runs = {label: run, **(others or {})} if others else {"": run}
    files = []
    for name, fn, xlabel in (
            ("ttft_cdf.png", lambda r: [x.ttft for x in r.results if x.ok],
             "time to first token (ms)"),
            ("itl_cdf.png", lambda r: [g for x in r.results if x.ok for g in x.itls],
             "inter-token latency (ms)")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for name_of_run, r in runs.items():
            _cdf(ax, fn(r), name_of_run or None)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("fraction of " + ("requests" if "ttft" in name else "token gaps"))
        ax.set_title(f"{title}: {xlabel.split(' (')[0]} CDF")
        ax.grid(alpha=0.3)
        if len(runs) > 1:
            ax.legend()
        fig.tight_layout()
        fig.savefig(d / name, dpi=100)
        plt.close(fig)
        files.append(d / name)

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, t, pct in hit_rate_series(run, oracle):
        ax.plot(t, pct, "--" if name.startswith("token oracle") else "-", label=name)
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("cumulative token hit rate (%)")
    ax.set_ylim(0, 100)
    ax.set_title(f"{title}: hit rate over time")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(d / "hit_rate.png", dpi=100)
    plt.close(fig)
    files.append(d / "hit_rate.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    if run.queue:
        q = np.asarray(run.queue)
        ax.plot(q[:, 0], q[:, 1], label="waiting for token #1 (router gauge)")
        ax.plot(q[:, 0], q[:, 2], label="streaming (router gauge)")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("requests")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))  # request counts: whole ticks
    ax.set_title(f"{title}: queue depth over time")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(d / "queue_depth.png", dpi=100)
    plt.close(fig)
    files.append(d / "queue_depth.png")
    return files


__all__ = ["hit_rate_series", "write_plots"]
