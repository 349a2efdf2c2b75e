"""Data checks before training: every example encodes with the model's tokenizer and fits its context.

``prepare_task(task, cfg)`` runs once, before any model is built, on both splits:

* a prompt or demonstration with characters the tokenizer cannot encode (they would silently
  become ``<unk>``, e.g. non-ASCII text with the character tokenizer) is bad;
* a prompt whose tokens plus the response budget (``rollout.max_new_tokens``, or the
  demonstration + EOS when longer) exceed the model's context (``max_position_embeddings``) is bad.

With ``data.on_error: fail`` the first bad example stops the run, named by ``file:line`` (custom
JSONL) or split and index (built-in tasks). With ``skip`` bad examples are left out, counted and
listed in ``task.data_report`` (logged, and written to summary.json under ``data``); a split left
empty is an error either way. JSONL parse errors (bad JSON, missing or empty prompt, wrong types)
are found by ``tasks.custom`` under the same policy and land in the same report.

The checks use the tokenizer the policy will use (``tokenizer_and_context``: ``model.tokenizer``
of a preset, trained on the training split for bpe; under ``task.chat`` with the template's
end-of-turn token as EOS), and run on the prompts as the model sees them (``task.chat``:
rendered by ``gspo.rollout.chat``). The returned task also guards ``reward`` / ``is_correct``
(``gspo.rewards.isolation.IsolatedTask``) and carries that tokenizer as ``.tokenizer``.
This module reads and checks data; it does not generate it.
"""

from __future__ import annotations

import sys
import warnings

from transformers import AutoConfig, AutoTokenizer

from gspo import tasks
from gspo.envs.tools import tool_schemas
from gspo.errors import UserError
from gspo.rollout.chat import ChatTask, renders_tools
from gspo.hub import local_path
from gspo.models.presets import preset_config
from gspo.rewards.isolation import IsolatedTask, isolation_options, sandbox_limits
from gspo.rewards.sandbox import SandboxedFunction
from gspo.tasks import Example, TaskDataError
from gspo.tasks.base import SPLITS, pick_split
from gspo.rollout.tokenization import preset_tokenizer, use_end_of_turn

MAX_LISTED = 20  # skipped examples listed by name in the report (all are counted)


def tokenizer_and_context(cfg, train: list[Example] = ()):
    """The tokenizer the policy will use and its context length, without building the model.

    A preset's tokenizer is ``model.tokenizer`` (bpe: trained on the ``train`` examples). Under
    ``task.chat`` its EOS is the chat template's end-of-turn token; a tokenizer without a
    template is a UserError."""
    if cfg.model.path:
        path = local_path(cfg.model.path)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    else:
        tokenizer = preset_tokenizer(cfg.model.tokenizer, list(train), cfg.model.tokenizer_vocab)
        config = preset_config(cfg.model.preset, len(tokenizer), cfg.model.overrides)
    if cfg.task.chat:
        try:
            use_end_of_turn(tokenizer)
        except ValueError as err:
            source = f"model.path {cfg.model.path}" if cfg.model.path else f"model.tokenizer={cfg.model.tokenizer}"
            raise UserError(f"task.chat: true: {err} ({source})") from None
    return tokenizer, getattr(config, "max_position_embeddings", None)


def _unencodable(tokenizer, text: str, ids: list[int]) -> str | None:
    """The characters of ``text`` that map to the unknown token, if any."""
    unk = tokenizer.unk_token_id
    if unk is None or unk not in ids or (tokenizer.unk_token and tokenizer.unk_token in text):
        return None
    bad = [ch for ch in dict.fromkeys(text)
           if unk in tokenizer(ch, add_special_tokens=False)["input_ids"]]
    return "".join(bad) or "?"


def example_problems(examples: list[Example], tokenizer, context: int | None,
                     max_new_tokens: int) -> dict[int, str]:
    """index -> reason, for examples the tokenizer cannot encode or the context cannot hold."""
    if not examples:
        return {}
    prompts = tokenizer([ex.prompt for ex in examples])["input_ids"]  # with BOS, as in rollouts
    answers = tokenizer([ex.answer for ex in examples], add_special_tokens=False)["input_ids"]
    problems = {}
    for i, (ex, p, a) in enumerate(zip(examples, prompts, answers)):
        for field, text, ids in (("prompt", ex.prompt, p), ("answer", ex.answer, a)):
            if (bad := _unencodable(tokenizer, text, ids)) is not None:
                problems[i] = f"{field} has characters the tokenizer cannot encode: {bad!r}"
                break
        else:
            response = max(max_new_tokens, len(a) + 1)
            if context is not None and len(p) + response > context:
                problems[i] = (f"prompt of {len(p)} tokens + {response} response tokens "
                               f"(rollout.max_new_tokens or answer + EOS) exceed the model's "
                               f"context of {context}")
    return problems


class CheckedTask(IsolatedTask):
    """A guarded task whose splits hold only the examples that passed the checks."""

    def __init__(self, task, splits: dict[str, list[Example]], report: dict, **guard):
        super().__init__(task, **guard)
        self._checked, self.data_report = splits, report

    def split(self, name: str) -> list[Example]:
        return pick_split(self.inner.name, self._checked, name)


def _split_or_empty(task, split: str) -> list[Example]:
    """``task.split(split)``; a task without a validation split (a plugin, a custom task without
    task.validation_file) has an empty one, refused only when evaluation asks for it."""
    try:
        return task.split(split)
    except ValueError:
        if split == "validation":
            return []
        raise


def _where(task, split: str, i: int, ex: Example) -> tuple[str, int | None]:
    locations = getattr(task, "locations", None)
    if locations:
        return locations[split][i]
    return f"task {task.name} {split} example {i + 1} ({ex.prompt[:40]!r})", None


def prepare_task(task, cfg, log=None, tokenizer_context=None) -> CheckedTask:
    """Check both splits against the tokenizer and context; apply ``data.on_error``.

    ``tokenizer_context``: (tokenizer, context) already built (``tokenizer_and_context``); the
    checked task keeps the tokenizer as ``.tokenizer`` for the policy to use."""
    log = log or (lambda msg: print(msg, file=sys.stderr))
    tokenizer, context = tokenizer_context or tokenizer_and_context(cfg, _split_or_empty(task, "train"))
    skip = cfg.data.on_error == "skip"
    listed = list(getattr(task, "skipped", []))  # JSONL rows the task itself refused
    splits, counts = {}, {}
    for split in SPLITS:
        examples = _split_or_empty(task, split)
        problems = example_problems(examples, tokenizer, context, cfg.rollout.max_new_tokens)
        for i, reason in problems.items():
            file, line = _where(task, split, i, examples[i])
            if not skip:
                raise TaskDataError(file, line, f"{reason} (data.on_error=fail; skip drops such examples)")
            listed.append(str(TaskDataError(file, line, reason)))
        splits[split] = [ex for i, ex in enumerate(examples) if i not in problems]
        counts[split] = {"kept": len(splits[split]), "skipped": len(problems)}
        if not splits[split] and (examples or split != "validation"):
            raise UserError(f"task {task.name}: every {split} example was skipped ({len(problems)}); "
                            f"first: {listed[-1] if listed else '?'}")
    parsed = len(getattr(task, "skipped", []))
    report = {"on_error": cfg.data.on_error, "splits": counts, "skipped_rows": parsed,
              "skipped_total": parsed + sum(c["skipped"] for c in counts.values()),
              "skipped": listed[:MAX_LISTED]}
    if report["skipped_total"]:
        log(f"data: skipped {report['skipped_total']} bad example(s) (data.on_error=skip; "
            f"{parsed} unparsable rows, {counts['train']['skipped']} train / "
            f"{counts['test']['skipped']} test examples failing the tokenizer/context check); "
            f"first: {listed[0]} (counts and the first {MAX_LISTED} in summary.json, 'data')")
    checked = CheckedTask(task, splits, report, **isolation_options(cfg.rewards))
    checked.tokenizer = tokenizer
    return checked


def eval_examples(task, cfg) -> list[Example]:
    """The first ``eval.n`` examples of the split ``eval.split`` names; an empty one is refused."""
    examples = task.split(cfg.eval.split)
    if not examples:
        hint = ("set task.validation_file" if cfg.task.name in FILE_TASKS else
                "set task.n_val (validation prompts to draw)")
        raise UserError(f"eval.split={cfg.eval.split}: the task has no {cfg.eval.split} examples; {hint}")
    return examples[:cfg.eval.n] if cfg.eval.n else examples


# Tasks read from files (task.train_file ...) -> the task keys they take besides the common ones.
FILE_TASKS = {"custom": (), "dataset": ("columns", "chat", "dataset", "dataset_config", "splits")}
DEFAULT_N_VAL = 200  # validation prompts a built-in task draws when eval.split=validation


def described_tools(cfg) -> list[dict] | None:
    """The JSON schemas of the run's tools, for chat prompts (``tools=``), when they are shown."""
    m = cfg.multiturn
    if m.env != "tools" or not m.tools or not m.tools_in_prompt:
        return None
    return tool_schemas(m.tools)


def build_task(cfg) -> CheckedTask:
    """The configured task, its data checked (``prepare_task``)."""
    t = cfg.task
    if t.name in FILE_TASKS:
        limits = sandbox_limits(cfg.rewards)         # rewards.sandbox: the task's reward too
        reward_fn = SandboxedFunction(t.reward, limits) if limits and t.reward else None
        task = tasks.build(t.name, train_file=t.train_file, test_file=t.test_file,
                           validation_file=t.validation_file,
                           reward=t.reward, correct_threshold=t.correct_threshold,
                           on_error=cfg.data.on_error, reward_fn=reward_fn,
                           **{k: getattr(t, k) for k in FILE_TASKS[t.name]})
    else:
        n_val = t.n_val if t.n_val is not None else DEFAULT_N_VAL if cfg.eval.split == "validation" else 0
        sizes = {k: v for k, v in (("n_train", t.n_train), ("n_test", t.n_test)) if v is not None}
        try:
            task = tasks.build(t.name, seed=cfg.seed, **sizes, **({"n_val": n_val} if n_val else {}),
                               **t.params)
        except (ValueError, TypeError) as err:  # the generator's options come from task.params
            raise UserError(f"task.params: {err}") from None
    sft = getattr(cfg, "sft", None)
    if sft is not None and sft.enabled and getattr(task, "no_reference", None):  # reasoning_gym
        raise UserError(f"task {t.name}: {', '.join(task.no_reference)} has no reference answers to "
                        f"demonstrate; set sft.enabled=false")
    tokenizer_context = tokenizer_and_context(cfg, task.split("train"))
    if t.chat:
        tools = described_tools(cfg)
        if tools and not renders_tools(tokenizer_context[0], tools, t.chat_template_kwargs):
            warnings.warn("multiturn.tools_in_prompt: the chat template does not render tools= "
                          "(no tools block): the model is not told the tools exist")
        task = ChatTask(task, tokenizer_context[0], t.system_prompt, t.chat_template_kwargs, tools)
    return prepare_task(task, cfg, tokenizer_context=tokenizer_context)
