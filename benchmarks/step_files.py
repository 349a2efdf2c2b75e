"""Which gspo source files and functions run during one synchronous RL step.

Builds the default job (configs/default.yaml, made tiny: no cold start, 4 prompts) with the gspo
on PYTHONPATH, then traces ``RLStep.__call__`` of step 1 (generation to the last optimizer step,
then the diagnostics and the audit check) with ``sys.setprofile`` and prints the count and the
files (docs/architecture.md, "Files one batch visits"). Extra arguments are config overrides::

    PYTHONPATH=src python benchmarks/step_files.py
    PYTHONPATH=/tmp/base/src python benchmarks/step_files.py --configs /tmp/base/configs
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import gspo
from gspo.config import load_config
from gspo.training.trainer import Trainer


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=str(Path(__file__).resolve().parents[1] / "configs"))
    parser.add_argument("overrides", nargs="*", help="config overrides, key=value")
    args = parser.parse_args()
    root = Path(gspo.__file__).parent
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(str(Path(args.configs) / "default.yaml"), [
            f"run.dir={tmp}/run", "sft.enabled=false", "run.progress=false", "run.trackers=[]",
            "rollout.prompts_per_step=4", "task.n_test=8", *args.overrides])
        trainer = Trainer(cfg, log=lambda m: None)
        trainer.setup()
        files, functions = set(), set()

        def profile(frame, event, arg):
            path = frame.f_code.co_filename
            if event == "call" and path.startswith(str(root)):
                files.add(os.path.relpath(path, root))
                functions.add((path, frame.f_code.co_name))
        sys.setprofile(profile)
        trainer.step(0)
        sys.setprofile(None)
    print(f"{len(files)} files, {len(functions)} functions: {' '.join(sorted(files))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
