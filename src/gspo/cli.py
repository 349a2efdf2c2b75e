"""Command line: ``gspo train | sft | eval | report | samples | audit | compare | mechanism``. Thin over the library.

User errors (config, data, unknown names, missing files, unwritable output) are found in a
preflight phase (``gspo.tools.preflight``), before any model is built: one line, exit 2. Inside
training only ``UserError``s (a failing reward under ``rewards.on_error=fail``) are one line;
anything else is a bug and keeps its traceback. SIGINT / SIGTERM save a checkpoint and exit
128 + signal (130 / 143); a run file that cannot be written (a full disk) is one line naming it,
the last complete checkpoint and the resume command, exit 4. Exit codes: docs/reliability.md.

The top layer: nothing imports it. Each command imports the library modules it needs when it
runs, so that ``gspo --help`` and ``gspo report`` start without loading torch; no other gspo
module imports gspo modules inside a function, and this is not to dodge a circle (nothing is
above the CLI).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import warnings
from pathlib import Path

from gspo.errors import EXIT_USAGE, Interrupted, UserError, WriteFailed


def _quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")  # task.name=dataset reads files
    import transformers
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def command_config(args):
    """The config file given, else the main job shipped in the package (gspo/configs/default.yaml),
    with the overrides applied. (The code defaults of ``TrainConfig`` are only the base that every
    file overrides; the command line never runs them bare.)"""
    from gspo.config import load_config, shipped_config
    return load_config(args.config or shipped_config(), args.overrides)


def _warn(message: str) -> None:
    print(f"gspo: warning: {message}", file=sys.stderr)


def warning_line(message, category, filename: str) -> str:
    """A Python warning as one line in the tool's voice: ``gspo: warning: <text>`` for gspo's own,
    ``gspo: warning (torch): <text>`` naming the library for another's; no path, no source line."""
    text = " ".join(str(message).split())
    parts = Path(filename).parts
    origin = next((parts[i + 1] for i, part in enumerate(parts[:-1])
                   if part in ("site-packages", "dist-packages")), None)
    if origin is None or origin == "gspo":  # gspo itself (installed or a checkout), or the user's
        return f"gspo: warning: {text}"
    return f"gspo: warning ({origin.removesuffix('.py')}): {text}"


@contextlib.contextmanager
def one_line_warnings():
    """Print warnings with ``warning_line`` while a command runs (restored after it)."""
    def show(message, category, filename, lineno, file=None, line=None):
        print(warning_line(message, category, filename), file=file or sys.stderr)
    previous, warnings.showwarning = warnings.showwarning, show
    try:
        yield
    finally:
        warnings.showwarning = previous


def _provenance(cfg, command: str):
    """This process's provenance (gspo.training.provenance) for ``cfg`` on its resolved device."""
    from gspo.models.presets import resolve_device
    from gspo.training import provenance
    return provenance.collect(cfg, command=command, device=str(resolve_device(cfg.model.device)))


def split_config_and_overrides(args) -> None:
    """`gspo train a.yaml k=v` and `gspo train k=v` both work: the config is the arg without '='."""
    items = ([args.config] if args.config else []) + list(args.overrides)
    configs = [x for x in items if "=" not in x]
    if len(configs) > 1:
        raise UserError(f"expected at most one config file, got {configs}")
    args.config = configs[0] if configs else None
    args.overrides = [x for x in items if "=" in x]


# --------------------------------------------------------------------------------- commands
def cmd_train(args) -> int:
    from gspo.observe.outcome import best_line, change_line
    from gspo.observe.report import build_report
    from gspo.tools.preflight import check_rewards, check_train, user_input
    from gspo.training import distributed, provenance
    from gspo.training.rundir import write_faults
    from gspo.training.signals import GracefulStop
    from gspo.training.stability import GuardPause
    from gspo.training.trainer import Trainer
    with user_input():  # preflight: config, files, output folder, data, rewards; no model yet
        if args.resume:
            run_cfg = Path(args.resume) / "config.yaml"
            if not run_cfg.is_file():
                raise UserError(f"--resume {args.resume}: no config.yaml (not a gspo run folder)")
            args.config = str(run_cfg)
        cfg = command_config(args)
        if args.resume:
            cfg.run.dir = args.resume
        check_train(cfg, resume=bool(args.resume))
        ranks = distributed.init_from_env(cfg.dist.timeout_s)  # under torchrun (docs/distributed.md)
        if args.resume:  # another objective definition: exit 2; other code or libraries: warn
            provenance.check(args.resume, _provenance(cfg, "train"), action="resume",
                             warn=_warn if ranks.is_main else lambda m: None)
        trainer = Trainer(cfg, resume=bool(args.resume))
        check_rewards(trainer.rewards, trainer.train_set)
    reported = (f"training finished (summary.json and the final checkpoint are saved): free "
                f"space, then write the report with: gspo report {cfg.run.dir}")
    try:
        with GracefulStop(cfg.run.dir) as trainer.stop, write_faults(cfg.run.dir):
            summary = trainer.run()            # SIGINT/SIGTERM: checkpoint, then exit; disk full: 4
    except GuardPause as pause:                  # (every rank pauses at the same step)
        distributed.shutdown()
        if ranks.is_main:
            with write_faults(cfg.run.dir):
                report = build_report(cfg.run.dir)
            print(f"gspo: paused: {pause} (report: {report})", file=sys.stderr)
        return pause.exit_code
    except BaseException:
        distributed.shutdown(wait=False)          # the other ranks may be anywhere
        raise
    distributed.shutdown()
    if not ranks.is_main:  # rank 0 reports for all
        return 0
    with write_faults(cfg.run.dir, after=reported):
        report = build_report(cfg.run.dir)
    change = summary["accuracy_change"]      # a fall is said to be one (gspo.observe.outcome)
    what = f"{summary['steps']} {summary['objective']} steps"
    print(f"{change_line(change, what)}, {summary['wall_s']:.0f} s")
    best = best_line(summary["best_validation"], change["fell"])
    if best:
        print(best)
    print(f"outputs: {cfg.run.dir}/  (summary.json, metrics.jsonl, {report.name}, tb/, checkpoints/)")
    return 0


def cmd_sft(args) -> int:
    from gspo.models.presets import save_model
    from gspo.tools.preflight import check_files, check_model, user_input
    from gspo.rollout.data import build_task
    from gspo.training.cold_start import initial_policy
    from gspo.training import provenance
    with user_input():
        cfg = command_config(args)
        check_files(cfg)
        check_model(cfg)
        task = build_task(cfg)
        prov = _provenance(cfg, "sft")
        if args.out:
            provenance.write(args.out, prov)
    model, tokenizer, info = initial_policy(cfg, task, log=lambda m: print(m, file=sys.stderr))
    if args.out:
        save_model(model, tokenizer, args.out)
        info["checkpoint"] = args.out
    print(json.dumps({**info, "provenance": provenance.summary(prov)}, indent=1))
    return 0


def cmd_eval(args) -> int:
    from gspo.models.presets import DTYPES, load_model, resolve_device
    from gspo.rollout.data import build_task, eval_examples
    from gspo.rollout.evaluation import evaluate
    from gspo.tools.preflight import check_checkpoint, user_input
    from gspo.training import provenance
    from gspo.rollout import engines, episodes
    with user_input():
        cfg = command_config(args)
        check_checkpoint("--checkpoint", args.checkpoint)
        task = build_task(cfg)
        prov = _provenance(cfg, "eval")
        prov["hub"].update(provenance.hub_ids({"--checkpoint": args.checkpoint}))
        if args.out:
            provenance.write(args.out, prov)
    model, tokenizer = load_model(args.checkpoint, DTYPES[cfg.model.dtype], key="--checkpoint")
    model.to(resolve_device(cfg.model.device))
    tests = eval_examples(task, cfg)
    episode = episodes.build(cfg.rollout.episode, cfg, task)   # multi-turn: whole trajectories
    engine = engines.build("hf", model, tokenizer, sampler=cfg.rollout.sampler)
    result = evaluate(model, tokenizer, task, tests, max_new_tokens=cfg.rollout.max_new_tokens,
                      k=cfg.eval.k, temperature=cfg.eval.temperature,
                      batch_size=cfg.eval.batch_size, seed=cfg.seed, engine=engine, episode=episode)
    out = {"checkpoint": args.checkpoint, "task": cfg.task.name, **result.as_dict(),
           "provenance": provenance.summary(prov)}
    if args.out:
        (Path(args.out) / "eval.json").write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))
    return 0


def cmd_samples(args) -> int:
    from gspo.observe.samples import FILE, format_samples, read_samples
    if not Path(args.run_dir).is_dir():
        raise UserError(f"{args.run_dir}: no such run folder")
    rows = read_samples(args.run_dir, args.step)
    if not rows:
        which = "" if args.step is None else f" of step {args.step}"
        raise UserError(f"{args.run_dir}: no samples{which} in {FILE} (run.samples_every: every "
                        f"how many steps a run writes them)")
    print(format_samples(rows))
    return 0


def cmd_compare(args) -> int:
    from gspo.tools.compare import run_suite
    from gspo.tools.preflight import user_input
    with user_input():
        if not Path(args.suite).is_file():
            raise UserError(f"{args.suite}: no such suite file")
    only = args.variants.split(",") if args.variants else None
    if args.jobs < 1 or args.seeds < 1:
        raise UserError(f"--jobs and --seeds must be >= 1, got {args.jobs}, {args.seeds}")
    out = run_suite(args.suite, seeds=args.seeds, quick=args.quick, out=args.out,
                    extra=args.extra, only=only, tune=not args.no_tune, jobs=args.jobs,
                    allow_mixed_commits=args.allow_mixed_commits, report_only=args.report_only)
    print(f"comparison: {out}/report.md  ({out}/results.json, {out}/plots/)")
    return 0


def cmd_audit(args) -> int:
    from gspo.config import load_config
    from gspo.tools.audit import EXIT_MISMATCH, Tolerances, run_audit
    from gspo.training import provenance
    if not Path(args.run_dir).is_dir():
        raise UserError(f"{args.run_dir}: no such run folder")
    run_cfg = Path(args.run_dir) / "config.yaml"
    if run_cfg.is_file():  # the run's objective under the present registry vs the one it recorded
        now = provenance.collect(load_config(run_cfg), command="audit", device="cpu")  # audits: CPU
        provenance.check(args.run_dir, now, action="audit", warn=_warn)
    tol = Tolerances(logp=args.tol, ratio=args.tol) if args.tol is not None else Tolerances()
    return 0 if run_audit(args.run_dir, args.step, tol) else EXIT_MISMATCH


def cmd_mechanism(args) -> int:
    from gspo.tools import mechanism
    from gspo.tools.preflight import user_input
    with user_input():  # the run folder / checkpoint and its config are the user's
        if not Path(args.target).exists():
            raise UserError(f"{args.target}: no such run folder or checkpoint")
        if args.seeds < 1 or args.prompts < 1:
            raise UserError(f"--seeds and --prompts must be >= 1, got {args.seeds}, {args.prompts}")
        cfg, model, tokenizer = mechanism.load_target(args.target, args.config, args.overrides)
    axes = tuple(args.axes.split(",")) if args.axes else None
    results = mechanism.measure(cfg, model, tokenizer, seeds=tuple(range(args.seeds)),
                                prompts=args.prompts, axes=axes,
                                log=lambda m: print(m, file=sys.stderr))
    results["target"] = str(args.target)
    out = args.out or str(Path(args.target) / "mechanism")
    print(f"mechanism: {mechanism.write(results, out)}  ({out}/mechanism.json)")
    return 0


def cmd_report(args) -> int:
    from gspo.observe.report import build_report
    from gspo.tools.preflight import user_input
    if not Path(args.run_dir).is_dir():
        raise UserError(f"{args.run_dir}: no such run folder")
    with user_input():  # reads only the user's run folder
        print(build_report(args.run_dir))
    return 0


# --------------------------------------------------------------------------------- parser
def config_fields_help(width: int) -> str:
    """Every config field of ``gspo train`` as ``key=default`` and its one-line docstring,
    grouped by section and wrapped to ``width`` (the tail of ``gspo train --help``)."""
    import textwrap
    from gspo.config.reference import field_docs, section_docs
    sections, col = section_docs(), 34
    lines = textwrap.wrap("config fields (YAML keys, or key=value overrides on the command "
                          "line; explained in docs/*.md):", width)
    current = None
    for key, default, doc in field_docs():
        section, _, rest = key.partition(".")
        if not rest:
            section, rest = "", key
        if section != current:
            current = section
            head = f"{section}: {sections.get(section, '')}" if section else "top level:"
            lines += [""] + textwrap.wrap(head, width, subsequent_indent="  ")
        left = f"  {rest}={default}" if default else f"  {rest}"
        body = textwrap.wrap(doc, max(width - col, 30)) or [""]
        if len(left) >= col - 1:
            lines += [left] + [" " * col + b for b in body]
        else:
            lines += [left.ljust(col) + body[0]] + [" " * col + b for b in body[1:]]
    return "\n".join(lines) + "\n"


class ConfigHelpParser(argparse.ArgumentParser):
    """A command's parser whose --help ends with the config fields (imported only then, so that
    ``gspo --help`` stays light)."""

    def format_help(self) -> str:
        import shutil
        text = super().format_help()
        if not getattr(self, "lists_config", False):
            return text
        return f"{text}\n{config_fields_help(min(shutil.get_terminal_size().columns, 120))}"


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", help="YAML config (default: the main job, "
                   "the package's copy of configs/default.yaml)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=50 seed=1")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gspo", description="GSPO and friends: RL of language models with verifiable rewards.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=ConfigHelpParser)
    p = sub.add_parser("train", help="cold start (SFT) then RL, with held-out evaluation",
                       description="Train a policy: SFT cold start (cached), then RL with the "
                                   "configured objective. Example: gspo train configs/default.yaml "
                                   "objective.name=grpo seed=1")
    _add_config_args(p)
    p.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its last checkpoint")
    p.lists_config = True
    p.set_defaults(fn=cmd_train)
    p = sub.add_parser("sft", help="only the cold-start SFT stage (cached by config)",
                       description="Run (or reuse) the cold-start SFT and print where it is.")
    _add_config_args(p)
    p.add_argument("--out", help="also save the SFT model to this directory (and, at the start, "
                                 "OUT/provenance.json)")
    p.set_defaults(fn=cmd_sft)
    p = sub.add_parser("eval", help="held-out accuracy / pass@k of any checkpoint",
                       description="Evaluate a checkpoint on the configured task's test split.")
    _add_config_args(p)
    p.add_argument("--checkpoint", required=True, help="transformers checkpoint directory")
    p.add_argument("--out", help="also write OUT/provenance.json (at the start) and OUT/eval.json")
    p.set_defaults(fn=cmd_eval)
    p = sub.add_parser("report", help="rebuild report.md and plots of a run",
                       description="Rebuild RUN_DIR/report.md and RUN_DIR/plots/*.png from its metrics.")
    p.add_argument("run_dir")
    p.set_defaults(fn=cmd_report)
    p = sub.add_parser("samples", help="print what the model wrote (samples.jsonl)",
                       description="Print RUN_DIR/samples.jsonl readably: each sampled prompt with its "
                                   "G completions, rewards, advantages, ratio and clip share.")
    p.add_argument("run_dir")
    p.add_argument("--step", type=int, help="only this step (-1: the last written; default: all)")
    p.set_defaults(fn=cmd_samples)
    p = sub.add_parser("compare", help="equal-budget comparison of variants over seeds",
                       description="Train each variant x seed of SUITE.yaml at the same budget "
                                   "(reusing finished runs), then write results.json, report.md "
                                   "and plots/. Example: gspo compare configs/compare/dense.yaml "
                                   "--seeds 3")
    p.add_argument("suite", help="suite YAML (configs/compare/*.yaml)")
    p.add_argument("extra", nargs="*", metavar="key=value",
                   help="overrides shared by every variant (applied after --quick's)")
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..K-1 per variant (default 3)")
    p.add_argument("--quick", action="store_true", help="apply the suite's quick budget")
    p.add_argument("--out", help="output folder (default runs/compare/<suite>[-quick])")
    p.add_argument("--variants", help="comma-separated subset of the suite's variants")
    p.add_argument("--jobs", type=int, default=1,
                   help="runs at a time, each in a worker process with cores/jobs threads (default 1)")
    p.add_argument("--no-tune", action="store_true",
                   help="skip the suite's validation grid: every variant at its paper defaults")
    p.add_argument("--allow-mixed-commits", action="store_true",
                   help="tabulate runs made by different code (git commit or uncommitted changes); "
                        "refused by default")
    p.add_argument("--report-only", action="store_true",
                   help="train nothing: rewrite results.json, report.md and plots from the finished "
                        "runs (e.g. after a change to the report code)")
    p.set_defaults(fn=cmd_compare)
    p = sub.add_parser("audit", help="recompute the recorded steps of a run (audit.every=K)",
                       description="Reload π_old / π_new of recorded steps and recompute old "
                                   "log-probs, sequence ratios, clip decisions and loss; check mask, "
                                   "EOS, padding and length normalisation. Exit 0 when all agree, "
                                   "1 naming the step and field that does not.")
    p.add_argument("run_dir")
    p.add_argument("--step", type=int, help="audit only this recorded step (default: all)")
    p.add_argument("--tol", type=float, help="tolerance on log-probs and ratios (default 1e-4)")
    p.set_defaults(fn=cmd_audit)
    p = sub.add_parser("mechanism", help="gradient noise of token vs sequence importance weights",
                       description="Hold a sampled batch of TARGET's policy fixed, move the policy "
                                   "k optimizer steps (and, on a MoE, change its routing with "
                                   "router noise), and measure each objective's minibatch gradient "
                                   "signal-to-noise, its cosine to the full-batch gradient and the "
                                   "ratio dispersion (docs/mechanism.md). Example: gspo mechanism "
                                   "runs/default --seeds 5")
    p.add_argument("target", help="run folder (its config.yaml and latest checkpoint) or checkpoint directory")
    p.add_argument("overrides", nargs="*", help="dotted overrides of the run's config, e.g. rollout.group_size=4")
    p.add_argument("--config", help="config of a checkpoint outside a run folder (e.g. configs/default.yaml)")
    p.add_argument("--seeds", type=int, default=5, help="batches 0..K-1, one per seed (default 5)")
    p.add_argument("--prompts", type=int, default=4, help="prompts per batch, each rollout.group_size responses (default 4)")
    p.add_argument("--axes", help="comma-separated: steps, routing (default: steps, and routing on a MoE)")
    p.add_argument("--out", help="output folder (default TARGET/mechanism)")
    p.set_defaults(fn=cmd_mechanism)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _quiet_libraries()
    try:
        with one_line_warnings():
            if hasattr(args, "overrides"):
                split_config_and_overrides(args)
            return args.fn(args)
    except UserError as err:  # the user's to fix wherever raised (ConfigError, RewardError,
        # AuditError...); a ValueError or OSError is one only inside user_input() (preflight)
        print(f"gspo: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except Interrupted as stop:
        print(f"gspo: {stop}", file=sys.stderr)
        return stop.exit_code
    except WriteFailed as fault:            # a full disk mid-run: what, where, how to resume
        print(f"gspo: error: {fault}", file=sys.stderr)
        return fault.exit_code
    except KeyboardInterrupt:
        print("gspo: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
