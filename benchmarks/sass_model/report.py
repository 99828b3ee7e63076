"""Writing sass-model.json (the schema of issue 9) and sass-model.md (a Markdown table)."""

from __future__ import annotations

import json
from pathlib import Path

from . import hardware, pipes

TITLE = "Static SASS model: PREDICTED fraction of HBM bandwidth (a model, not a measurement)"


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
        if (r["head_dim"], r["q_dtype"], r["kv_dtype"]) != (head_dim, q_dtype, "float8_e4m3fn"):
            continue
        build = r["kernel"][1 : r["kernel"].index("]")] if r["kernel"].startswith("[") else ""
        key = (build, r["family"], f"{r['gpu']} ({r['arch']})")
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


def markdown(rows: list[dict]) -> str:
    lines = [
        f"# {TITLE}",
        "",
        "Every figure below is a PREDICTION of `python -m benchmarks.sass_model` from the compiled",
        "SASS (issue-slot model, assumptions and their sources in `sass-model.json` and",
        "`benchmarks/sass_model/hardware.py`); nothing here was measured on a GPU.",
        "`instr/B` is warp-instructions per KV byte, summed over every warp of a CTA.",
        "",
        summary(rows),
        "All shapes:",
        "",
        "| GPU | arch | family | kernel | D | q | kv | R | regs | smem B | CTAs/SM | "
        + " | ".join(f"{p} instr/B" for p in pipes.PIPES)
        + " | binding | predicted HBM fraction |",
        "|" + "---|" * (14 + len(pipes.PIPES)),
    ]
    order = sorted(
        rows,
        key=lambda r: (r["kernel"].partition("]")[0], r["family"], r["gpu"], r["head_dim"],
                       r["q_dtype"], r["kv_dtype"], r["rows_per_kv_head"]),
    )  # fmt: skip
    for r in order:
        per_pipe = " | ".join(f"{r['instr_per_kv_byte'][p]:.3f}" for p in pipes.PIPES)
        lines.append(
            f"| {r['gpu']} | {r['arch']} | {r['family']} | {_short(r['kernel'])} | "
            f"{r['head_dim']} | {r['q_dtype']} | {r['kv_dtype']} | {r['rows_per_kv_head']} | "
            f"{r['regs']} | {r['smem_bytes']} | {r['ctas_per_sm']} | {per_pipe} | "
            f"{r['binding']} | {100 * r['predicted_hbm_fraction']:.0f}% (predicted) |"
        )
    return "\n".join(lines) + "\n"


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
