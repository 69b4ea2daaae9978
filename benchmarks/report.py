"""BENCHMARKS.md, results JSON and PNG plots from the measurements."""

from __future__ import annotations

import json
from pathlib import Path

TARGETS = {
    "capacity_ratio": 1.3,
    "fraction_of_copy": 0.8,
    "torch_speedup": 5.0,
    "fp8_over_bf16": 1.2,
    "sparse_speedup_64k": 8.0,
    "decode_fraction": 0.3,
    "wide_over_narrow": 1.2,
}


def _ms(t: dict) -> str:
    return f"{t['median'] * 1e3:.3f} ({t['min'] * 1e3:.3f}-{t['max'] * 1e3:.3f})"


def _us(t: dict) -> str:
    return f"{t['median'] * 1e6:.1f} ({t['min'] * 1e6:.1f}-{t['max'] * 1e6:.1f})"


def _mark(ok: bool) -> str:
    return "met" if ok else "**missed**"


def plots(results: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    cap = results["capacity"]["rows"]
    fig, axes = plt.subplots(1, len(cap), figsize=(4.2 * len(cap), 3.4), sharey=True)
    for ax, (dtype, data) in zip(axes, cap.items(), strict=True):
        x = [2 ** p["log2_slots"] for p in data["points"]]
        for key, label in (("ours", "jax_sparse_kv"), ("plain", "plain .at[].set")):
            med = [p[key]["median"] * 1e6 for p in data["points"]]
            lo = [p[key]["min"] * 1e6 for p in data["points"]]
            hi = [p[key]["max"] * 1e6 for p in data["points"]]
            ax.loglog(x, med, "o-", label=label)
            ax.fill_between(x, lo, hi, alpha=0.2)
        ax.set_title(f"{dtype}: 64-token K+V write")
        ax.set_xlabel("capacity (slots)")
    axes[0].set_ylabel("time (us)")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(out / "capacity_scaling.png", dpi=110)
    files.append("capacity_scaling.png")

    att = results["decode_attention"]
    batches = sorted({r["batch"] for r in att["rows"]})
    fig, axes = plt.subplots(1, len(batches), figsize=(5.5 * len(batches), 3.6), squeeze=False)
    for ax, batch in zip(axes[0], batches, strict=True):
        rows = [r for r in att["rows"] if r["batch"] == batch]
        ctx = [r["context"] for r in rows]
        for key, label, style in (
            ("dense", "dense", "o-C0"),
            ("dense_prev", "dense, previous", "o:C0"),
            ("copy_dense", "NumPy copy of dense's bytes", "s--C7"),
            ("sparse", "sparse", "o-C1"),
            ("sparse_prev", "sparse, previous", "o:C1"),
            ("copy_sparse", "NumPy copy of sparse's bytes", "s--C2"),
        ):
            ax.loglog(ctx, [r["times"][key]["median"] * 1e3 for r in rows], style, label=label)
        ax.set_title(f"batch {batch}")
        ax.set_xlabel("cached tokens per sequence")
    axes[0][0].set_ylabel("one layer's decode attention (ms)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "attention.png", dpi=110)
    files.append("attention.png")

    step = results["model_step"]
    labels, values = ["NumPy copy\n(same bytes)"], [step["numpy_copy"]["time"]["median"] * 1e3]
    for name, v in step["variants"].items():
        labels.append(f"jax_sparse_kv\n{name}")
        values.append(v["time"]["median"] * 1e3)
    if step["torch"].get("available"):
        for name in ("bf16", "fp8_e4m3"):
            labels.append(f"PyTorch eager\n{name}")
            values.append(step["torch"][name]["time"]["median"] * 1e3)
    fig, ax = plt.subplots(figsize=(7.5, 3.4))
    ax.bar(labels, values, color=["grey"] + ["C0"] * 2 + ["C1"] * (len(values) - 3))
    ax.set_ylabel("ms per step (60 layers)")
    ax.set_title(f"model-sized decode write: {step['tokens']} tokens")
    fig.tight_layout()
    fig.savefig(out / "model_step.png", dpi=110)
    files.append("model_step.png")
    plt.close("all")
    return files


#: The standalone benchmarks whose reports (``benchmarks/results/NAME.md``) make BENCHMARKS.md's Scale section.
SCALE_REPORTS = ("scale", "host", "structured", "fp8_weights", "scale_analysis")


def scale_section(results_dir: Path) -> list[str]:
    """BENCHMARKS.md's Scale section: the standalone reports found in `results_dir`, headings one level down."""
    found = [results_dir / f"{name}.md" for name in SCALE_REPORTS if (results_dir / f"{name}.md").exists()]
    if not found:
        return []
    lines = [
        "## 8. Scale: the engine's step and host work at M3's sizes",
        "",
        "Standalone scripts (`python -m benchmarks.NAME`, each with its own reproducing command and machine "
        "below); their ratios are measured side by side within one run.",
        "",
    ]
    for path in found:
        for line in path.read_text().splitlines():
            lines.append("##" + line if line.startswith("#") else line)
        lines.append("")
    return lines


def markdown(
    results: dict,
    command: str,
    plot_dir: str,
    serving_lines: list[str] | None = None,
    scale_lines: list[str] | None = None,
) -> str:
    env = results["environment"]
    lines = [
        "# Benchmarks",
        "",
        f"Reproduce: `{command}` (a few minutes on 2 CPU cores; `--quick` is a smoke run).",
        "Every figure below comes from that one run; timings are medians with (min-max) over repeats,",
        "measured side by side in the same process. Nothing here is asserted by the tests.",
        "",
        f"- machine: {env['machine']}",
        f"- backend: {env['backend']} ({env['devices']}); JAX {env['jax']}, jaxlib {env['jaxlib']}, "
        f"NumPy {env['numpy']}, Python {env['python']}" + (f", PyTorch {env['torch']}" if env.get("torch") else ""),
        f"- date: {env['date']}",
    ]
    for name, env2 in results.get("environment_by_section", {}).items():
        lines.append(f"- section `{name}` rerun alone (`--sections {name}`) on {env2['date']}, {env2['machine']}")
    lines.append("")

    cap = results["capacity"]
    lines += [
        "## 1. Write cost vs capacity",
        "",
        f"{cap['tokens']} tokens of K and V ({cap['heads']} heads x {cap['dim']}, f32 input) into one layer, "
        "jitted with the buffers donated; `plain` is `buf.at[loc].set(x.astype(buf.dtype))` on an array of "
        "the pool dtype. Times in microseconds.",
        "",
        "| dtype | slots | jax_sparse_kv | plain |",
        "|---|---:|---:|---:|",
    ]
    for dtype, data in cap["rows"].items():
        for p in data["points"]:
            lines.append(f"| {dtype} | 2^{p['log2_slots']} | {_us(p['ours'])} | {_us(p['plain'])} |")
    lines += [
        "",
        "| dtype | t(max)/t(min) jax_sparse_kv | target <= 1.3 | t(max)/t(min) plain |",
        "|---|---:|---|---:|",
    ]
    for dtype, data in cap["rows"].items():
        ok = data["ours_ratio"] <= TARGETS["capacity_ratio"]
        lines.append(f"| {dtype} | {data['ours_ratio']:.2f} | {_mark(ok)} | {data['plain_ratio']:.1f} |")
    lines += ["", f"![capacity scaling]({plot_dir}/capacity_scaling.png)", ""]

    step = results["model_step"]
    copy = step["numpy_copy"]
    lines += [
        "## 2. Model-sized decode write",
        "",
        f"MiniMax-M3-like layout (60 layers: 0-2 dense, 3-59 sparse K-only; 4 KV heads x 128; index 1 x 128; "
        f"page 128; {step['slots']} slots), {step['tokens']} decode tokens at scattered slots, bf16 K/V input, "
        "all layers written in one jitted call with the cache donated. fp8 is scaled (scale 0.5).",
        "",
        "| what | ms per step | bytes written | GB/s | fraction of the copy |",
        "|---|---:|---:|---:|---:|",
        f"| NumPy copy of the same bytes (the limit) | {_ms(copy['time'])} | {copy['bytes']:,} | {copy['gbps']:.1f} | 1 |",
        f"| NumPy fancy-index writes, same rows and buffers (context) | {_ms(step['numpy_scattered']['time'])} | "
        f"{copy['bytes']:,} | {step['numpy_scattered']['gbps']:.1f} | {step['numpy_scattered']['gbps'] / copy['gbps']:.2f} |",
        f"| NumPy writes of the same rows into one contiguous array (context) | {_ms(step['numpy_contiguous_rows']['time'])} | "
        f"{copy['bytes']:,} | {step['numpy_contiguous_rows']['gbps']:.1f} | {step['numpy_contiguous_rows']['gbps'] / copy['gbps']:.2f} |",
    ]
    for name, v in step["variants"].items():
        lines.append(
            f"| jax_sparse_kv {name} | {_ms(v['time'])} | {v['bytes_written']:,} | {v['gbps']:.1f} | "
            f"{v['fraction_of_copy']:.2f} |"
        )
    lines.append(
        f"| jax_sparse_kv bf16, 1 token instead of {step['tokens']} (fixed cost of the 177 writes) | {_ms(step['bf16_one_token']['time'])} | | | |"
    )
    torch = step["torch"]
    if torch.get("available"):
        for name in ("bf16", "fp8_e4m3"):
            lines.append(
                f"| PyTorch {torch['version']} eager, SGLang-style per-layer writes, {name} | {_ms(torch[name]['time'])} | | | |"
            )
    lines += ["", "| target | value | |", "|---|---:|---|"]
    for name, v in step["variants"].items():
        lines.append(
            f"| {name}: fraction of NumPy copy >= 0.8 | {v['fraction_of_copy']:.2f} | {_mark(v['fraction_of_copy'] >= 0.8)} |"
        )
    if torch.get("available"):
        for name in ("bf16", "fp8_e4m3"):
            s = torch[name]["ours_speedup"]
            lines.append(
                f"| {name}: >= 5x faster than PyTorch eager | {s:.1f}x | {_mark(s >= TARGETS['torch_speedup'])} |"
            )
    else:
        lines.append(f"| PyTorch peer | not run: {torch['why']} | |")
    f = step["fp8_over_bf16"]
    lines.append(f"| t(fp8 step) / t(bf16 step) <= 1.2 | {f:.2f} | {_mark(f <= TARGETS['fp8_over_bf16'])} |")
    lines += ["", f"![model-sized step]({plot_dir}/model_step.png)", ""]

    comp = results["compilation"]
    lines += [
        "## 3. Compilation",
        "",
        "| what | value |",
        "|---|---:|",
        f"| compile the {comp['write_step_layers']}-layer write step | {comp['write_step_compile_s']:.2f} s |",
        f"| compile the demo model's decode step | {comp['decode_step_compile_s']:.2f} s |",
        f"| compilations over prefill + {comp['decode_steps']} decode steps | {comp['compilations']} "
        f"(one per shape: prefill, decode; target {comp['shapes']}: {_mark(comp['compilations'] == comp['shapes'])}) |",
        "",
    ]

    lines += _decode_attention_section(results["decode_attention"], plot_dir)

    e2e = results["end_to_end"]
    lines += [
        "## 5. End to end: the demo model",
        "",
        f"`python -m jax_sparse_kv demo`'s model, batch {e2e['batch']}, prompts of {e2e['prompt']} tokens, "
        f"{e2e['steps']} greedy decode steps (host sync each step), compile excluded.",
        "",
        "| cache | prefill tokens/s | decode tokens/s | ms per decode step |",
        "|---|---:|---:|---:|",
    ]
    for name, v in e2e["variants"].items():
        lines.append(
            f"| {name} | {v['prefill_tokens_per_s']:.0f} | {v['decode_tokens_per_s']:.0f} | {v['decode_ms_per_step']:.2f} |"
        )

    mem = results["memory"]
    lines += [
        "",
        "## 6. Memory",
        "",
        "Bytes per token for the MiniMax-M3-like layout (one device, all 60 layers; K-only layers store no index V):",
        "",
        "| dtype | main K | main V | index K (K-only) | index-KV K | index-KV V | total |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, bpt in mem.items():
        lines.append(
            f"| {name} | {bpt['k']:,} | {bpt['v']:,} | {bpt['index_k']:,} | {bpt['index_kv_k']:,} | "
            f"{bpt['index_kv_v']:,} | {sum(bpt.values()):,} |"
        )
    lines += [
        "",
        "`memory_analysis()` of the model-sized step (section 2):",
        "",
        "| dtype | temp bytes | bytes written | aliased (whole cache) |",
        "|---|---:|---:|---:|",
    ]
    for name, v in step["variants"].items():
        lines.append(
            f"| {name} | {v['temp_bytes']:,} | {v['bytes_written']:,} | {v['alias_bytes']:,} of {v['cache_bytes']:,} |"
        )
    if serving_lines:
        lines += ["", *serving_lines]
    if scale_lines:
        lines += ["", *scale_lines]
    lines += ["", results.get("analysis", ""), ""]
    return "\n".join(lines)


def _mb(n: int) -> str:
    return f"{n / 2**20:,.1f}"


def _decode_attention_section(att: dict, plot_dir: str) -> list[str]:
    f_target, w_target, s_target = (
        TARGETS["decode_fraction"],
        TARGETS["wide_over_narrow"],
        TARGETS["sparse_speedup_64k"],
    )
    lines = [
        "## 4. Decode attention vs the memory limit",
        "",
        f"One layer, one decode query per sequence: {att['q_heads']} query heads over {att['kv_heads']} KV heads x "
        f"{att['head_dim']}, bf16 pools (held as uint16, as the cache stores them), pages of {att['page_size']} at "
        f"shuffled page ids. Dense reads every live token; sparse = indexer ({att['index_heads']} heads x "
        f"{att['index_dim']} over all live index K) + top-{att['topk']} blocks of {att['block_size']} per index head + "
        "attention over those blocks (one KV head each). *Must read*: dense, K and V of every live token; sparse, "
        "index K of every live token plus K and V of the selected blocks. *The limit*: a NumPy copy of as many bytes. "
        "*Previous*: the first implementation (now `jax_sparse_kv.ops._reference`), which gathered the page "
        f"table's whole width in f32. All contenders of a row run in the same {att['rounds']} rounds, interleaved; "
        "times are medians (min-max) in ms; fraction = copy time / op time.",
        "",
        "| batch | tokens | layer | must read (MiB) | NumPy copy | ours | fraction of copy | previous | previous fraction | speed-up |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in att["rows"]:
        t = r["times"]
        for kind in ("dense", "sparse"):
            lines.append(
                f"| {r['batch']} | {r['context']:,} | {kind} | {_mb(r[kind + '_bytes'])} | {_ms(t['copy_' + kind])} | "
                f"{_ms(t[kind])} | **{r['fraction'][kind]:.2f}** | {_ms(t[kind + '_prev'])} | "
                f"{r['fraction'][kind + '_prev']:.3f} | {r['speedup'][kind]:.0f}x |"
            )
    lines += ["", f"![decode attention]({plot_dir}/attention.png)", "", "| target | value | |", "|---|---:|---|"]
    for r in att["rows"]:
        if r["context"] in (16384, 65536):
            for kind in ("dense", "sparse"):
                f = r["fraction"][kind]
                lines.append(
                    f"| {kind}, batch {r['batch']}, {r['context'] // 1024}K: >= {f_target} of the copy | {f:.2f} | "
                    f"{_mark(f >= f_target)} |"
                )
    for r in att["rows"]:
        if "wide_over_narrow" in r:
            for kind in ("dense", "sparse"):
                w = r["wide_over_narrow"][kind]
                lines.append(
                    f"| {kind}, batch {r['batch']}: {r['context']:,} tokens in a {att['wide']:,}-token-wide table / "
                    f"in a {r['context']:,}-wide one <= {w_target} | {w:.2f} (ours: "
                    f"{_ms(r['times'][kind + '_wide'])} vs {_ms(r['times'][kind])}) | {_mark(w <= w_target)} |"
                )
            if "dense_prev" in r["wide_over_narrow"]:
                lines.append(
                    f"| (previous, dense, batch {r['batch']}: same ratio) | {r['wide_over_narrow']['dense_prev']:.1f} | |"
                )
    for r in att["rows"]:
        if r["context"] == 65536:
            s = r["sparse_vs_dense"]
            lines.append(
                f"| batch {r['batch']}, 64K: sparse >= {s_target:.0f}x faster than dense | {s:.1f}x "
                f"(previous: {r['sparse_vs_dense_prev']:.1f}x) | {_mark(s >= s_target)} |"
            )
    m3 = att["m3"]
    lines += [
        "",
        f"**MiniMax-M3-shaped decode step** at {m3['context']:,} tokens: {m3['q_heads']} query heads, "
        f"{m3['kv_heads']} KV heads x {m3['head_dim']}, index {m3['index_heads']} x {m3['index_dim']}, blocks of "
        f"{m3['block_size']}, top-{m3['topk']} per index head. *Step*: one jitted call with the cache donated "
        "writes this step's K, V and index K into a bf16 `SparseKVCache`, scores index K, selects, and attends "
        "(attention only). *Model*: the same step through the `MiniMaxM3` module (one sparse layer at these "
        "shapes, hidden size 64, bf16 weights: projections, norms, RoPE, indexer, MLP, LM head; its must-read "
        "bytes include the weights). *Must read*: index K of every token plus the selected K/V blocks (plus the "
        "rows written). *Compute floor*: the step's unavoidable dots and softmax as plain f32 matmuls on "
        "operands already in place (no gather, no conversion); copy time / floor time is the most this CPU's "
        "arithmetic allows.",
        "",
        "| batch | must read (MiB) | NumPy copy | step | fraction | model | model fraction | compute floor "
        "(GFLOP/s) | floor allows | previous | speed-up |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in m3["rows"]:
        t = r["times"]
        model = (
            (
                f"{_ms(t['model'])} | **{r['fraction_model']:.2f}**",
                f"{_ms(t['floor'])} ({r['gflops_floor']:.0f})",
                f"{r['fraction_floor']:.2f}",
            )
            if "model" in t
            else ("- | -", "-", "-")
        )
        lines.append(
            f"| {r['batch']} | {_mb(r['must_read_bytes'] + r['written_bytes'])} | {_ms(t['copy'])} | "
            f"{_ms(t['step'])} | **{r['fraction']:.2f}** | {model[0]} | {model[1]} | {model[2]} | "
            f"{_ms(t['step_prev'])} | {r['speedup']:.0f}x |"
        )
    lines.append("")
    return lines


def write(results: dict, out_dir: Path, command: str, serving_lines: list[str] | None = None) -> Path:
    """BENCHMARKS.md, results.json and the plots under `out_dir`; `serving_lines`: the serving section
    (`benchmarks.serving.report_lines`), the Scale section from the standalone reports beside results.json."""
    out_dir.mkdir(parents=True, exist_ok=True)
    plot_dir = out_dir / "benchmarks" / "results"
    plot_dir.mkdir(parents=True, exist_ok=True)
    plots(results, plot_dir)
    (plot_dir / "results.json").write_text(json.dumps(results, indent=1))
    md = out_dir / "BENCHMARKS.md"
    md.write_text(markdown(results, command, "benchmarks/results", serving_lines, scale_section(plot_dir)))
    return md
