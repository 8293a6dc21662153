"""`--plot FILE.png` for the benchmarks: what they measured, drawn with matplotlib (the `bench` extra)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def require_matplotlib() -> None:
    """Called when --plot is parsed, so a missing matplotlib stops a benchmark before it runs, not after."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'nanoserve[bench]'") from None


def _pyplot() -> Any:
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _log_axis(ax: Any, ticks: list[int], label: str) -> None:
    """A log x axis labelled with the values measured (1, 8, 32), not powers of ten."""
    ax.set(xscale="log", xlabel=label)
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    ax.grid(alpha=0.3)


def plot_throughput(path: str, batch_sizes: Sequence[int], medians: Mapping[str, Sequence[float]]) -> None:
    """Output tok/s against batch size, one line per system (NaN where it did not run that batch)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, values in medians.items():
        ax.plot(batch_sizes, values, marker="o", label=name)
    ax.set(ylabel="output tok/s (median)", title="Offline throughput")
    _log_axis(ax, list(batch_sizes), "batch size")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_serve(path: str, by_server: Mapping[str, Mapping[int, Any]]) -> None:
    """Per server (`LevelStats` by concurrency): output tok/s, TTFT and inter-token latency p50/p99."""
    plt = _pyplot()
    fig, (tput, ttft, itl) = plt.subplots(1, 3, figsize=(13, 4))
    for name, levels in by_server.items():
        concurrency = list(levels)
        stats = list(levels.values())
        (line,) = tput.plot(concurrency, [s.tok_s for s in stats], marker="o", label=name)
        for ax, p50, p99 in ((ttft, "ttft_p50", "ttft_p99"), (itl, "itl_p50", "itl_p99")):
            ax.plot(concurrency, [getattr(s, p50) for s in stats], marker="o", color=line.get_color())
            ax.plot(concurrency, [getattr(s, p99) for s in stats], ls="--", color=line.get_color())
    tput.set(ylabel="output tok/s", title="Throughput")
    ttft.set(ylabel="ms", title="Time to first token (p50, p99 dashed)")
    itl.set(ylabel="ms", title="Inter-token latency (p50, p99 dashed)")
    ticks = sorted({c for levels in by_server.values() for c in levels})
    for ax in (tput, ttft, itl):
        _log_axis(ax, ticks, "concurrent requests")
    tput.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
