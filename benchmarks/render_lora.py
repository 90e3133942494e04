"""The LoRA benchmark's table, checks and figure for docs/lora.md (``benchmarks/lora.py``'s result files);
:mod:`benchmarks.render_docs` fills the page's ``lora`` block with :func:`block`."""

from __future__ import annotations

LABELS = {"fedavg": "FedAvg (full fine-tuning)", "fedpart": "FedPart (full model, a layer a round)",
          "fedit": "FedIT", "ffa_lora": "FFA-LoRA", "fedsa_lora": "FedSA-LoRA", "hetlora": "HetLoRA",
          "flexlora": "FlexLoRA", "flora": "FLoRA"}
CHECKS = {"ffa_close_to_fedit_at_half_upload": "FFA-LoRA within 2 points of FedIT at ≤ 60 % of its upload",
          "fedsa_best_personalised": "FedSA-LoRA best personalised accuracy of the LoRA methods",
          "flora_at_least_fedit_heterogeneous": "FLoRA ≥ FedIT (global accuracy) under heterogeneous ranks"}


def rows_of(d: dict) -> list[list[str]]:
    out = []
    for r in d["rows"]:
        ranks = f"ranks {','.join(map(str, r['ranks']))}" if r["ranks"] else (
            "—" if r["method"] in ("fedavg", "fedpart") else f"rank {d['settings']['rank']}")
        out.append([LABELS.get(r["method"], r["method"]), ranks, f"{r['global_accuracy']:.3f}",
                    f"{r['personal_accuracy']:.3f}", f"{r['upload_bytes_per_round'] / 1e3:,.1f}",
                    f"{r['client_flops_per_step'] / 1e6:.2f}", f"{r['client_memory_bytes'] / 1e3:,.0f}"])
    return out


def block(results: dict, table, device_of, date_of, command_of, figures_of, figure_lines) -> str:
    """Per result file: where it came from, the table, the orderings checked, the figure."""
    lines = []
    for name, d in sorted((n, d) for n, d in results.items() if d.get("benchmark") == "lora"):
        s = d["settings"]
        lines += [f"`benchmarks/results/{name}` — {device_of(name, d)}, {date_of(name, d)}: "
                  f"{command_of(name, d)} ({d.get('wall_seconds', '?')} s). {d['model']} on {d['dataset']}, "
                  f"base pre-trained to {d['pretrained_accuracy']:.3f} test accuracy on the public 30 %; "
                  f"{s['clients']} clients (all in every round), {s['rounds']} rounds of {s['steps']} local steps "
                  f"(batch {s['batch']}, SGD {s['lr']}).", ""]
        lines += table(["method", "adapters", "global accuracy", "personalised accuracy", "upload / round (kB)",
                        "client MFLOPs / step", "client memory (kB)"], rows_of(d))
        lines += ["", "The papers' orderings on these numbers:", ""]
        lines += [f"- {CHECKS.get(k, k)}: **{'yes' if v else 'no'}**" for k, v in d["checks"].items()]
        by = {r["method"]: r for r in d["rows"] if not r["ranks"]}
        if {"fedit", "ffa_lora"} <= set(by):
            ratio = by["ffa_lora"]["upload_bytes_per_round"] / by["fedit"]["upload_bytes_per_round"]
            lines += [f"- FFA-LoRA's upload is {100 * ratio:.0f} % of FedIT's: both upload the trained head, and B is "
                      "half of an adapter only where a layer has as many inputs as outputs."]
        lines += [""] + figure_lines(figures_of([name]), "assets/benchmarks/")
    return "\n".join(lines).rstrip() or "No result file yet: run `python -m benchmarks.lora --size cpu`."
