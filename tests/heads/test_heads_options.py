"""The options of ``compound train-heads``: each user-settable field carries its help, names are unique across the
option classes (they are the flags and recipe keys), and each class refuses its own bad values with the message that
names the flag."""

from pathlib import Path

import pytest

from conftest import run_train_heads, text_of, tiny_config
from toolkit.heads.eagle_draft import TreeShape
from toolkit.heads.options import DataOptions, EagleOptions, MedusaOptions, SelectOptions
from toolkit.heads.train import TrainConfig
from toolkit.options import choices_of, help_of, option_fields
from toolkit.train_heads import HeadsJob

CLASSES = (HeadsJob, MedusaOptions, EagleOptions, DataOptions, TrainConfig, SelectOptions)


def test_every_option_has_help_and_a_unique_name():
    names = [f.name for cls in CLASSES for f in option_fields(cls)]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    assert all(help_of(f) for cls in CLASSES for f in option_fields(cls))
    assert {"steps", "train_dtype", "target_dtype", "select_mode", "layout", "num_heads", "aux_layers"} <= set(names)
    assert {"weight_decay", "grad_clip", "log_every", "select_metric", "distill_prompt_tokens"}.isdisjoint(names)
    fields = {f.name: f for cls in CLASSES for f in option_fields(cls)}
    assert choices_of(fields["head"]) == ("medusa", "eagle", "eagle3")
    assert choices_of(fields["layout"]) == ("vllm", "medusa")
    assert choices_of(fields["train_dtype"]) == ("float32", "bfloat16")


@pytest.mark.parametrize("make, message", [
    (lambda: MedusaOptions(num_heads=0), "Medusa needs num_heads >= 1 and num_layers >= 1, got 0, 1"),
    (lambda: MedusaOptions(layout="hf"), "unknown Medusa layout 'hf'; choose one of vllm, medusa"),
    (lambda: EagleOptions(loss="mse"), "--loss must be one of kl, ce, got 'mse'"),
    (lambda: EagleOptions(top_k=0), "--draft-vocab, --ttt-steps, --depth, --top-k and --draft-tokens must be >= 1"),
    (lambda: DataOptions(samples=0), "need --samples >= 1 and --max-len >= 8, got 0 and 1024"),
    (lambda: DataOptions(target_dtype="int8"), "--target-dtype must be one of float16, bfloat16, float32, got 'int8'"),
    (lambda: DataOptions(batch_tokens=0), "--batch-tokens must be >= 1"),
    (lambda: DataOptions(stream_target=True), "--stream-target runs the target one layer at a time"),
    (lambda: SelectOptions(select_mode="beam"), "--select-mode must be one of tree, chain, got 'beam'"),
    (lambda: TrainConfig(train_dtype="fp16"), "--train-dtype must be one of float32, bfloat16, got 'fp16'"),
    (lambda: TrainConfig(steps=0), "steps must be >= 1, got 0"),
    (lambda: HeadsJob(model="m", output=Path("o"), head="hydra"), "--head must be one of medusa, eagle, eagle3, got 'hydra'"),
])
def test_each_class_refuses_its_own_values(make, message):
    with pytest.raises(ValueError) as err:
        make()
    assert str(err.value).startswith(message)


def test_job_reads_its_parts():
    eagle = EagleOptions(aux_layers=(2, 5), draft_vocab=300, ttt_steps=2, depth=3, top_k=2, draft_tokens=4)
    job = HeadsJob(model="m", output=Path("out/h"), head="eagle3", eagle=eagle)
    assert job.work == Path("out/h.work") and job.train_dir == Path("out/h.work/train-eagle3-l2-5-v300-s2")
    assert job.hidden_layers(8) == [2, 5, -1] and job.tree == TreeShape(3, 2, 4)
    ce = HeadsJob(model="m", output=Path("out/h"), head="eagle3", eagle=EagleOptions(draft_vocab=300, loss="ce"))
    assert ce.train_dir.name == "train-eagle3-ldefault-v300-s5-ce"  # a kl run never resumes a ce one
    assert HeadsJob(model="m", output=Path("o"), head="eagle", eagle=eagle,
                    select=SelectOptions(select_mode="chain")).tree == TreeShape(3)
    medusa = HeadsJob(model="m", output=Path("o"), medusa=MedusaOptions(num_heads=2, shared_lm_head=True))
    assert medusa.train_dir.name == "train-medusa-k2-l1-shared" and medusa.hidden_layers(8) == [-1]




def assert_refused(result, parent, *needles):
    """Exit 2, a message holding every needle, no traceback, and nothing new in ``parent``."""
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit) and "Traceback" not in result.output
    assert all(needle in text_of(result) for needle in needles), result.output
    assert list(parent.iterdir()) == []


@pytest.fixture(scope="module")
def config_dirs(tmp_path_factory):
    """Targets known by their config alone (the refusals read nothing else): a Gemma and a one-layer Llama."""
    dirs = {}
    for name, config in {"gemma": tiny_config("gemma"), "one-layer": tiny_config("llama", layers=1)}.items():
        dirs[name] = tmp_path_factory.mktemp(name)
        config.save_pretrained(dirs[name])
    return dirs


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "run"])
@pytest.mark.parametrize("args, needles", [
    (["--head", "eagle3", "--aux-layers", "99"], ["--aux-layers 99 is out of range", "2 decoder layers", "1..1"]),
    (["--head", "eagle3", "--aux-layers", "1,1"], ["--aux-layers must be increasing", "got 1,1"]),
    (["--head", "eagle3", "--aux-layers", "0"], ["--aux-layers must be increasing target layer indices >= 1"]),
    (["--head", "eagle3", "--aux-layers", "x"], ["--aux-layers", "comma-separated integers"]),
    (["--head", "eagle3", "--draft-vocab", "60000"], ["--draft-vocab 60000 is larger than the target's vocabulary",
                                                      "1..49152"]),
    (["--head", "eagle3", "--draft-vocab", "0"], ["--draft-vocab", "must be >= 1"]),
    (["--num-heads", "0"], ["--num-heads", "num_heads >= 1"]),
    (["--num-layers", "0"], ["--num-layers", "num_layers >= 1"]),
    (["--max-len", "4096"], ["--max-len 4096 is longer than the target's context of 256 tokens", "8..256"]),
    (["--steps", "0"], ["steps must be >= 1, got 0 (--steps)"]),
    (["--batch-size", "3", "--micro-batch-size", "2"], ["--batch-size or --micro-batch-size"]),
    (["--eval-prompts", "0"], ["--eval-prompts and --eval-tokens must be >= 1"]),
    (["--eval-tokens", "0"], ["--eval-prompts and --eval-tokens must be >= 1"]),
    (["--distill-tokens", "0"], ["--distill-tokens and --distill-batch must be >= 1"]),
    (["--distill-batch", "0"], ["--distill-tokens and --distill-batch must be >= 1"]),
])
def test_out_of_range_options_are_refused_before_any_work(tiny_llama_dir, tmp_path, dry_run, args, needles):
    parent = tmp_path / "runs"
    parent.mkdir()
    result = run_train_heads(tiny_llama_dir, parent / "heads", *args, *(["--dry-run"] if dry_run else []))
    assert_refused(result, parent, *needles)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("target, args, needles", [
    ("gemma", ["--head", "eagle"], ["--head eagle cannot draft for a gemma target", "--head medusa"]),
    ("gemma", ["--head", "eagle3"], ["--head eagle3 cannot draft for a gemma target", "llama"]),
    ("one-layer", ["--head", "eagle3"], ["--head eagle3", "1 decoder layer", "--head eagle"]),
])
def test_head_kind_the_target_cannot_have_is_refused(config_dirs, tmp_path, target, args, needles):
    parent = tmp_path / "runs"
    parent.mkdir()
    result = run_train_heads(config_dirs[target], parent / "heads", *args, "--dry-run")
    assert_refused(result, parent, *needles)
