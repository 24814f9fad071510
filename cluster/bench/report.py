"""Benchmark results into the user docs: each benchmark owns one section of `docs/benchmarks.md`,
between markers, and rewrites it with its current figures and where they come from (the command, the
machine, the date, the commit). The page holds the current results only; earlier ones are in git.

A benchmark's results file carries that provenance (`provenance`), so `pdserve bench report
RESULTS.json --docs PAGE` renders the same section later from the file, and a run with `--docs PAGE`
does it at once. A `--quick` run is marked a smoke test: its ratios are no measurement.
"""

from __future__ import annotations

import hashlib
import importlib
import re
import shlex
import shutil
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pdserve.cluster.plan.costs import machine

# Section key -> (title, the module whose `markdown(results)` renders it); the page's order.
# What a `--quick` run's figures are worth, said on its section of the page and beside its console summary.
SMOKE_CAVEAT = "too few requests for its figures or ratios to mean anything; run without `--quick` for a measurement."

SECTIONS: dict[str, tuple[str, str]] = {
    "engine": ("The engine against transformers' `generate`", "pdserve.cluster.bench.engine"),
    "spec": ("Speculative decoding", "pdserve.cluster.bench.spec"),
    "draft-kv": ("Speculative decoding, disaggregated: the draft model's prompt KV", "pdserve.cluster.bench.draft_kv"),
    "kv": ("KV transfer: transports and codecs", "pdserve.cluster.bench.kv"),
    "cluster": ("Disaggregated against colocated at low load", "pdserve.cluster.bench.cluster"),
    "serve": ("Serving under load: goodput", "pdserve.cluster.bench.serve"),
    "serve-long-prompts": ("Serving under load: goodput on long prompts", "pdserve.cluster.bench.serve"),
    "simulator": ("The cluster simulator against measured runs", "pdserve.cluster.bench.simulator"),
    "simulator-spec": ("The cluster simulator's speculative decoding against the engine's",
                       "pdserve.cluster.bench.simulator_spec"),
    "policies": ("Placement policies side by side", "pdserve.cluster.bench.policies"),
    "overload": ("Overload: a burst far past capacity", "pdserve.cluster.bench.overload"),
    "soak": ("Soak: kills, corruption and a cancel storm", "pdserve.cluster.bench.soak"),
    "migration": ("Live migration: a running request moved with its KV", "pdserve.cluster.bench.migration"),
    "replanning": ("The online planner against static splits on a shifting mix", "pdserve.cluster.bench.replanning"),
    "epd": ("An encode pool for images (EPD) against encoding in prefill", "pdserve.cluster.bench.epd"),
}
HEADER = ("# Benchmarks\n\nThe current results of every benchmark, each written by the benchmark itself "
          "(`pdserve bench ... --docs docs/benchmarks.md`, or `pdserve bench report RESULTS.json --docs "
          "docs/benchmarks.md` from a results file), with the command, machine, date and commit that made it. "
          "Earlier results are in git history and in CHANGELOG.md.\n")


def _begin(key: str) -> str:
    return f"<!-- pdserve bench {key}: written by the benchmark; edits here are overwritten -->"


def _end(key: str) -> str:
    return f"<!-- end pdserve bench {key} -->"


def provenance(quick: bool = False) -> dict[str, Any]:
    """Where a run's figures come from: put into its results file."""
    program = Path(sys.argv[0]).name
    command = shlex.join(["pdserve" if program in ("pdserve", "cli.py") else program, *sys.argv[1:]])
    return {"command": command, "machine": machine(), "commit": commit(), "smoke": quick,
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def commit() -> str:
    """The checkout's commit (with "+ local changes" when it has some); "" outside a git checkout."""
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short=10", "HEAD"], cwd=here, capture_output=True, text=True,
                              timeout=10)
        if head.returncode != 0:
            return ""
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return head.stdout.strip() + (" + local changes" if dirty else "")


def section(key: str, results: dict[str, Any], images: list[str] = ()) -> str:
    """A benchmark's section: its title, provenance and figures (its module's `markdown`), then
    `images` (paths relative to the page)."""
    title, module = SECTIONS[key]
    p = results["provenance"]
    lines = [f"## {title}", "", f"`{p['command']}` on {p['machine']}, {p['date']}, commit "
             f"{p['commit'] or 'unknown (not run from a git checkout)'}."]
    if p.get("smoke"):
        lines += ["", f"**A smoke run (`--quick`)**: {SMOKE_CAVEAT}"]
    body = importlib.import_module(module).markdown(results)
    pictures = [f"![{Path(image).stem.removeprefix(key + '-').replace('_', ' ')}]({image})" for image in images]
    return "\n".join([*lines, "", body.strip(), *([""] + pictures if pictures else []), ""])


def publish(page: Path, key: str, results: dict[str, Any]) -> None:
    """Write `key`'s section into `page` (made if missing), in place of the one there, keeping the
    sections' order; the run's plots (`plots` in its results, where they still are) are copied beside
    the page, into img/, and shown in the section."""
    text = page.read_text() if page.exists() else HEADER
    plots = {f"img/{key}-{Path(p['path']).name}": Path(p["path"]) for p in results.get("plots", [])
             if Path(p["path"]).is_file() and _sha256(Path(p["path"])) == p["sha256"]}  # the run's own, still there
    block = f"{_begin(key)}\n{section(key, results, list(plots))}{_end(key)}\n"
    for image, plot in plots.items():
        (page.parent / "img").mkdir(parents=True, exist_ok=True)
        shutil.copyfile(plot, page.parent / image)
    pattern = re.compile(re.escape(_begin(key)) + r".*?" + re.escape(_end(key)) + r"\n?", re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text, count=1)
    else:  # before the first section that comes after it on the page, else at the end
        later = [k for k in list(SECTIONS)[list(SECTIONS).index(key) + 1:] if _begin(k) in text]
        at = text.index(_begin(later[0])) if later else len(text)
        text = text[:at].rstrip("\n") + "\n\n" + block + ("\n" + text[at:] if later else "")
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(text)


def key_of(results: dict[str, Any]) -> str:
    """The section a results file belongs to (its `benchmark`)."""
    key = results.get("benchmark")
    if key in SECTIONS and "provenance" in results:
        return key
    if key in SECTIONS or str(key).startswith("pdserve bench"):
        raise ValueError("the results file has no provenance (made by an older pdserve): run the benchmark again")
    raise ValueError(f"not a results file of a pdserve benchmark (benchmark {key!r}; known: {', '.join(SECTIONS)})")


def plot_record(path: Path) -> dict[str, str]:
    """A plot as a results file names it: where it is and what it held, so that a later run's plot in
    the same place is not shown for this one."""
    return {"path": str(path.resolve()), "sha256": _sha256(path)}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
