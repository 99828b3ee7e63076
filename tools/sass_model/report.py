"""Writing sass-model.json and sass-model.md (Markdown tables).

Rows of kind "prefill" (predicted_tensor_fraction, the fraction of the dense 16-bit tensor
peak) get tables of their own; rows without a kind (files written before prefill rows existed,
merged with ``--include``) are drafter rows.
"""

from __future__ import annotations

import json
from pathlib import Path

from . import hardware, pipes

TITLE = (
    "Static SASS model: PREDICTED fraction of HBM bandwidth (drafters) and of the dense 16-bit "
    "tensor peak (prefill) (a model, not a measurement)"
)


def _kind(row: dict) -> str:
    return row.get("kind", "drafter")


def _build(row: dict) -> str:
    return row["kernel"][1 : row["kernel"].index("]")] if row["kernel"].startswith("[") else ""


def write_json(path: Path, rows: list[dict], tile_facts: dict[str, str]) -> None:
    assumptions = {**hardware.assumptions(), "tile_facts": tile_facts}
    path.write_text(json.dumps({"assumptions": assumptions, "rows": rows}, indent=1))


def _short(kernel: str) -> str:
    """``[label] void ns::name<args>(params)`` -> ``[label] name<args>`` for the table."""
    label = ""
    if kernel.startswith("["):
        label, _, kernel = kernel.partition("] ")
        label += "] "
    head, sep, args = kernel.removeprefix("void ").split("(")[0].strip().partition("<")
    return label + head.split("::")[-1] + sep + args


def summary(rows: list[dict], head_dim: int = 128, q_dtype: str = "bfloat16") -> str:
    """PREDICTED HBM fraction per (build, family, GPU) for one head_dim / query dtype over e4m3,
    R = 32 / 64 / 128 across: the headline table (README, top of sass-model.md)."""
    cells: dict[tuple[str, str, str], dict[int, str]] = {}
    for r in rows:
        if (r["head_dim"], r["q_dtype"], r["cache_dtype"]) != (head_dim, q_dtype, "float8_e4m3fn"):
            continue
        if _kind(r) != "drafter":
            continue
        key = (_build(r), r["family"], f"{r['gpu']} ({r['arch']})")
        cells.setdefault(key, {})[r["rows_per_kv_head"]] = (
            f"{100 * r['predicted_hbm_fraction']:.0f}% ({r['binding']})"
        )
    lines = [
        f"PREDICTED fraction of HBM bandwidth (binding constraint), head_dim {head_dim}, e4m3 "
        f"cache, {q_dtype} query, R = query rows per KV head:",
        "",
        "| build | family | GPU (cubin) | R=32 | R=64 | R=128 |",
        "|---|---|---|---|---|---|",
    ]
    for (build, family, gpu), by_rows in sorted(cells.items()):
        got = [by_rows.get(r, "-") for r in (32, 64, 128)]
        lines.append(f"| {build or '-'} | {family} | {gpu} | " + " | ".join(got) + " |")
    return "\n".join(lines) + "\n"


def prefill_summary(rows: list[dict]) -> str:
    """PREDICTED fraction of the dense 16-bit tensor peak per (build, family, GPU) for the
    non-causal prefill rows, one column per length (q = kv); empty without prefill rows."""
    cells: dict[tuple[str, str, str], dict[int, str]] = {}
    for r in rows:
        if _kind(r) == "prefill":
            key = (_build(r), r["family"], f"{r['gpu']} ({r['arch']})")
            cells.setdefault(key, {})[r["q_len"]] = (
                f"{100 * r['predicted_tensor_fraction']:.0f}% ({r['binding']})"
            )
    if not cells:
        return ""
    lengths = sorted({length for by_len in cells.values() for length in by_len})
    lines = [
        "PREDICTED fraction of the dense 16-bit tensor peak (binding constraint), non-causal "
        "prefill q = kv, head_dim 128, e4m3 cache, bfloat16 query, 32 query / 8 KV heads "
        "(FLOPs from the mask, 4 x q x kv x head_dim x heads; HBM and L2 not modelled):",
        "",
        "| build | family | GPU (cubin) | " + " | ".join(f"q=kv={n}" for n in lengths) + " |",
        "|---|---|---|" + "---|" * len(lengths),
    ]
    for (build, family, gpu), by_len in sorted(cells.items()):
        got = [by_len.get(n, "-") for n in lengths]
        lines.append(f"| {build or '-'} | {family} | {gpu} | " + " | ".join(got) + " |")
    return "\n".join(lines) + "\n"


def _detail_table(
    rows: list[dict], shape_columns: dict[str, str], fraction_key: str, fraction_header: str
) -> list[str]:
    """One Markdown row per modelled row: GPU, kernel, the shape (``shape_columns``: header ->
    row key), tiles, per-pipe work per KV byte, binding and the predicted fraction."""
    columns = ["GPU", "arch", "family", "kernel", *shape_columns, "regs", "smem B", "CTAs/SM"]
    columns += [f"{p} instr/B" for p in pipes.PIPES] + ["binding", fraction_header]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        cells = [r["gpu"], r["arch"], r["family"], _short(r["kernel"])]
        cells += [r[key] for key in shape_columns.values()]
        cells += [r["regs"], r["smem_bytes"], r["ctas_per_sm"]]
        cells += [f"{r['instr_per_kv_byte'][p]:.3f}" for p in pipes.PIPES]
        cells += [r["binding"], f"{100 * r[fraction_key]:.0f}% (predicted)"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return lines


_SHAPE = {"D": "head_dim", "q": "q_dtype", "kv": "cache_dtype", "R": "rows_per_kv_head"}


def _prefill_table(rows: list[dict]) -> list[str]:
    """Every prefill row: tiles, per-pipe work per KV byte, binding, tensor-peak fraction."""
    prefill = sorted(
        (r for r in rows if _kind(r) == "prefill"),
        key=lambda r: (_build(r), r["family"], r["gpu"], r["q_len"]),
    )
    if not prefill:
        return []
    heading = ["", "Prefill shapes (non-causal, q = kv; R = 4 x q rows per KV head):", ""]
    return heading + _detail_table(
        prefill, {"q=kv": "q_len", **_SHAPE}, "predicted_tensor_fraction",
        "predicted fraction of dense 16-bit tensor peak",
    )  # fmt: skip


def markdown(rows: list[dict]) -> str:
    lines = [
        f"# {TITLE}",
        "",
        "Every figure below is a PREDICTION of `python -m tools.sass_model` from the compiled",
        "SASS (issue-slot model, assumptions and their sources in `sass-model.json` and",
        "`tools/sass_model/hardware.py`); nothing here was measured on a GPU.",
        "`instr/B` is warp-instructions per KV byte, summed over every warp of a CTA.",
        "Drafter rows (`kind` drafter) predict a fraction of HBM bandwidth. Prefill rows (`kind`",
        "prefill: non-causal q = kv, with `q_len`, `kv_len`) are compute-bound and predict",
        "`predicted_tensor_fraction`, the fraction of the GPU's dense 16-bit tensor peak",
        "(`dense_16bit_flops`, datasheet) the slowest compute constraint allows, FLOPs from the",
        "mask (4 x q x kv x head_dim x query heads); memory is not modelled for them.",
        "",
        summary(rows),
        prefill_summary(rows),
        "All drafter shapes:",
        "",
    ]
    order = sorted(
        (r for r in rows if _kind(r) == "drafter"),
        key=lambda r: (r["kernel"].partition("]")[0], r["family"], r["gpu"], r["head_dim"],
                       r["q_dtype"], r["cache_dtype"], r["rows_per_kv_head"]),
    )  # fmt: skip
    lines += _detail_table(order, _SHAPE, "predicted_hbm_fraction", "predicted HBM fraction")
    return "\n".join(lines + _prefill_table(rows)) + "\n"


def write(
    out_dir: str | Path, rows: list[dict], tile_facts: dict[str, str] | None = None
) -> tuple[Path, Path]:
    """Writes DIR/sass-model.json and DIR/sass-model.md; ``tile_facts`` names, per modelled
    build, where its tile facts came from (recorded with the assumptions)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / "sass-model.json", out / "sass-model.md"
    write_json(json_path, rows, tile_facts or {})
    md_path.write_text(markdown(rows))
    return json_path, md_path
