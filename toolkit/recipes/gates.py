"""Gates: thresholds on the measured results that must hold before anything is pushed."""

from __future__ import annotations

from dataclasses import dataclass

from toolkit.recipes.schema import GatesSection


@dataclass(frozen=True)
class GateResult:
    """One threshold against its measured value."""

    name: str
    measured: float | bool
    op: str  # "<=", ">=" or "=="
    threshold: float | bool
    passed: bool

    def __str__(self) -> str:
        measured = f"{self.measured:.4g}" if isinstance(self.measured, float) else str(self.measured).lower()
        threshold = str(self.threshold).lower() if isinstance(self.threshold, bool) else f"{self.threshold:g}"
        return f"{self.name}: measured {measured}, threshold {self.op} {threshold}"


def check_gates(gates: GatesSection, results: dict[str, dict]) -> list[GateResult]:
    """Every gate that applies to the measured ``results`` (step name → results; absent steps have no gates)."""
    checks = []
    if "evaluate" in results:  # an eval.json report
        overall, worst = results["evaluate"]["overall"], results["evaluate"]["worst_slice"]
        checks += [("max_perplexity_increase", overall["perplexity"] - overall["base_perplexity"], "<="),
                   ("max_perplexity_ratio", overall["perplexity_ratio"], "<="),
                   ("max_slice_perplexity_ratio", results["evaluate"]["slices"][worst]["perplexity_ratio"], "<="),
                   ("min_top1_agreement", overall["top1_agreement"], ">="), ("max_kl", overall["kl"], "<=")]
    if "validate" in results and gates.validate_required:
        checks.append(("validate_required", results["validate"]["ok"], "=="))
    if "heads_eval" in results:
        he = results["heads_eval"]
        checks.append(("min_accepted_length", he[gates.accepted_length_mode]["mean_accepted_length"], ">="))
        if gates.lossless_required:
            checks.append(("lossless_required", all(r["lossless"] for r in he.values()), "=="))
    out = []
    for name, measured, op in checks:
        threshold = getattr(gates, name)
        if threshold is None:
            continue
        passed = {"<=": measured <= threshold, ">=": measured >= threshold, "==": measured == threshold}[op]
        label = f"{name} ({gates.accepted_length_mode})" if name == "min_accepted_length" else name
        out.append(GateResult(label, measured, op, threshold, bool(passed)))
    return out
