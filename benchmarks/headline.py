"""The headline (issue 43): every method in every scenario from one frozen protocol file, at one recorded commit.

For each scenario of benchmarks/headline.yaml: the sweep (`python -m autocompress.sweep`, reused when its run is
finished, resumed when it was interrupted), then `python -m autocompress.compare` on it with the protocol's methods,
seeds, held-out test split and unseen benchmark items; each step is the CLI a user runs, in a subprocess. Then
`benchmarks/results/headline/<scenario>.json`: the commit, the items (which subsets were left out, which tasks are
reported apart and why), the seeds, per method its parameters, benchmark average, test-split KL and perplexity after
distillation, its runner-up by its own selection score (distilled and scored alike: pick noise) and its
budget (seconds to its pick), and AutoCompress minus each method with its 95% interval (a
bootstrap over items and seeds).

Run it from a separate `git worktree` at the commit to report, so other work cannot change it midway; it refuses a
tree with uncommitted changes (the commit would not be what ran). The long runs are resumable: rerun the same command;
a stage an earlier run built keeps the seconds its line in `<scenario>.log` gives. `--rerecord --scenario S` writes S's
JSON again with this file's record (for a JSON an older headline.py wrote), keeping its commit and protocol; `--table`
writes docs/results.md's table from the JSONs.

    git worktree add ../headline HEAD && cd ../headline
    PYTHONPATH=$PWD ../main/.venv/bin/python benchmarks/headline.py --scenario rtx5070_coding

A scenario takes about 7 hours on 2 cores, longer than a machine may be kept. Before it goes, `--carry-out DIR
--scenario S` copies S's small files (a finished sweep run, the comparison's records and scores, the unpruned model's
evaluation, the log's stage lines; no checkpoint) to DIR/S/ with a manifest of the commit and the machine; commit DIR
(in main: benchmarks/results/headline/carry). On the next machine, in a worktree at the same commit, `--carry-in DIR`
puts them back and the run goes on: scored seeds are not distilled again, picked baselines are sliced again from their
records (compare's own rule), an unfinished sweep starts again. The JSON names every machine in `carried`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import common  # checks that the autocompress imported is this tree's
import pandas as pd
import yaml

from autocompress.config import cpuinfo
from autocompress.io import RunPaths, staged, write_text

ROOT = Path(__file__).resolve().parents[1]
RERUN = "rerun to go on from the finished stages"  # what a failed stage's error line adds
PROTOCOL = ROOT / "benchmarks" / "headline.yaml"
RUN_ID = "headline"
MEASURES = ("average", "test_kl", "test_ppl")  # the three ways quality is reported (issue 43 item 4)


def protocol(path: Path) -> dict[str, Any]:
    """The protocol file, checked: scenarios, overrides, compare (lists of Hydra overrides), apart (task -> why)."""
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict) or not data.get("scenarios"):
        raise SystemExit(f"error: {path} names no scenarios; it needs scenarios, overrides, compare and apart")
    for key in ("overrides", "compare"):
        if not isinstance(data.get(key, []), list):
            raise SystemExit(f"error: {path}: {key} must be a list of Hydra overrides")
    apart = data.get("apart") or {}
    tasks = next((o.split("=", 1)[1] for o in data["compare"] if o.startswith("evaluate.tasks=")), "")
    for task in apart:
        if task in tasks.strip("[]").split(","):
            raise SystemExit(f"error: {path}: {task} is both in evaluate.tasks and reported apart; drop it from one")
    return {"overrides": [], "compare": [], **data, "apart": apart}


def commit(allow_dirty: bool) -> str:
    """The commit the code runs at; refused when tracked files differ from it (what ran would not be that commit)."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True).stdout
    if dirty.strip() and not allow_dirty:
        raise SystemExit(f"error: {ROOT} has uncommitted changes; run the headline from a clean worktree (git worktree add)")
    return head + ("-dirty" if dirty.strip() else "")


def sweep_state(run_dir: Path) -> str:
    """complete, interrupted (resume it), or missing (start it)."""
    meta = RunPaths(run_dir).metadata_file
    if not meta.exists():
        return "missing"
    return "complete" if json.loads(meta.read_text()).get("status") == "complete" else "interrupted"


def _runner_up(frame: pd.DataFrame, key: str) -> dict[str, Any] | None:
    """The runner-up's row of compare.parquet in the headline's fields (None where the method had no second candidate)."""
    if key not in frame.index:
        return None
    row = frame.loc[key]
    fields = {"params": int(row["params"]), "average": float(row["average"]), "label": str(row["label"])}
    return fields | {k: float(row[k]) for k in ("test_kl", "test_ppl", "kl_pruned") if k in row}


BUILT = re.compile(r"^\[autocompress\] (?P<stage>\S+): (?P<seconds>\d+)s -> ", re.MULTILINE)  # compare's line for a built stage


def built_seconds(log: Path) -> dict[str, float]:
    """Seconds each compare stage took when it was built, from the scenario's log (`<stage>: <N>s -> <target>`; a rerun
    that reuses the stage says `reusing` instead), so a pick's cost survives the headline's restarts. An attempt
    that was interrupted prints no such line and is not counted; a stage built twice counts its last build."""
    if not log.exists():
        return {}
    return {m["stage"]: float(m["seconds"]) for m in BUILT.finditer(log.read_text(errors="replace").replace("\r", "\n"))}


def record(
    scenario: str, compare_dir: Path, proto: dict[str, Any], code: str, seconds: dict[str, float], log: Path, run_dir: Path
) -> dict[str, Any]:
    """The headline JSON of one scenario, from compare's outputs (compare.json, compare.parquet); the seconds of stages
    an earlier run built come from `log`, the sweep's from its run folder."""
    summary = json.loads((compare_dir / "compare.json").read_text())
    frame = pd.read_parquet(compare_dir / "compare.parquet").set_index("model")
    built = built_seconds(log)
    stage_seconds = {k: built.get(k, v) if v == "reused" else v for k, v in summary.get("seconds", {}).items()}
    methods: dict[str, Any] = {}
    for name in summary["methods"]:
        row = frame.loc[name]
        pick = [k for k in stage_seconds if k.startswith(f"{name}/") and ("pruned" in k or "probe" in k)]
        methods[name] = {
            "params": int(row["params"]),
            "average": float(row["average"]),
            "test_kl": float(row["test_kl"]) if "test_kl" in row else None,
            "test_ppl": float(row["test_ppl"]) if "test_ppl" in row else None,
            "kl_pruned": float(row["kl_pruned"]),
            "label": str(row["label"]),
            "runner_up": _runner_up(frame, f"{name}/runner_up"),  # by the method's own selection score (compare.runner_up)
            "budget": {
                "pick_seconds": {k: stage_seconds[k] for k in pick},  # "reused": an earlier run built it and its log is gone
                **summary.get(name, {}).get("budget", {}),  # selection-split evaluations, as each pick counted them
            },
        }
    if "autocompress" in methods:
        meta = RunPaths(run_dir).metadata_file
        sweep = json.loads(meta.read_text()).get("sweep_wall_s") if meta.exists() else None
        methods["autocompress"]["budget"]["sweep_seconds"] = seconds.get("sweep", sweep or "reused")
    base = frame.loc["base"]
    carried = run_dir.parent / CARRY_MANIFEST
    return {
        "scenario": scenario,
        "code": code,
        "protocol": proto,
        "items": {"evaluate": summary["evaluate"], "apart": proto["apart"]},
        "seeds": summary["seeds"],
        "base": {"params": int(base["params"]), "average": float(base["average"]), "test_ppl": base.get("test_ppl")},
        "methods": methods,
        "diff": summary["diff_vs"],
        "cpu": cpuinfo.identity(),
        "date": time.strftime("%Y-%m-%d"),
        # the earlier machines' sessions where the work was carried (--carry-in): the pick seconds are each its own
        **({"carried": json.loads(carried.read_text())["sessions"]} if carried.exists() else {}),
        "seconds": seconds,
        "compare": str(compare_dir),
    }


TABLE_START, TABLE_END = "<!-- headline table: benchmarks/headline.py --table -->", "<!-- end of the headline table -->"
NAMES = {
    "autocompress": "AutoCompress",
    "minitron": "Minitron (tuned)",
    "minitron_default": "Minitron (ModelOpt defaults)",
    "puzzletron": "Puzzletron",
}


def table(folder: Path, page: Path) -> str:
    """The headline's one table, from every `<scenario>.json` in `folder`, as Markdown with each row linked to its JSON.
    Refused when the JSONs come from different commits (the headline is one commit's, issue 43 item 3)."""
    records = [json.loads(p.read_text()) | {"_file": p} for p in sorted(folder.glob("*.json"))]
    if not records:
        raise SystemExit(f"error: no headline JSON in {folder}; run the headline first")
    codes = sorted({r["code"] for r in records})
    if len(codes) > 1:
        raise SystemExit(f"error: {folder} holds headlines of several commits ({', '.join(codes)}); rerun them at one")

    def num(value: Any, digits: int) -> str:
        return "-" if value is None else f"{float(value):.{digits}f}"

    def machines(r: dict[str, Any]) -> str:
        """The CPUs a scenario ran on: its carried sessions' and the last session's (the JSON's `cpu`), each once."""
        cpus = [s["cpu"] for s in r.get("carried", [])] + [r["cpu"]]
        named = dict.fromkeys(f"{c['model']} ({c['simd']}, {c['cores']} cores)" for c in cpus)
        return f"{r['scenario']} on {' then '.join(named)}"

    lines = [
        f"Code {codes[0][:12]}; {'; '.join(machines(r) for r in sorted(records, key=lambda r: r['scenario']))}. "
        "Benchmark average in points (higher is better), test-split KL to the unpruned model in nats/token and perplexity "
        "(lower is better), each after distillation and averaged over the seeds; the runner-up is the method's second "
        "pick by its own selection score, distilled and scored alike; the last column is AutoCompress minus the method "
        "on the average, with its 95% interval over items and seeds.",
        "",
        "| scenario | method | params | average | test KL | test ppl | runner-up average | AutoCompress minus it | JSON |",
        "|---|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in sorted(records, key=lambda r: r["scenario"]):
        link = os.path.relpath(r["_file"], page.parent)
        base = r["base"]
        lines.append(
            f"| {r['scenario']} | unpruned | {base['params'] / 1e6:.1f} M | {num(base['average'], 2)} | 0 | "
            f"{num(base.get('test_ppl'), 2)} | | | [json]({link}) |"
        )
        for name, m in r["methods"].items():
            d = r["diff"].get(name)
            diff = "" if d is None else f"{d['mean']:+.2f} [{d['low']:+.2f}, {d['high']:+.2f}]"
            up = m.get("runner_up") or {}
            lines.append(
                f"| {r['scenario']} | {NAMES.get(name, name)} | {m['params'] / 1e6:.1f} M | {num(m['average'], 2)} | "
                f"{num(m.get('test_kl'), 3)} | {num(m.get('test_ppl'), 2)} | {num(up.get('average'), 2)} | {diff} | [json]({link}) |"
            )
    return "\n".join(lines)


def fill_page(page: Path, folder: Path) -> None:
    """Replace what stands between the table markers of `page` with `table(folder)`; the rest of the page is kept."""
    text = page.read_text()
    if TABLE_START not in text or TABLE_END not in text:
        raise SystemExit(f"error: {page} has no headline table markers ({TABLE_START} ... {TABLE_END}); add them where the table goes")
    head, rest = text.split(TABLE_START, 1)
    tail = rest.split(TABLE_END, 1)[1]
    page.write_text(f"{head}{TABLE_START}\n{table(folder, page)}\n{TABLE_END}{tail}")


def write_record(result: dict[str, Any], path: Path) -> None:
    """A scenario's headline JSON, written atomically (it may replace the only record of a finished run)."""
    write_text(json.dumps(result, indent=1, default=str) + "\n", path)


def rerecord(scenarios: list[str], results: Path, out: Path) -> None:
    """Write each scenario's JSON in `out` again from its comparison in `results` with this file's `record`, keeping
    what the first record says about the run (commit, protocol, seconds); the numbers are compare's, not rerun."""
    if not scenarios:
        raise SystemExit("error: --rerecord needs --scenario (which JSONs to write again)")
    for scenario in scenarios:
        path, compare_dir = out / f"{scenario}.json", results / scenario / "compare"
        if not path.exists() or not (compare_dir / "compare.json").exists():
            raise SystemExit(f"error: --rerecord {scenario}: needs {path} and a finished {compare_dir}; run the headline first")
        old = json.loads(path.read_text())
        log, run_dir = results / f"{scenario}.log", results / scenario / RUN_ID
        result = record(scenario, compare_dir, old["protocol"], old["code"], old["seconds"], log, run_dir)
        write_record(result | {"cpu": old["cpu"], "date": old["date"]}, path)
        print(f"{path}: recorded again from {compare_dir} (code {old['code'][:12]})")


CARRY_MAX = 32 << 20  # bytes: a carried file is small (checkpoints are left behind, and made again where still needed)
CARRY_MANIFEST = "carry.json"
SKIPPED_DIRS = re.compile(r"^(pruned|distilled-seed\d+|\..*)$")  # checkpoints, temporary and resumable-state folders


def _small_files(root: Path) -> list[Path]:
    """The files under `root` a carry keeps: all but those in checkpoint, temporary and resumable-state folders; one
    over CARRY_MAX stops the carry (a later stage may read it, and a folder carried in part would count as finished)."""
    kept = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if not path.is_file() or any(SKIPPED_DIRS.match(part) for part in rel.parts[:-1]):
            continue
        if path.stat().st_size > CARRY_MAX:
            raise SystemExit(
                f"error: {path} is {path.stat().st_size >> 20} MiB, over a carry's {CARRY_MAX >> 20} MiB per file; nothing was carried"
            )
        kept.append(path)
    return kept


def _manifest(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None


def carry_out(scenarios: list[str], results: Path, carry: Path, code: str) -> None:
    """Copy each scenario's small files (a finished sweep run, the comparison without its checkpoints, the unpruned
    model's evaluation, the log's stage lines) to `carry/<scenario>/`, with a manifest of the commit and the machines
    that did the work, so that `--carry-in` on a fresh machine at the same commit goes on from there. Refused over a
    carry this results dir was not carried in from (it may hold work this one lacks)."""
    import shutil

    if not scenarios:
        raise SystemExit("error: --carry-out needs --scenario (which scenarios' work to carry)")
    for scenario in scenarios:
        dest, local = carry / scenario, results / scenario / CARRY_MANIFEST
        there, here = _manifest(dest / CARRY_MANIFEST), _manifest(local)
        if there is not None and there["code"] != code:
            raise SystemExit(f"error: {dest} carries work of commit {there['code'][:12]}, not {code[:12]}; remove it or run at that commit")
        if there is not None and there != here:
            raise SystemExit(
                f"error: {dest} holds work that {results / scenario} was not carried in from; run with --carry-in {carry} "
                "first (or remove it to start the carry again from this machine's work)"
            )
        roots = {"compare": results / scenario / "compare", "evaluate": results / "evaluate"}
        if sweep_state(results / scenario / RUN_ID) == "complete":  # an unfinished sweep starts again (Ray's state is not carried)
            roots[RUN_ID] = results / scenario / RUN_ID
        roots = {name: root for name, root in roots.items() if root.exists()}
        session = {"cpu": cpuinfo.identity(), "date": time.strftime("%Y-%m-%d %H:%M"), "carried": sorted(roots)}
        manifest = {"code": code, "sessions": [*(here or {}).get("sessions", []), session]}
        # beside DIR/<scenario>, renamed into it only once whole (the old carry kept until then)
        with staged(dest, True, key="--carry-out", marker=CARRY_MANIFEST, what="a headline carry", flag="--carry-out") as tmp:
            for name, root in roots.items():
                for f in _small_files(root):
                    target = tmp / name / f.relative_to(root)
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(f, target)
            log = results / f"{scenario}.log"
            text = log.read_text(errors="replace").replace("\r", "\n") if log.exists() else ""
            tmp.mkdir(parents=True, exist_ok=True)
            (tmp / f"{scenario}.log").write_text("".join(f"{x}\n" for x in text.splitlines() if x.startswith("[autocompress]")))
            (tmp / CARRY_MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        if local.parent.exists():
            write_text(json.dumps(manifest, indent=1) + "\n", local)  # this dir now holds what the carry holds
        size = sum(f.stat().st_size for f in dest.rglob("*") if f.is_file())
        print(f"{dest}: {scenario}'s small files ({size / 2**20:.1f} MiB; {', '.join(sorted(roots)) or 'the log only'})")


def carry_in(scenarios: list[str], results: Path, carry: Path, code: str) -> None:
    """Put each scenario's carried files back where the headline reads them. A scenario carried in already (its
    manifest here equals the carry's) is left as it is, so the same command reruns; refused onto a scenario with work
    of its own here, or from another commit."""
    import shutil

    for scenario in scenarios:
        src = carry / scenario
        manifest = _manifest(src / CARRY_MANIFEST)
        if manifest is None:
            continue
        if manifest["code"] != code:
            raise SystemExit(
                f"error: {src} carries work of commit {manifest['code'][:12]}, not this tree's {code[:12]}; run at that commit"
            )
        if _manifest(results / scenario / CARRY_MANIFEST) == manifest:
            print(f"{results / scenario}: carried in already from {src}")
            continue
        if (results / scenario).exists():
            raise SystemExit(
                f"error: {results / scenario} holds work of its own; --carry-in only fills a fresh results dir (move it aside)"
            )
        tmp = results / f".{scenario}.carry-in"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for name in (RUN_ID, "compare"):
            if (src / name).exists():
                shutil.copytree(src / name, tmp / name)
        shutil.copy2(src / CARRY_MANIFEST, tmp / CARRY_MANIFEST)  # marks it carried in; record() names the machines
        if (src / "evaluate").exists():
            shutil.copytree(src / "evaluate", results / "evaluate", dirs_exist_ok=True)
        shutil.copy2(src / f"{scenario}.log", results / f"{scenario}.log")
        tmp.rename(results / scenario)  # last: a failed copy leaves no half-carried scenario
        print(f"{results / scenario}: carried in from {src} ({len(manifest['sessions'])} earlier session(s))")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--protocol", default=str(PROTOCOL))
    parser.add_argument("--scenario", action="append", help="repeatable; default: the protocol's scenarios")
    parser.add_argument("--results-dir", default="benchmarks/out/headline", help="sweep runs and compare folders (large)")
    parser.add_argument("--out", default="benchmarks/results/headline", help="the small JSON per scenario")
    parser.add_argument("--allow-dirty", action="store_true", help="run with uncommitted changes (a trial run, never the headline)")
    parser.add_argument(
        "--table", metavar="PAGE", nargs="?", const="docs/results.md", help="only write the table of --out's JSONs into PAGE"
    )
    parser.add_argument(
        "--rerecord",
        action="store_true",
        help="only write each --scenario's JSON in --out again from its finished comparison and log, keeping the commit, "
        "protocol and seconds it records (for a JSON an older headline.py wrote; nothing is rerun)",
    )
    parser.add_argument(
        "--carry-out",
        metavar="DIR",
        help="only copy each --scenario's small files (no checkpoints) to DIR/<scenario>/ with a manifest, for --carry-in",
    )
    parser.add_argument("--carry-in", metavar="DIR", help="first put DIR/<scenario>/'s carried files back (a fresh machine goes on)")
    args = parser.parse_args(argv)
    if args.table:
        fill_page(ROOT / args.table, ROOT / args.out)
        print(f"{args.table}: the headline table from {args.out}")
        return
    if args.rerecord:
        rerecord(args.scenario or [], (ROOT / args.results_dir).resolve(), ROOT / args.out)
        return
    proto = protocol(Path(args.protocol))
    unknown = [s for s in args.scenario or [] if s not in proto["scenarios"]]
    if unknown:
        raise SystemExit(f"error: --scenario {unknown[0]} is not in {args.protocol}; its scenarios: {', '.join(proto['scenarios'])}")
    code = commit(args.allow_dirty)
    results, out = (ROOT / args.results_dir).resolve(), ROOT / args.out
    if args.carry_out:
        carry_out(args.scenario or [], results, Path(args.carry_out).resolve(), code)
        return
    if args.carry_in:
        results.mkdir(parents=True, exist_ok=True)
        carry_in(args.scenario or proto["scenarios"], results, Path(args.carry_in).resolve(), code)
    out.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    for scenario in args.scenario or proto["scenarios"]:
        log = results / f"{scenario}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        run_dir = results / scenario / RUN_ID
        seconds: dict[str, float] = {}
        shared = [f"+scenario={scenario}", f"results.dir={results}", *proto["overrides"]]
        state = sweep_state(run_dir)
        if state != "complete":
            extra = [f"resume={run_dir}"] if state == "interrupted" else [f"results.run_id={RUN_ID}"]
            seconds["sweep"] = common.run_logged([py, "-m", "autocompress.sweep", *shared, *extra], log, ROOT, RERUN)
        compare_dir = results / scenario / "compare"
        cmd = [py, "-m", "autocompress.compare", *shared, *proto["compare"], f"compare.run={run_dir}", f"compare.out={compare_dir}"]
        if not (compare_dir / "compare.json").exists():  # a finished comparison is recorded again, not rerun
            seconds["compare"] = common.run_logged(cmd, log, ROOT, RERUN)
        result = record(scenario, compare_dir, proto, code, seconds, log, run_dir)
        write_record(result, out / f"{scenario}.json")
        diffs = ", ".join(f"vs {m}: {d['mean']:+.2f} [{d['low']:+.2f}, {d['high']:+.2f}]" for m, d in result["diff"].items())
        print(f"{scenario}: AutoCompress minus each method, benchmark average (points): {diffs}", flush=True)
    print(f"results: {out}; runs and logs: {results}")


if __name__ == "__main__":
    main()
