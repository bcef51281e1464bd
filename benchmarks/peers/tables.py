"""The results of every rank merged into one record, the issue's target judged from it, and the
two Markdown tables (cost; coverage). No measurement here."""

from importlib import metadata

from .faults import FULL, matrix
from .tools import TOOLS

FAULT_NAMES = [f.name for f in matrix(FULL)]


def versions():
    out = {}
    for package in ("torch", "deepspeed", "megatron-core", "ai2-olmo-core"):
        try:
            out[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            out[package] = None
    return out


def merge(ranks):
    """Rank 0's record; a coverage entry's equality flags hold only if they hold on every rank."""
    merged = ranks[0]
    for tool, record in merged.items():
        for fault, entry in record.get("coverage", {}).items():
            for other in ranks[1:]:
                theirs = other.get(tool, {}).get("coverage", {}).get(fault, {})
                for key in ("ranks_equal_always", "ranks_equal_end", "finite_end"):
                    if key in entry:
                        entry[key] = bool(entry[key] and theirs.get(key, False))
    return merged


def missing(result, tools):
    """The (ranks, tool, fault or cost case) entries a complete result lacks; an entry that says
    why the tool could not run counts as present."""
    out = []
    for world, by_tool in result["by_ranks"].items():
        for tool in tools:
            record = by_tool.get(tool, {})
            for fault in FAULT_NAMES:
                entry = record.get("coverage", {}).get(fault, {})
                if "caught_step" not in entry and "error" not in entry:
                    out.append("%s/%s/%s" % (world, tool, fault))
            for precision in ("fp32", "bf16"):
                entry = record.get("cost", {}).get(precision, {})
                if "overhead" not in entry and "error" not in entry:
                    out.append("%s/%s/cost-%s" % (world, tool, precision))
    return out


def _caught(entry):
    return "error" not in entry and entry.get("caught_step") is not None


def target(result):
    """stepguard's overhead against the cheapest peer per case; whether it caught every fault."""
    out = {"cases": [], "stepguard_catches_every_fault": True}
    for world, tools in result["by_ranks"].items():
        sg = tools.get("stepguard", {})
        for fault in FAULT_NAMES:
            # One replica's corruption needs a second replica to differ from: not a fault of a
            # one-rank job (its weights are the only copy; no check of any tool can tell).
            if fault == "weight_corruption_one_replica" and int(world) == 1:
                continue
            if not _caught(sg.get("coverage", {}).get(fault, {})):
                out["stepguard_catches_every_fault"] = False
        for precision in ("fp32", "bf16"):
            mine = sg.get("cost", {}).get(precision, {})
            peers = {name: t["cost"][precision]["overhead"] for name, t in tools.items()
                     if name != "stepguard" and "overhead" in t.get("cost", {}).get(precision, {})}
            if "overhead" not in mine or not peers:
                continue
            cheapest = min(peers, key=peers.get)
            out["cases"].append({"ranks": int(world), "precision": precision,
                                 "stepguard": mine["overhead"], "cheapest_peer": cheapest,
                                 "cheapest_overhead": peers[cheapest],
                                 "met": mine["overhead"] <= peers[cheapest]})
    return out


def _cell(entry):
    if "error" in entry:
        return "cannot run: " + entry["error"][:60]
    if entry.get("caught_step") is None:
        text = "missed"
    else:
        text = "%d: %s" % (entry["caught_step"], "+".join(entry["actions"]))
    if entry.get("false_alarms"):
        text += " (%d early)" % entry["false_alarms"]
    text += "; ranks " + ("equal" if entry.get("ranks_equal_end") else "DIFFER")
    if not entry.get("finite_end", True):
        text += ", weights NaN/Inf"
    return text


def markdown(result):
    lines = ["Cost (%s model; ms per iteration, medians; overhead = tool / plain - 1; check = "
             "the tool's own check per step)" % result["cost_model"], "",
             "| ranks | precision | tool | plain | with tool | overhead | check | note |",
             "|---|---|---|---|---|---|---|---|"]
    for world, tools in result["by_ranks"].items():
        for precision in ("fp32", "bf16"):
            for tool in TOOLS:
                c = tools.get(tool.name, {}).get("cost", {}).get(precision)
                if c is None:
                    continue
                if "error" in c:
                    lines.append("| %s | %s | %s | | | | | cannot run: %s |"
                                 % (world, precision, tool.name, c["error"][:120]))
                    continue
                lines.append("| %s | %s | %s | %.2f | %.2f | %+.4f | %.3f | baseline: %s |" % (
                    world, precision, tool.name, c["plain_ms"], c["guarded_ms"], c["overhead"],
                    c["check_ms"], c["baseline_model"]))
    schedule = result["fault_schedule"]
    lines += ["", "Coverage (%s model, %d steps; cell: first step that acted at or after the "
              "fault: what the tool did; ranks equal at the end)" % (result["coverage_model"],
                                                                       schedule["steps"]), ""]
    for world, tools in result["by_ranks"].items():
        lines += ["%s rank(s)" % world, "", "| tool | " + " | ".join(
            "%s (step %d)" % (f.name, f.at) for f in matrix(schedule)) + " |",
                  "|---" * (len(FAULT_NAMES) + 1) + "|"]
        for tool in TOOLS:
            cov = tools.get(tool.name, {}).get("coverage")
            if cov is not None:
                lines.append("| %s | %s |" % (tool.name, " | ".join(
                    _cell(cov.get(f, {"error": "not run"})) for f in FAULT_NAMES)))
        lines.append("")
    t = result["target"]
    lines.append("Target: stepguard catches every fault: %s" % t["stepguard_catches_every_fault"])
    for case in t["cases"]:
        lines.append("- %d rank(s) %s: stepguard %+.4f, cheapest peer %s %+.4f: %s" % (
            case["ranks"], case["precision"], case["stepguard"], case["cheapest_peer"],
            case["cheapest_overhead"], "met" if case["met"] else "not met"))
    return "\n".join(lines)
