"""Fit a GPU's ``flops_efficiency`` and ``bandwidth_efficiency`` (on the matmuls) and its elementwise kernels'
bandwidth and per-kernel floor to Vidur's operator profile of one model, and print the analytical model's error
per operator and token range before (the hardware yaml's values or ``--before``'s, no floor) and after the fit;
``--heldout`` profiles (other models on the same GPU) are then scored with the values fitted, not refitted
(``nanovllm/harness/sim/fit_hardware.py``).

    python experiments/fit_gpu_efficiencies.py --profile VIDUR/data/profiling/compute/h100/meta-llama/Llama-2-7b-hf \\
        --hardware h100_sxm --model llama2_7b_config --before 0.6 0.8 \\
        --heldout VIDUR/data/profiling/compute/h100/codellama/CodeLlama-34b-Instruct-hf ...

Vidur's profiles (https://github.com/microsoft/vidur, ``data/profiling/compute/<gpu>/<org>/<model>/mlp.csv``) are
not shipped here. They were measured in float16: the model's cost is taken in float16 and the hardware's float16
peak is the one fitted against. A held-out profile's model shape comes from its own rows.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import yaml
from transformers import AutoConfig

from nanovllm.harness.sim.fit_hardware import (LAYER_STEP, TOKEN_RANGES, Efficiencies, ErrorRow, cost_from_profile,
                                               errors, fit, range_label, read_operator_times)
from nanovllm.harness.sim.hardware import Hardware
from nanovllm.serving.monitor import ModelCost

ROOT = Path(__file__).resolve().parent.parent
DTYPE = "float16"   # what Vidur profiled in


def load_hardware(name: str) -> Hardware:
    path = ROOT / "conf" / "hardware" / f"{name}.yaml"
    if not path.is_file():
        raise SystemExit(f"--hardware {name}: no {path}")
    return Hardware.from_config(yaml.safe_load(path.read_text(encoding="utf-8")))


def load_cost(model: str) -> ModelCost:
    path = ROOT / "conf" / "model" / f"{model}.yaml"
    if not path.is_file():
        raise SystemExit(f"--model {model}: no {path}")
    config = AutoConfig.from_pretrained(str(ROOT / yaml.safe_load(path.read_text(encoding="utf-8"))["path"]))
    return ModelCost.from_hf_config(config, torch.float16)


def mlp_csv(directory: str) -> Path:
    path = Path(directory).expanduser()
    return path / "mlp.csv" if path.is_dir() else path


def table(before: list[ErrorRow], after: list[ErrorRow] | None) -> str:
    """Median / max |error| % per operator (rows) and token range (columns), before -> after."""
    labels = [range_label(lo, hi) for lo, hi in TOKEN_RANGES] + ["all"]
    index = {(r.op, r.tokens): r for r in before}
    fitted = {(r.op, r.tokens): r for r in after or []}
    ops = list(dict.fromkeys(r.op for r in before))
    present = [label for label in labels if any((op, label) in index for op in ops)]
    lines = ["| operator | " + " | ".join(f"{label} tokens" for label in present) + " |",
             "|---|" + "---|" * len(present)]
    for op in ops:
        cells = []
        for label in present:
            row = index.get((op, label))
            if row is None:
                cells.append("")
                continue
            cell = f"{row.median_pct:.0f} / {row.max_pct:.0f}"
            if (op, label) in fitted:
                cell += f" -> {fitted[op, label].median_pct:.0f} / {fitted[op, label].max_pct:.0f}"
            cells.append(cell)
        lines.append(f"| {op} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary(results: list[tuple[str, list[ErrorRow], list[ErrorRow]]], op: str) -> str:
    """One line per profile: ``op``'s median |error| % per token range, before -> after."""
    labels = [range_label(lo, hi) for lo, hi in TOKEN_RANGES] + ["all"]
    lines = ["| profile | " + " | ".join(f"{label} tokens" for label in labels) + " |", "|---|" + "---|" * len(labels)]
    for name, before, after in results:
        b = {r.tokens: r for r in before if r.op == op}
        a = {r.tokens: r for r in after if r.op == op}
        cells = [f"{b[label].median_pct:.0f} -> {a[label].median_pct:.0f}" if label in b else "" for label in labels]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def describe(e: Efficiencies, elementwise: Efficiencies) -> str:
    return (f"matmuls: flops_efficiency {e.flops_efficiency:.3f}, bandwidth_efficiency {e.bandwidth_efficiency:.3f}; "
            f"elementwise kernels: bandwidth {elementwise.bandwidth_efficiency:.3f} of peak, floor "
            f"{elementwise.kernel_floor * 1e6:.1f} us a kernel")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", required=True, help="a Vidur profile directory (or its mlp.csv) to fit to")
    parser.add_argument("--hardware", required=True, help="a conf/hardware/ name, e.g. h100_sxm")
    parser.add_argument("--model", required=True, help="the profile's model, a conf/model/ name, e.g. llama2_7b_config")
    parser.add_argument("--before", nargs=2, type=float, metavar=("FLOPS_EFF", "BANDWIDTH_EFF"),
                        help="the efficiencies to compare with (default: the hardware yaml's)")
    parser.add_argument("--heldout", nargs="*", default=[], help="profiles of other models on the same GPU to score")
    args = parser.parse_args()

    hardware = load_hardware(args.hardware)
    cost = load_cost(args.model)
    profile = mlp_csv(args.profile)
    try:
        times = read_operator_times(profile, cost)
    except ValueError as e:   # the file and what is wrong with it, in one line
        raise SystemExit(f"error: --profile: {e}") from None
    matmuls = [t for t in times if t.op in cost.layer_linear_shapes]
    others = [t for t in times if t.op not in cost.layer_linear_shapes]
    flops_eff, bandwidth_eff = args.before or (hardware.flops_efficiency, hardware.bandwidth_efficiency)
    before = Efficiencies(flops_eff, bandwidth_eff)
    fitted, elementwise = fit(matmuls, cost, hardware, DTYPE), fit(others, cost, hardware, DTYPE, floor=True)
    print(f"{profile} ({sum(len(t.tokens) for t in times)} points, {len(times)} operators), "
          f"hardware={args.hardware}, model={args.model}, {DTYPE}")
    print(f"before ({'--before' if args.before else f'conf/hardware/{args.hardware}.yaml'}): {describe(before, before)}")
    print(f"fitted: {describe(fitted, elementwise)}")
    print("\nmedian / max |predicted / measured - 1| in %, before -> after the fit\n")
    print(table(errors(times, cost, hardware, DTYPE, before),
                errors(times, cost, hardware, DTYPE, fitted, elementwise)))
    results = [(f"{profile.parent.name} (fitted)", errors(times, cost, hardware, DTYPE, before),
                errors(times, cost, hardware, DTYPE, fitted, elementwise))]
    for directory in args.heldout:
        path = mlp_csv(directory)
        try:
            other = cost_from_profile(path)
            other_times = read_operator_times(path, other)
        except ValueError as e:
            print(f"\nheld-out {path}: skipped: {e}")
            continue
        print(f"\nheld-out {path} (hidden {other.hidden_size}, intermediate {other.intermediate_size}, heads "
              f"{other.num_heads}/{other.num_kv_heads}), before -> with the values fitted above\n")
        results.append((f"{path.parent.name} (held out)", errors(other_times, other, hardware, DTYPE, before),
                        errors(other_times, other, hardware, DTYPE, fitted, elementwise)))
        print(table(*results[-1][1:]))
    for row in (LAYER_STEP, "all operators"):
        print(f"\nsummary, {row}: median |error| %, before -> after the fit\n")
        print(summary(results, row))


if __name__ == "__main__":
    main()
