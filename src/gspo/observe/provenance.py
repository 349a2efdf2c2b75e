"""A run's provenance file read back: ``RUN/provenance.json`` and its table in report.md.

What produced a run (code, libraries, hardware, the objective's registry entry, advantage,
sampling, config hash) is collected, written and checked by ``gspo.training.provenance``; this
module only reads the file and formats it, so that the report needs nothing from training.
"""

from __future__ import annotations

import json
from pathlib import Path

from gspo.errors import UserError

FILE = "provenance.json"


def read(folder: str | Path) -> dict | None:
    """``folder/provenance.json`` (None when absent); a file that cannot be read is a UserError."""
    path = Path(folder) / FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"{path}: unreadable provenance ({err})") from None


def sessions(prov: dict) -> list[dict]:
    """The run's sessions, oldest first (a resumed run has several)."""
    return [*prov.get("history", []), {k: v for k, v in prov.items() if k != "history"}]


def code_id(prov: dict | None) -> str:
    """One string per distinct code: the commit, plus the diff's hash when the source was dirty."""
    if prov is None:
        return "unknown (no provenance.json)"
    c = prov.get("code", {})
    if c.get("commit", "unknown") == "unknown":
        return f"unknown (gspo {c.get('gspo')})"
    dirty = f"+dirty:{(c.get('diff_sha256') or '?')[:12]}" if c.get("dirty") else ""
    return c["commit"][:12] + dirty


def summary(prov: dict) -> str:
    """'gspo 0.1.0 at <commit>[+dirty:<diff>]' in one line."""
    return f"gspo {(prov.get('code') or {}).get('gspo')} at {code_id(prov)}"


def table(prov: dict | None) -> list[str]:
    """Markdown lines: the provenance in a short table (report.md)."""
    if prov is None:
        return [f"No {FILE} (a run made before gspo recorded provenance)."]
    c, lib = prov["code"], prov.get("libraries", {})
    rows = [("code", f"gspo {c.get('gspo')}, commit `{c.get('commit')}`"
             + (f" (dirty: source differs, diff sha256 `{c['diff_sha256'][:12]}`)"
                if c.get("dirty") else " (clean)" if c.get("dirty") is False else "")
             + ("" if c.get("commit") != "unknown" else f": {c.get('source')}")),
            ("libraries", ", ".join(f"{k} {v}" for k, v in lib.items()
                                    if v is not None and k not in ("cudnn",)))]
    if hw := prov.get("hardware"):
        rows.append(("hardware", f"{hw['device']} ({hw['dtype']}), {hw['world_size']} rank(s); "
                                 f"CPU {hw['cpu']}" + (f"; GPU {hw['gpu']}" if hw["gpu"] else "")))
    if o := prov.get("objective"):
        if o.get("registry"):
            hp = ", ".join(f"{k}={v}" for k, v in o["hyperparameters"].items()
                           if k != "aggregation")
            rows += [("objective", f"{o['name']}: {o['equations']}"),
                     ("in force", f"{o['aggregation']}, {hp}"), ("paper", o["paper"])]
        else:
            rows.append(("objective", f"{o['name']} ({o['algorithm']}: no policy-gradient loss)"))
    if a := prov.get("advantage"):
        rows.append(("advantage", a["formula"]))
    if s := prov.get("sampling"):
        r = s["rollout"]
        rows.append(("sampling", f"T={r['temperature']}, top_p={r['top_p']}, top_k={r['top_k']}, "
                                 f"max_new_tokens={r['max_new_tokens']}, G={r['group_size']}"))
    if "config_sha256" in prov:
        rows.append(("config sha256", f"`{prov['config_sha256'][:16]}`"))
    if prov.get("history"):
        rows.append(("sessions", " -> ".join(code_id(s) for s in sessions(prov))))
    return ["| | |", "|---|---|", *[f"| {k} | {_cell(v)} |" for k, v in rows]]


def _cell(text: str) -> str:
    """A markdown table cell: its own pipes escaped."""
    return text.replace("|", "\\|")
