"""GPTQModel and transformers as independent loaders of compound's GPTQ and AWQ checkpoints of the real SmolLM2:
each must load the checkpoint into its own packed int4 modules (not a dense fallback) and give the logits compound's
own loader gives, on held-out windows.

Loaders (``tests/integration/peer_logits.py``, run in the venv made by ``bash scripts/setup_gptqmodel.sh``, since
GPTQModel pins its own transformers): ``GPTQModel.load`` with its plain torch kernels (``TorchLinear`` /
``AwqTorchLinear``, fp16: dequantize, then matmul), and ``AutoModelForCausalLM.from_pretrained``, transformers' own
GPTQ/AWQ integration, which picks GPTQModel's ATen int4 kernels on CPU (``TorchAtenLinear``, computing in bf16).
Compound's loader runs its exact fp32 dequantize-then-matmul reference.

Tolerances, measured here: GPTQModel fp16 mean |Δ logit| 0.016 (max 0.21 on logits up to 38), transformers bf16
0.077 (max 1.5), |Δ mean NLL| ≤ 2e-3 nats, top-1 agreement ≥ 98.4 %. The same peer logits against compound's
logits of the *other* checkpoint (another W4 quantization of the same model) differ by a mean |Δ| of 2.2 and agree
on 63 % of top-1 tokens, so the bounds below are 15× tighter than what a wrong checkpoint produces.
"""

import pytest
import torch
import torch.nn.functional as F
from peer_jobs import PEER_PYTHON, run_peer_jobs

# one xdist worker for every module that uses the shared smollm2_checkpoints, so they are built once
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("smollm2_checkpoints")]

MEAN_LOGIT_TOLERANCE = 0.15  # mean |Δ logit| between a peer and compound, same checkpoint
NLL_TOLERANCE = 0.01  # nats, |Δ mean NLL|
TOP1_AGREEMENT = 0.97
# loader: the module classes its quantized linears must be, per checkpoint layout
PEERS = {
    "gptqmodel": {"gptq": "TorchLinear", "awq": "AwqTorchLinear"},
    "transformers": {"gptq": "TorchAtenLinear", "awq": "TorchAtenAwqLinear"},
}

if not PEER_PYTHON.exists():
    pytest.skip(f"no GPTQModel venv at {PEER_PYTHON}: run scripts/setup_gptqmodel.sh", allow_module_level=True)


@pytest.fixture(scope="module")
def compound_logits(smollm2_checkpoints, smollm2_windows):
    """Logits [W, T, vocab] of the gptq and awq checkpoints under compound's fp32 reference loader."""
    from toolkit.runtime.load import load_quantized

    logits = {}
    for name in ("gptq", "awq"):
        model, _ = load_quantized(smollm2_checkpoints[name], dtype=torch.float32, backend="reference")
        with torch.inference_mode():
            logits[name] = torch.stack([model(window[None]).logits[0] for window in smollm2_windows[0]])
    return logits


def _mean_nll(logits: torch.Tensor, windows: torch.Tensor) -> float:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), windows[:, 1:].flatten()).item()


@pytest.fixture(scope="module")
def peer_runs(smollm2_checkpoints, smollm2_windows, tmp_path_factory):
    """{(loader, layout): (its JSON report, its logits)}: each loader's two loads in one process of its own, the two
    processes side by side, one thread each (most of a run is importing GPTQModel and transformers)."""
    runs = run_peer_jobs({(loader, layout): (loader, smollm2_checkpoints[layout])
                          for loader in PEERS for layout in ("gptq", "awq")},
                         smollm2_windows[1], tmp_path_factory.mktemp("peer-logits"))
    for key, (report, printed, _) in runs.items():
        assert "error" not in report, f"{key}: {report['error']}\n{printed[-6000:]}"
    return {key: (report, logits) for key, (report, _, logits) in runs.items()}


@pytest.mark.parametrize("layout", ["gptq", "awq"])
@pytest.mark.parametrize("loader", list(PEERS))
def test_peer_loads_the_checkpoint_into_int4_modules_with_compounds_logits(
    loader, layout, peer_runs, smollm2_windows, compound_logits
):
    report, theirs = peer_runs[loader, layout]
    windows = smollm2_windows[0]
    ours, other = compound_logits[layout], compound_logits["awq" if layout == "gptq" else "gptq"]

    difference = (theirs - ours).abs().mean().item()
    top1 = (theirs.argmax(-1) == ours.argmax(-1)).float().mean().item()
    nll_gap = abs(_mean_nll(theirs, windows) - _mean_nll(ours, windows))
    print(f"\n{loader} {layout} ({report['versions']}): mean |Δ logit| {difference:.4f}, top-1 {top1:.3f}, "
          f"|Δ NLL| {nll_gap:.5f}, modules {report['modules']}")
    assert report["quantization"] == layout
    assert report["modules"] == {PEERS[loader][layout]: 7 * 30}  # every linear of the 30 layers, packed
    assert theirs.shape == ours.shape
    assert difference <= MEAN_LOGIT_TOLERANCE and top1 >= TOP1_AGREEMENT and nll_gap <= NLL_TOLERANCE
    # the negative control: another quantization of the same model is far outside those bounds
    assert (theirs - other).abs().mean().item() > 10 * MEAN_LOGIT_TOLERANCE
