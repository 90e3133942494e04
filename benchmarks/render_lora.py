"""The LoRA benchmark's tables, checks and figures for docs/lora.md (``benchmarks/lora.py``'s result files);
:mod:`benchmarks.render_docs` fills the page's ``lora`` block with :func:`block`."""

from __future__ import annotations

LABELS = {"fedavg": "FedAvg (full fine-tuning)", "fedit": "FedIT", "ffa_lora": "FFA-LoRA",
          "fedsa_lora": "FedSA-LoRA", "hetlora": "HetLoRA", "flexlora": "FlexLoRA", "flora": "FLoRA"}
CHECKS = {"ffa_close_to_fedit_at_half_upload": "FFA-LoRA within 2 points of FedIT at ≤ 60 % of its upload",
          "fedsa_best_personalised": "FedSA-LoRA best personalised accuracy of the LoRA methods",
          "flora_at_least_fedit_heterogeneous": "FLoRA ≥ FedIT (global accuracy) under heterogeneous ranks"}


def _label(method: str, d: dict) -> str:
    if method == "fedpart":
        unit = "a layer" if d["model"] == "mlp" else "one block"
        return f"FedPart (full model, {unit} a round)"
    return LABELS.get(method, method)


def _model(d: dict) -> str:
    size = d["settings"].get("model_size")
    if isinstance(size, dict):
        size = size.get("name")
    return f"{d['model']} ({size})" if size else d["model"]


def rows_of(d: dict) -> list[list[str]]:
    language = d.get("language_model", False)
    out = []
    for r in d["rows"]:
        ranks = f"ranks {','.join(map(str, r['ranks']))}" if r["ranks"] else (
            "—" if r["method"] in ("fedavg", "fedpart") else f"rank {d['settings']['rank']}")
        quality = [f"{r['global_accuracy']:.3f}", f"{r['personal_accuracy']:.3f}"]
        if language:
            quality += [f"{r['global_perplexity']:.2f}", f"{r['personal_perplexity']:.2f}"]
        out.append([_label(r["method"], d), ranks, *quality, f"{r['upload_bytes_per_round'] / 1e3:,.1f}",
                    f"{r['client_flops_per_step'] / 1e6:,.1f}", f"{r['client_memory_bytes'] / 1e3:,.0f}"])
    return out


def header(d: dict) -> list[str]:
    if d.get("language_model", False):
        quality = ["global token accuracy", "personalised token accuracy", "global perplexity",
                   "personalised perplexity"]
    else:
        quality = ["global accuracy", "personalised accuracy"]
    return ["method", "adapters", *quality, "upload / round (kB)", "client MFLOPs / step", "client memory (kB)"]


def block(results: dict, table, device_of, date_of, command_of, figures_of, figure_lines) -> str:
    """Per result file: where it came from, the table, the orderings checked, the figure."""
    lines = []
    found = [(n, d) for n, d in results.items() if d.get("benchmark") == "lora"]
    for name, d in sorted(found, key=lambda item: (item[1].get("language_model", False), item[0])):  # classifiers first
        s = d["settings"]
        base = f"{d['pretrained_accuracy']:.3f} test {'token ' if d.get('language_model') else ''}accuracy"
        if d.get("pretrained_perplexity"):
            base += f" (perplexity {d['pretrained_perplexity']:.2f})"
        pre = s.get("pretrain_optimizer")
        pre = f" ({s['pretrain_steps']} steps of {pre[0].upper() if pre[0] == 'sgd' else pre[0].title()} " \
              f"{pre[1]:g})" if pre else ""
        lines += [f"`benchmarks/results/{name}` — {device_of(name, d)}, {date_of(name, d)}: "
                  f"{command_of(name, d)} ({d.get('wall_seconds', '?')} s). {_model(d)} on {d['dataset']}, "
                  f"base pre-trained to {base} on the public 30 %{pre}; "
                  f"{s['clients']} clients (all in every round), {s['rounds']} rounds of {s['steps']} local steps "
                  f"(batch {s['batch']}, SGD {s['lr']}).", ""]
        lines += table(header(d), rows_of(d))
        lines += ["", "The papers' orderings on these numbers:", ""]
        lines += [f"- {CHECKS.get(k, k)}: **{'yes' if v else 'no'}**" for k, v in d["checks"].items()]
        by = {r["method"]: r for r in d["rows"] if not r["ranks"]}
        if {"fedit", "ffa_lora"} <= set(by):
            ratio = by["ffa_lora"]["upload_bytes_per_round"] / by["fedit"]["upload_bytes_per_round"]
            lines += [f"- FFA-LoRA's upload is {100 * ratio:.0f} % of FedIT's: both upload the trained head, and B is "
                      "half of an adapter only where a layer has as many inputs as outputs."]
        lines += [""] + figure_lines(figures_of([name]), "assets/benchmarks/")
    return "\n".join(lines).rstrip() or "No result file yet: run `python -m benchmarks.lora --size cpu`."


def speed_block(results: dict, table, device_of, date_of, command_of) -> str:
    """The LoRA speed benchmark: each runner's round time beside the plain loop's and full fine-tuning's."""
    lines = []
    for name, d in sorted((n, d) for n, d in results.items() if d.get("benchmark") == "lora_speed"):
        s = d["settings"]
        lines += [f"`benchmarks/results/{name}` — {device_of(name, d)}, {date_of(name, d)}: {command_of(name, d)}. "
                  f"`transformer_lm` ({s['size']}), K = {s['clients']} clients, each {s['local_steps']} local steps "
                  f"of {s['batch']} sequences of {s['seq_len']} tokens; LoRA rank {s['rank']} (FedIT) against full "
                  f"fine-tuning (FedAvg); median of {s['repeats']} rounds; a float32 matmul ran at "
                  f"{d['matmul_flops_per_s'] / 1e9:.0f} GFLOP/s.", ""]
        rows = [[r["runner"], f"{r['round_s']:.3f}", f"{r['speedup_vs_plain_loop']:.2f}",
                 f"{r['speedup_vs_full_finetuning']:.2f}" if "speedup_vs_full_finetuning" in r else "—",
                 f"{r['achieved_flops_per_s'] / 1e9:.1f}", f"{r['percent_of_matmul']:.1f} %",
                 f"{r['step_floor_s']:.3f}"] for r in d["rows"]]
        lines += table(["runner", "round (s)", "× plain loop", "× full fine-tuning", "GFLOP/s", "of matmul",
                        "steps alone (s)"], rows)
        flops = d["step_flops"]
        lines += ["", f"A client step costs {flops['lora'] / 1e6:.0f} MFLOPs under LoRA and {flops['full'] / 1e6:.0f} "
                      f"fully ({d['trained_parameters']['lora']:,} against {d['trained_parameters']['full']:,} "
                      "trained parameters).", ""]
    return "\n".join(lines).rstrip() or "No result file yet: run `python -m benchmarks.lora_speed`."
