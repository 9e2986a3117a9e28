"""``toolkit.hub.push`` and ``compound push`` against a local Hub (tests/hub/local_hub.py) on 127.0.0.1.

The client runs in a subprocess (tests/hub/hub_client.py): ``huggingface_hub`` freezes its endpoint and offline
switch at import, and this process imported it already with the suite's offline settings (tests/conftest.py). The
subprocess refuses any connection or name lookup but 127.0.0.1 and reports each one; the server records every
request, so each test asserts the whole exchange happened here. Card and refusal checks that make no request run
in-process with an API object that fails if touched.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from conftest import cli, refused
from local_hub import USER, LocalHub
from toolkit.formats.checkpoint import MANIFEST, sha256_file, write_directory
from toolkit.formats.gptq import quantization_config
from toolkit.hub import HubError, push
from toolkit.model_card import acceptance_chart, card_results, model_card
from toolkit.models import EMBEDDED
from toolkit.quant.configs import RTNConfig

CLIENT = Path(__file__).with_name("hub_client.py")
TOKEN = "hf_compoundTestToken_9f3b2c7e1d"
REPO = f"{USER}/tiny-rtn-4bit"
BIG = 10 * 2**20  # the shard must exceed this to travel as a multipart LFS upload
DIVERGENCE = {"kl": 0.01234, "top1_agreement": 0.9375, "perplexity": 12.5, "base_perplexity": 12.0, "tokens": 4096,
              "dataset": "sharegpt", "windows": 8, "seq_len": 512}
COMMAND = "compound quantize --model smollm2-135m --method rtn --group-size 64 -o out/tiny"
ACCEPTANCE = [
    {"mode": "chain", "shape": "chain of 3", "nodes": 3, "mean_accepted_length": 1.8,
     "acceptance_rate": [0.55, 0.3, 0.2], "lossless": True, "tokens": 256, "speculative_tokens_per_s": 40.0,
     "greedy_tokens_per_s": 30.0, "speedup": 1.333},
    {"mode": "tree", "shape": "3-node tree", "nodes": 3, "mean_accepted_length": 2.1, "acceptance_rate": [0.7, 0.4, 0.25],
     "lossless": True, "tokens": 256, "speculative_tokens_per_s": 45.0, "greedy_tokens_per_s": 30.0, "speedup": 1.5,
     "break_even_accepted_length": 1.4},
]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory) -> Path:
    """A GPTQ-layout checkpoint directory written by compound's own writer: a 12.6 MB shard (multipart), a small
    shard, the index, config.json with quantization_config, a tokenizer file and the compound.json manifest."""
    torch.manual_seed(0)
    config = RTNConfig(bits=4, group_size=64, sym=True)
    tensors = {"model.embed_tokens.weight": torch.randn(3072, 2048, dtype=torch.float16),
               "model.layers.0.self_attn.q_proj.qweight": torch.randint(-2**31, 2**31 - 1, (8, 64), dtype=torch.int32),
               "model.layers.0.self_attn.q_proj.scales": torch.rand(1, 64, dtype=torch.float16)}
    manifest = {"compound_version": "0.1.0", "format": "gptq", "model": "smollm2-135m",
                "quantization": config.to_dict(), "calibration": None, "kv_cache": None}
    out = tmp_path_factory.mktemp("artifact") / "tiny-rtn"

    def tokenizer(staging: Path) -> None:
        (staging / "tokenizer_config.json").write_text('{"model_max_length": 2048}\n')

    write_directory(out, tensors, {"model_type": "llama", "torch_dtype": "float16",
                                   "quantization_config": quantization_config(config)},
                    manifest, tokenizer, max_shard_size=8 * 2**20)
    assert max(p.stat().st_size for p in out.iterdir()) > BIG
    return out


@pytest.fixture
def hub():
    with LocalHub(TOKEN, multipart_threshold=BIG, chunk_size=4 * 2**20) as server:
        yield server
    assert server.errors == []  # no request the server failed to handle


def run_client(hub: LocalHub, tmp_path: Path, *args: str, token: str | None = TOKEN,
               timeout: float = 120) -> tuple[dict, subprocess.CompletedProcess]:
    """hub_client.py in a fresh process pointed at ``hub``: (its report, the finished process)."""
    home = tmp_path / f"hf-home-{len(list(tmp_path.glob('hf-home-*')))}"
    home.mkdir()
    out = home / "report.json"
    env = {key: value for key, value in os.environ.items()
           if not key.upper().startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_OFFLINE"))
           and key.upper() not in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")}
    env |= {"HF_ENDPOINT": hub.endpoint, "HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
            "HF_HOME": str(home), "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_HUB_DISABLE_UPDATE_CHECK": "1",
            "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"}
    if token:
        env["HF_TOKEN"] = token
    done = subprocess.run([sys.executable, str(CLIENT), str(out), *args], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    port = int(hub.endpoint.rsplit(":", 1)[1])
    assert report["refused"] == [] and all(c == ["127.0.0.1", port] for c in report["connects"]), report
    return report, done


def requests_of(hub: LocalHub) -> list[str]:
    """Every request the server saw as ``METHOD path``; each asserted to have come to this server by name."""
    host = hub.endpoint.removeprefix("http://")
    assert all(r.host == host for r in hub.requests)
    return [f"{r.method} {r.path}" for r in hub.requests]


def pushed(report: dict) -> dict:
    assert report["error"] is None, report["error"]
    return report["result"]


def front_matter(card: str) -> dict:
    assert card.startswith("---\n")
    return yaml.safe_load(card[4:card.index("\n---", 4)])


def test_push_round_trip(hub, artifact, tmp_path):
    before = {p.name: sha256_file(p) for p in artifact.iterdir()}
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"divergence": DIVERGENCE, "command": COMMAND}))
    report, _ = run_client(hub, tmp_path, "push", str(artifact), REPO, "--results", str(results), "--tag", "smol")
    result = pushed(report)
    manifest = json.loads((artifact / MANIFEST).read_text())
    assert sorted(result["files"]) == sorted([*manifest["files"], MANIFEST, "README.md"])
    assert result["repo_url"] == f"{hub.endpoint}/{REPO}"
    assert result["commit_oid"] == hub.head(REPO) and len(hub.history(REPO)) == 2  # the repo's first commit + ours
    assert {p.name: sha256_file(p) for p in artifact.iterdir()} == before  # the artifact was not touched

    seen = requests_of(hub)
    order = ["GET /api/whoami-v2", "POST /api/repos/create", f"GET /api/models/{REPO}/tree/",
             "POST /api/validate-yaml", f"POST /api/models/{REPO}/preupload/main",
             f"POST /{REPO}.git/info/lfs/objects/batch", "PUT /storage/", f"POST /{REPO}.git/info/lfs/objects/verify",
             f"POST /api/models/{REPO}/commit/main"]
    first = [next(i for i, r in enumerate(seen) if r.startswith(step)) for step in order]
    assert first == sorted(first), seen
    assert seen[-1].startswith(f"POST /api/models/{REPO}/commit/main")
    big = max(manifest["files"], key=lambda name: (artifact / name).stat().st_size)
    parts = [r for r in seen if r.startswith(f"PUT /storage/{manifest['files'][big]}/part/")]
    assert len(parts) == 4  # 12.6 MB in 4 MiB parts
    for r in hub.requests:  # the token goes to the API, never to storage URLs
        assert r.authorization == (None if r.path.startswith("/storage/") else f"Bearer {TOKEN}"), r

    files = run_client(hub, tmp_path, "download", REPO)[0]["result"]
    assert {name: files[name] for name in before} == before
    card = hub.read(REPO, "README.md").decode()
    meta = front_matter(card)
    assert meta["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and meta["base_model_relation"] == "quantized"
    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "text-generation"
    assert meta["tags"] == ["compound", "gptq", "rtn", "4-bit", "smol"]
    assert "| KL(base ‖ this), nats/token | 0.01234 |" in card and "| top-1 agreement with base | 0.9375 |" in card
    assert f"vllm serve {REPO} --dtype float16" in card and COMMAND in card
    assert "Speculative decoding" not in card  # nothing measured, nothing shown


def test_heads_card_serves_with_medusa_and_plots_acceptance(hub, tmp_path):
    from toolkit.heads.medusa import MedusaConfig, MedusaHeads
    from toolkit.heads.medusa_export import export_medusa

    heads = export_medusa(MedusaHeads(MedusaConfig(hidden_size=64, vocab_size=256, num_heads=3)), tmp_path / "heads",
                          target="smollm2-135m", target_sha256="0" * 64,
                          extra_manifest={"training": {"examples": 12, "steps": 5, "best_step": 4,
                                                       "best_metrics": {"mean_accepted_length": 1.9}}})
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"acceptance": ACCEPTANCE}))
    repo = f"{USER}/tiny-medusa"
    result = pushed(run_client(hub, tmp_path, "push", str(heads), repo, "--results", str(results))[0])
    assert "acceptance.png" in result["files"]
    card = hub.read(repo, "README.md").decode()
    meta = front_matter(card)
    assert meta["tags"] == ["compound", "medusa", "speculative-decoding"]
    assert meta["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and "library_name" not in meta
    spec = json.dumps({"method": "medusa", "model": repo, "num_speculative_tokens": 3}, separators=(",", ":"))
    assert f"vllm serve HuggingFaceTB/SmolLM2-135M-Instruct --speculative-config '{spec}'" in card
    assert "| tree | 3 | 2.1 | 0.70 0.40 0.25 | 45 | 30 | 1.50× | 1.4 | yes |" in card
    assert "| chain | 3 | 1.8 | 0.55 0.30 0.20 | 40 | 30 | 1.33× | – | yes |" in card  # a report from before the split
    assert "| at best step: mean accepted length | 1.9 |" in card
    assert "![acceptance per draft depth](acceptance.png)" in card
    assert bar_areas(hub.read(repo, "acceptance.png"), len(ACCEPTANCE)) == bar_areas(acceptance_chart(ACCEPTANCE), 2)


def bar_areas(png: bytes, bars: int) -> list[int]:
    """Pixels of each report's bar colour (matplotlib's C0, C1, ...) in a chart of ``bars`` reports."""
    import io

    import matplotlib.image
    import numpy
    from matplotlib.colors import to_rgb

    image = matplotlib.image.imread(io.BytesIO(png))[..., :3]
    return [int((numpy.abs(image - to_rgb(f"C{m}")).max(axis=-1) < 0.02).sum()) for m in range(bars)]


@pytest.mark.slow  # several processes or minutes of retries: the second tier
def test_storage_500_mid_upload_commits_nothing_and_a_rerun_succeeds(hub, artifact, tmp_path):
    hub.inject("PUT", "/part/2", times=6)  # every attempt at part 2 of the big shard: 1 try + 5 retries
    report, _ = run_client(hub, tmp_path, "push", str(artifact), REPO)
    assert report["error"]["type"] == "HubError"
    assert "Nothing was committed" in report["error"]["message"] and "rerun" in report["error"]["message"]
    assert "HTTP 500" in report["error"]["message"]
    assert len(hub.history(REPO)) == 1 and list(hub.files(REPO)) == [".gitattributes"]
    assert not any("/commit/" in r for r in requests_of(hub))
    stored, sent = set(hub.lfs), len(hub.requests)

    result = pushed(run_client(hub, tmp_path, "push", str(artifact), REPO)[0])
    assert result["commit_oid"] == hub.head(REPO) and len(hub.history(REPO)) == 2
    rerun = requests_of(hub)[sent:]
    assert not any(r.startswith(f"PUT /storage/{oid}") for oid in stored for r in rerun)  # stored bytes not re-sent
    manifest = json.loads((artifact / MANIFEST).read_text())
    assert all(hashlib.sha256(hub.read(REPO, name)).hexdigest() == digest for name, digest in manifest["files"].items())


def test_commit_500_commits_nothing_and_a_rerun_sends_no_bytes(hub, artifact, tmp_path):
    hub.inject("POST", "/commit/", times=1)
    report, _ = run_client(hub, tmp_path, "push", str(artifact), REPO)
    assert report["error"]["type"] == "HubError" and "Nothing was committed" in report["error"]["message"]
    assert len(hub.history(REPO)) == 1
    sent = len(hub.requests)
    pushed(run_client(hub, tmp_path, "push", str(artifact), REPO)[0])
    assert len(hub.history(REPO)) == 2
    assert not any(r.startswith("PUT /storage/") for r in requests_of(hub)[sent:])


def test_missing_token_is_refused_before_any_request(hub, artifact, tmp_path):
    report, _ = run_client(hub, tmp_path, "push", str(artifact), REPO, token=None)
    assert report["error"]["type"] == "HubError" and "no Hugging Face token" in report["error"]["message"]
    assert [r for r in requests_of(hub) if r != "GET /api/agent-harnesses"] == []
    assert REPO not in hub.repos


def test_wrong_token_is_refused_at_whoami(hub, artifact, tmp_path):
    report, _ = run_client(hub, tmp_path, "push", str(artifact), REPO, token="hf_wrong")
    assert report["error"]["type"] == "HubError" and "refused the token (HTTP 401)" in report["error"]["message"]
    assert [r for r in requests_of(hub) if r != "GET /api/agent-harnesses"] == ["GET /api/whoami-v2"]


def test_an_unreachable_hub_is_a_clear_error(artifact, tmp_path):
    with LocalHub(TOKEN) as closed:
        pass  # a port that was ours and is closed now
    report, _ = run_client(closed, tmp_path, "push", str(artifact), REPO)
    assert report["error"]["type"] == "HubError"
    assert f"cannot reach the Hub at {closed.endpoint}" in report["error"]["message"]


def test_invalid_repo_id_fails_before_any_request(hub, artifact, tmp_path):
    report, _ = run_client(hub, tmp_path, "push", str(artifact), "a/b/c")
    assert report["error"]["type"] == "HubError" and "invalid repo id 'a/b/c'" in report["error"]["message"]
    assert requests_of(hub) == []
    for bad in ("bad--name/x", "no-namespace", "ns/x.git", "ns/" + "n" * 97):
        with pytest.raises(HubError, match="invalid repo id"):
            push(Untouchable(), artifact, bad)


def test_existing_repo_gets_a_new_commit_and_loses_stale_weights(hub, artifact, tmp_path):
    hub.create(REPO, {"notes.md": b"kept\n", "pytorch_model.bin": b"stale weights"})
    result = pushed(run_client(hub, tmp_path, "push", str(artifact), REPO)[0])
    assert "POST /api/repos/create" in requests_of(hub)  # answered 409, accepted
    history = hub.history(REPO)
    assert len(history) == 3 and history[0].oid == result["commit_oid"]
    files = hub.files(REPO)
    assert files["notes.md"] == b"kept\n" and "pytorch_model.bin" not in files and MANIFEST in files


def test_revision_creates_the_branch_and_leaves_main(hub, artifact, tmp_path):
    result = pushed(run_client(hub, tmp_path, "push", str(artifact), REPO, "--revision", "w4-g64")[0])
    assert hub.head(REPO, "w4-g64") == result["commit_oid"]
    assert list(hub.files(REPO)) == [".gitattributes"] and MANIFEST in hub.files(REPO, "w4-g64")


class Untouchable:
    """An HfApi stand-in that fails on any use: the refusals below must come before the client is touched."""

    def __getattr__(self, name):
        raise AssertionError(f"HfApi.{name} called")


@pytest.mark.parametrize("damage", ["changed", "missing"])
def test_tampered_artifact_is_refused_before_upload(artifact, tmp_path, damage):
    copy = tmp_path / "copy"
    shutil.copytree(artifact, copy)
    if damage == "changed":
        (copy / "config.json").write_text("{}\n")
    else:
        (copy / "tokenizer_config.json").unlink()
    name = "config.json" if damage == "changed" else "tokenizer_config.json"
    with pytest.raises(HubError, match=rf"{name} changed or went missing.*nothing was uploaded"):
        push(Untouchable(), copy, REPO)
    (copy / MANIFEST).unlink()
    with pytest.raises(HubError, match="has no compound.json"):
        push(Untouchable(), copy, REPO)


def test_cli_prints_url_and_commit_and_never_the_token(hub, artifact, tmp_path):
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"divergence": DIVERGENCE}))
    report, done = run_client(hub, tmp_path, "cli", "push", str(artifact), "--repo", REPO, "--tag", "smol",
                              "--results", str(results), "--private")
    assert report["exit_code"] in (None, 0), done.stderr
    assert hub.repos[REPO].private
    assert f"{hub.endpoint}/{REPO}" in done.stdout and f"commit {hub.head(REPO)}" in done.stdout
    hub.inject("POST", "/commit/", times=1)
    failed, failed_done = run_client(hub, tmp_path, "cli", "push", str(artifact), "--repo", REPO, "--tag", "other")
    assert failed["exit_code"] == 2 and "Nothing was committed" in failed_done.stderr

    assert all(r.authorization == f"Bearer {TOKEN}" for r in hub.requests if r.path.startswith("/api/whoami"))
    for out in (done.stdout, done.stderr, failed_done.stdout, failed_done.stderr):
        assert TOKEN not in out
    written = [p for p in tmp_path.rglob("*") if p.is_file()] + [p for p in artifact.iterdir()]
    assert written and not [p for p in written if TOKEN.encode() in p.read_bytes()]
    assert not [path for path, data in hub.files(REPO).items() if TOKEN.encode() in data]


def test_eagle3_card_serves_with_vllm_and_sglang(tmp_path):
    """An EAGLE-3 head's card: tags, the target, and the exact serving flags of both engines (vLLM's layer ids
    in the config, SGLang's in eagle_config)."""
    from conftest import tiny_model

    from toolkit.heads.eagle import EagleHead
    from toolkit.heads.eagle_export import export_eagle

    target = tiny_model("llama", layers=8, vocab=256)
    head = EagleHead.from_target(target, "eagle3", draft_vocab=torch.arange(0, 256, 2))
    out = export_eagle(head, tmp_path / "eagle3", target="smollm2-135m", target_sha256=None,
                       extra_manifest={"training": {"draft_shape": {"depth": 4, "top_k": 4, "draft_tokens": 8},
                                                    "steps": 10, "best_step": 10}})
    card = model_card(out, repo_id=f"{USER}/tiny-eagle3")
    meta = yaml.safe_load(card.split("---")[1])
    assert meta["tags"] == ["compound", "eagle3", "speculative-decoding"]
    assert meta["base_model"] == EMBEDDED["smollm2-135m"].source
    spec = json.dumps({"method": "eagle3", "model": f"{USER}/tiny-eagle3", "num_speculative_tokens": 4})
    assert f"vllm serve {meta['base_model']} --speculative-config '{spec}'" in card
    assert "--speculative-algorithm EAGLE3" in card and "--speculative-num-draft-tokens 5" in card
    assert "hidden states [2, 4, 5], a 128-token draft vocabulary" in card


def test_model_card_shows_only_what_was_measured(artifact, tmp_path):
    card = model_card(artifact)
    assert "No measurements were published" in card and "| KL" not in card
    assert "| method | rtn |" in card and "| group size | 64 |" in card
    assert f"vllm serve {artifact.name} --dtype float16" in card
    card = model_card(artifact, {"eval": _eval_report(str(tmp_path / "secret" / "ckpt")), "gates": ["max_kl: ok"],
                                 "latency_ms": {"p50": 12.5}})
    assert str(tmp_path) not in card  # no local directory layout
    assert "| base perplexity | 12 |" in card and "| perplexity | 13 |" in card and "- max_kl: ok" in card
    assert "| code | 252 | 14.000 | – | 12.000 | ×1.167 | – |" in card and "Degrades most: **code**" in card
    assert "| json | 8 | 50% | 75% | – |" in card
    assert "| latency_ms.p50 | 12.5 |" in card and "tokens/s" not in card


def _eval_report(model):
    """An eval.json report as ``compound eval`` writes it (two slices measured, the others empty)."""
    def row(tokens, ppl, base):
        return {"tokens": tokens, "windows": tokens // 63, "perplexity": ppl, "base_perplexity": base,
                "perplexity_ratio": ppl / base, "kl": 0.02, "kl_above": 0.05, "top1_agreement": 0.9,
                "top5_agreement": 0.99}
    empty = dict.fromkeys(row(0, 1, 1), None) | {"tokens": 0, "windows": 0}
    return {"schema": "compound.eval/1", "model": model, "base": "smollm2-135m", "heads": None, "dataset": "sharegpt",
            "seq_len": 64, "windows_per_slice": 4, "kl_threshold": 0.1,
            "slices": {"prose": row(252, 12.5, 12.0), "code": row(252, 14.0, 12.0), "non-english": empty,
                       "structured": empty},
            "overall": row(504, 13.0, 12.0), "worst_slice": "code",
            "kl_histogram": {"lower_edges": [0.0, 0.1], "counts": [480, 24]},
            "generation": {"json": {"prompts": 8, "passed": {"model": 0.5, "base": 0.75}, "same_as_base": None,
                                    "outputs": {}}},
            "acceptance": None, "layer_errors": None, "seconds": 1.0}


def test_an_eval_json_alone_is_read_as_the_eval_results(tmp_path):
    report = _eval_report("ckpt")
    assert card_results(report) == {"eval": report}
    assert card_results({"divergence": DIVERGENCE}) == {"divergence": DIVERGENCE}


def test_model_card_of_a_local_model_names_no_base_and_no_path(artifact, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(artifact, copy)
    manifest = json.loads((copy / MANIFEST).read_text())
    (copy / MANIFEST).write_text(json.dumps({**manifest, "model": str(tmp_path / "private" / "my-model")}))
    card = model_card(copy, repo_id=REPO)
    assert "base_model" not in front_matter(card) and "`my-model` (local files)" in card and str(tmp_path) not in card


def test_plot():
    assert acceptance_chart([]) is None
    chain, tree = bar_areas(acceptance_chart(ACCEPTANCE), 2)
    # bars share one width and one [0, 1] axis, so each report's area is in proportion to its summed acceptance
    assert chain > 0 and tree / chain == pytest.approx(sum(ACCEPTANCE[1]["acceptance_rate"]) /
                                                        sum(ACCEPTANCE[0]["acceptance_rate"]), rel=0.05)


def test_heads_for_a_quantized_target_link_its_base_and_leave_the_target_to_fill(artifact, tmp_path):
    from toolkit.heads.medusa import MedusaConfig, MedusaHeads
    from toolkit.heads.medusa_export import export_medusa

    heads = export_medusa(MedusaHeads(MedusaConfig(hidden_size=64, vocab_size=256, num_heads=2)), tmp_path / "heads",
                          target=str(artifact), target_sha256="0" * 64)
    card = model_card(heads, repo_id=f"{USER}/heads")
    assert front_matter(card)["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert "for a compound checkpoint of [HuggingFaceTB/SmolLM2-135M-Instruct]" in card
    assert "vllm serve TARGET --speculative-config" in card and str(artifact.parent) not in card


RUNS_END_EMPTY = True  # conftest's runs: every case here leaves it empty
run = cli




@pytest.fixture(scope="module")
def rtn_checkpoint(tmp_path_factory, tiny_llama_dir):
    out = tmp_path_factory.mktemp("bad-inputs") / "rtn"
    assert run("quantize", "--model", tiny_llama_dir, "--method", "rtn", "--group-size", "32", "-o", out).exit_code == 0
    return out


def test_push_results_that_are_not_json_names_the_file(tmp_path, runs, rtn_checkpoint):
    results = tmp_path / "results.json"
    results.write_text("{not json")
    refused(run("push", rtn_checkpoint, "--repo", "someone/tiny", "--results", results),
            f"--results {results}: not valid JSON", "line 1")
