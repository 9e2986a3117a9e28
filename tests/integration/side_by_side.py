"""What the integration fixtures that build real-model checkpoints share: running the builds side by side, and the
held-out windows every loader scores, as a tensor and as a JSON file for the loaders' own scripts."""

import json
import subprocess
from pathlib import Path


def run_side_by_side(commands: dict[str, list[str]], timeout: int = 1200) -> None:
    """Run the commands at once (each is mostly single-threaded Python), failing on the first error with its log."""
    procs = {name: subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for name, cmd in commands.items()}
    for name, proc in procs.items():
        output, _ = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, f"{name}: {output[-6000:]}"


def held_out_windows(tokenizer_dir: Path, windows: int, seq_len: int, directory: Path):
    """(ShareGPT's held-out windows [windows, seq_len] under the tokenizer in ``tokenizer_dir``, the same windows
    written to ``directory``/windows.json)."""
    from transformers import AutoTokenizer

    from toolkit.calibration import eval_windows

    tokens = eval_windows(AutoTokenizer.from_pretrained(tokenizer_dir), "sharegpt", windows=windows, seq_len=seq_len)
    path = directory / "windows.json"
    path.write_text(json.dumps(tokens.tolist()))
    return tokens, path
