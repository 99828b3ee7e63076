"""Writers: the JSON result file, a Markdown summary and PNG plots (matplotlib)."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on the benchmark machines
import matplotlib.pyplot as plt  # noqa: E402 (the backend must be chosen first)

from .accuracy import FP8_QUERY_ROUTES, best_fp8_query_errors  # noqa: E402

SHAPE_KEYS = (
    "kind",
    "batch",
    "q_len",
    "kv_len",
    "num_q_heads",
    "num_kv_heads",
    "head_dim",
    "causal",
    "kv_cache_dtype",
    "query_dtype",
    "block_size",
    "window",
    "sinks",
)
MAX_PANELS = 4
# The prefill goal: >= 60% of the dense 16-bit tensor peak (stated for the SASS model's
# prediction; a measured row is reported against the same figure).
PREFILL_PEAK_GOAL = 0.6


def _shape_key(row: dict, leave_out: str = "") -> tuple:
    """The row's shape fields as a hashable key (JSON gives the window as a list)."""
    return tuple(
        tuple(row[k]) if isinstance(row[k], list) else row[k] for k in SHAPE_KEYS if k != leave_out
    )


def shape_label(row: dict) -> str:
    mask = "causal" if row["causal"] else "bidir"
    if tuple(row["window"]) != (-1, -1):
        mask += f" window{row['window'][0]},{row['window'][1]}"
    if row["sinks"]:
        mask += " sinks"
    return (
        f"{row['kind']} b{row['batch']} q{row['q_len']} kv{row['kv_len']} "
        f"{row['num_q_heads']}/{row['num_kv_heads']}x{row['head_dim']} {mask} "
        f"{row['kv_cache_dtype']}"
    )


def write_json(path: Path, payload: dict) -> None:
    path.write_text(json.dumps(payload, indent=1) + "\n")


def fmt(value: object, digits: int = 3) -> str:
    """A table cell: floats to ``digits`` significant digits, None as '-'."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def write_markdown(path: Path, payload: dict) -> None:
    """Tables of the rows (grouped by shape), skips, backends and the accuracy study."""
    lines = [f"# Paged attention benchmark: {payload['gpu']}, {payload['date']}", ""]
    lines.append(f"Command: `{payload['command']}`. {payload['timing_note']}")
    lines.append(f"Bytes: {payload['bytes_note']}.")
    if not payload["complete"]:
        lines.append("**Incomplete: the run was cut off; these are the shapes it finished.**")
    environment = ", ".join(f"{key} {value}" for key, value in payload["environment"].items())
    lines.append(f"Environment: {environment}.")
    copy_bw = payload["copy_bw_gbps"]
    if copy_bw is not None:
        lines.append(
            f"Device-to-device copy bandwidth measured in the same run: {copy_bw:.0f} GB/s "
            "(bytes read + written)."
        )
    peak = payload["dense_16bit_tflops"]
    if peak is not None:
        lines.append(
            f"Dense 16-bit tensor peak of this GPU: {peak:.0f} TFLOP/s "
            f"({payload['dense_16bit_source']})."
        )
    lines += [
        "",
        "Each row is set against its yardstick: a drafter (memory-bound) against the copy "
        "bandwidth, a prefill (compute-bound) against the dense 16-bit tensor peak with FLOPs "
        "from the mask (non-causal: 4 x q x kv x head_dim x query heads).",
        "",
        "| shape | backend | median us | GB/s | % copy BW | TFLOP/s | % 16-bit tensor peak | "
        "rel_err | timing | speedup over peers |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in payload["rows"]:
        speedups = ", ".join(f"{peer} {x:.2f}x" for peer, x in row["speedup"].items())
        copy_frac, peak_frac = yardstick_fractions(row)
        lines.append(
            f"| {shape_label(row)} | {row['backend']} | {row['median_us']:.1f} | "
            f"{row['gbps']:.0f} | {fmt(copy_frac)} | {row['tflops']:.2f} | {fmt(peak_frac)} | "
            f"{fmt(row['rel_err'])} | {row['timing_method']} | {speedups or '-'} |"
        )
    lines += ["", "## Goals (reported, not asserted)", ""]
    lines += [f"- {line}" for line in goals(payload)] or ["- nothing to report"]
    lines += ["", "## Backends", "", "| backend | status | what it is given and runs |"]
    lines.append("|---|---|---|")
    for name, info in payload["backends"].items():
        lines.append(f"| {name} | {info['status']} | {info['note']} |")
    if payload["skipped"]:
        lines += [
            "",
            "## Skipped on some shapes",
            "",
            "| shape | backend | reason |",
            "|---|---|---|",
        ]
        for skip in payload["skipped"]:
            lines.append(f"| {shape_label(skip)} | {skip['backend']} | {skip['reason']} |")
    lines += _accuracy_table(payload["accuracy"])
    path.write_text("\n".join(lines) + "\n")


def yardstick_fractions(row: dict) -> tuple[float | None, float | None]:
    """(% of copy bandwidth, % of the dense 16-bit tensor peak) of a row, only the one that is
    its yardstick given (the tensor peak for a prefill, the bandwidth otherwise)."""
    if row["kind"] == "prefill":
        frac = row["frac_of_tensor_peak"]
        return None, None if frac is None else 100 * frac
    frac = row["frac_of_copy_bw"]
    return None if frac is None else 100 * frac, None


def goals(payload: dict) -> list[str]:
    """The issue's goals, reported (not asserted), one line per backend of ours and goal
    (the speed goals only where the timings mean something)."""
    lines = []
    timed = payload["timings_meaningful"]
    ours = sorted({r["backend"] for r in payload["rows"] if r["speedup"]}) if timed else []
    for backend in ours:
        mine = [r for r in payload["rows"] if r["backend"] == backend and r["kind"] == "drafter"]
        fracs = [r["frac_of_copy_bw"] for r in mine if r["frac_of_copy_bw"] is not None]
        if fracs:
            met = sum(f >= 0.9 for f in fracs)
            lines.append(
                f"{backend}: >= 90% of copy bandwidth on {met}/{len(fracs)} drafter rows "
                f"(min {min(fracs):.0%}, max {max(fracs):.0%})"
            )
        over_vllm = [
            r["speedup"]["vllm_triton_unified"]
            for r in mine
            if "vllm_triton_unified" in r["speedup"]
        ]
        if over_vllm:
            met = sum(x >= 2 for x in over_vllm)
            lines.append(
                f"{backend}: >= 2x vllm_triton_unified on {met}/{len(over_vllm)} drafter rows "
                f"(min {min(over_vllm):.2f}x, max {max(over_vllm):.2f}x)"
            )
    lines += _window_goals(payload, ours)
    lines += _prefill_goals(payload, ours)
    fp8_route = best_fp8_query_errors(payload["accuracy"])
    for entry in payload["accuracy"]:
        if entry["route"] not in FP8_QUERY_ROUTES and entry["rel_err"] is not None:
            ratio = entry["rel_err"] / fp8_route[entry["kv_len"]]
            verdict = "met" if ratio <= 0.5 else "NOT met"
            lines.append(
                f"{entry['backend']} kv{entry['kv_len']}: error {ratio:.3f}x the better "
                f"FP8-query route's (goal <= 0.5x: {verdict})"
            )
    return lines


def _window_goals(payload: dict, ours: list[str]) -> list[str]:
    """A windowed row's time must follow the window, not the context. Its time is
    set against the least time reading the whole context could take at copy bandwidth."""
    copy_bw = payload["copy_bw_gbps"]
    lines = []
    for row in payload["rows"]:
        if row["backend"] not in ours or tuple(row["window"]) == (-1, -1) or copy_bw is None:
            continue
        context_us = row["context_bytes"] / (copy_bw * 1e9) * 1e6
        verdict = "met" if row["median_us"] < context_us else "NOT met"
        lines.append(
            f"{row['backend']} {shape_label(row)}: {row['median_us']:.1f} us, "
            f"{row['frac_of_copy_bw']:.0%} of copy bandwidth counted from the pages the window "
            f"touches; reading the whole context would take >= {context_us:.1f} us at copy "
            f"bandwidth (time follows the window: {verdict})"
        )
    return lines


def _prefill_goals(payload: dict, ours: list[str]) -> list[str]:
    """A long non-causal prefill is compute-bound, so each prefill row of ours is
    set against the GPU's dense 16-bit tensor peak (FLOPs from the mask), with the best peer's
    fraction on the same shape beside it."""
    lines = []
    for row in payload["rows"]:
        if row["backend"] not in ours or row["kind"] != "prefill":
            continue
        head = f"{row['backend']} {shape_label(row)}: {row['tflops']:.0f} TFLOP/s"
        if row["frac_of_tensor_peak"] is None:
            lines.append(
                f"{head}; no dense 16-bit tensor peak on record for {payload['gpu']} "
                "(tools/sass_model/hardware.py), so no fraction of it"
            )
            continue
        peers = [
            (other["frac_of_tensor_peak"], other["backend"])
            for other in payload["rows"]
            if other["backend"] in row["speedup"] and _shape_key(other) == _shape_key(row)
        ]
        best = f"; best peer {max(peers)[1]} {max(peers)[0]:.0%}" if peers else ""
        met = "met" if row["frac_of_tensor_peak"] >= PREFILL_PEAK_GOAL else "NOT met"
        lines.append(
            f"{head} = {row['frac_of_tensor_peak']:.0%} of the dense 16-bit tensor peak "
            f"({payload['dense_16bit_tflops']:.0f} TFLOP/s; FLOPs from the mask, non-causal "
            f"4 x q x kv x head_dim x heads){best} (goal >= {PREFILL_PEAK_GOAL:.0%}: {met}; a "
            "prefill is compute-bound, so HBM bandwidth is not its yardstick)"
        )
    return lines


def _accuracy_table(entries: list[dict]) -> list[str]:
    if not entries:
        return []
    columns = sorted({(e["route"], e["backend"]) for e in entries})
    by_shape: dict[tuple, dict] = defaultdict(dict)
    for entry in entries:
        key = _shape_key(entry)
        by_shape[key][(entry["route"], entry["backend"])] = entry["rel_err"]
    lines = [
        "",
        "## Accuracy: relative error against float64 on the same FP8 cache",
        "",
        "| shape | " + " | ".join(f"{route} ({backend})" for route, backend in columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    for key, errors in by_shape.items():
        cells = " | ".join(fmt(errors.get(column), 3) for column in columns)
        lines.append(f"| {shape_label(dict(zip(SHAPE_KEYS, key, strict=True)))} | {cells} |")
    return lines


def _sweep_groups(rows: list[dict]) -> list[tuple[tuple, list[dict]]]:
    """Rows grouped by everything but kv_len and backend; the groups with most kv_lens first."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for row in rows:
        groups[_shape_key(row, leave_out="kv_len")].append(row)

    def breadth(item: tuple[tuple, list[dict]]) -> int:
        return len({row["kv_len"] for row in item[1]})

    return sorted(groups.items(), key=breadth, reverse=True)[:MAX_PANELS]


def plot_bandwidth(path: Path, payload: dict) -> None:
    """GB/s against kv_len, one line per backend, with the measured copy bandwidth."""
    groups = _sweep_groups(payload["rows"])
    fig, axes = plt.subplots(1, max(1, len(groups)), figsize=(6 * max(1, len(groups)), 4.5))
    axes = [axes] if not hasattr(axes, "__len__") else list(axes)
    for ax, (_, rows) in zip(axes, groups, strict=False):
        by_backend: dict[str, list[dict]] = defaultdict(list)
        for row in rows:
            by_backend[row["backend"]].append(row)
        for backend, points in sorted(by_backend.items()):
            points.sort(key=lambda r: r["kv_len"])
            ax.plot([r["kv_len"] for r in points], [r["gbps"] for r in points], "o-", label=backend)
        if payload["copy_bw_gbps"] is not None:
            ax.axhline(payload["copy_bw_gbps"], color="k", linestyle="--", label="copy bandwidth")
        label = shape_label(rows[0]).replace(f" kv{rows[0]['kv_len']}", "")
        ax.set(xscale="log", xlabel="kv_len", ylabel="GB/s (problem bytes / time)", title=label)
        ax.legend(fontsize=8)
    if not groups:
        axes[0].text(0.5, 0.5, "no rows measured", ha="center", va="center")
    fig.suptitle(f"{payload['gpu']} {payload['date']}: {payload['timing_note']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_speedup(path: Path, payload: dict) -> None:
    """Speedup of each of our backends over each peer, per shape, against kv_len.

    Colour: the peer; marker: our backend and cache dtype.
    """
    fig, ax = plt.subplots(figsize=(8, 5))
    series: dict[tuple[str, str], list[tuple[int, float]]] = defaultdict(list)
    for row in payload["rows"]:
        for peer, speedup in row["speedup"].items():
            series[(peer, f"{row['backend']} {row['kv_cache_dtype']}")].append(
                (row["kv_len"], speedup)
            )
    peers = sorted({peer for peer, _ in series})
    ours = sorted({mine for _, mine in series})
    markers = "os^vDP*X"
    for (peer, mine), points in sorted(series.items()):
        ax.scatter(
            [p[0] for p in points],
            [p[1] for p in points],
            color=plt.cm.tab10(peers.index(peer) % 10),
            marker=markers[ours.index(mine) % len(markers)],
            label=f"{mine} over {peer}",
            s=22,
        )
    ax.axhline(1.0, color="k", linewidth=0.8)
    if series:
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no peer measured", ha="center", va="center", transform=ax.transAxes)
    ax.set(xscale="log", yscale="log", xlabel="kv_len", ylabel="speedup (peer time / our time)")
    ax.set_title(f"{payload['gpu']} {payload['date']}: {payload['timing_note']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_tables(out_dir: Path, stem: str, payload: dict) -> list[Path]:
    """Write ``stem``.json and ``stem``.md (cheap: rewritten after every shape)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{stem}.json", out_dir / f"{stem}.md"]
    write_json(paths[0], payload)
    write_markdown(paths[1], payload)
    return paths


def write_all(out_dir: Path, stem: str, payload: dict) -> list[Path]:
    """Write ``stem``.json, ``stem``.md, ``stem``-gbps.png and ``stem``-speedup.png."""
    paths = write_tables(out_dir, stem, payload)
    paths += [out_dir / f"{stem}-gbps.png", out_dir / f"{stem}-speedup.png"]
    plot_bandwidth(paths[2], payload)
    plot_speedup(paths[3], payload)
    return paths
