"""stepguard plot: a picture of a run, drawn from its trace (the JSONL event log, one object per
step). The top panel holds the loss and the grad norm (log scale) with every incident marked at
its step (its signal and action) and every rollback drawn as an arrow back to the step it
restored; beneath, the loss scale (for a run that scales its loss) and the LR factor.

    stepguard plot TRACE.jsonl -o run.png [--around STEP] [--window N]
    python3 -m stepguard.plot TRACE.jsonl -o run.png
    stepguard plot TRACE.jsonl --incident REPORT.json...     (REPORT.png beside each report)

Python and matplotlib (Agg, no display). Every file is read and written through stepguard's file
layer (stepguard._files: a FIFO or a device is refused unread, a picture never written through a
planted link), so the package and its extension must import; run by its path
(``python3 .../stepguard/plot.py``), this file takes the package it sits in. Exit status: 0 drawn,
2 bad input (the message names the file and line), 1 matplotlib or the stepguard package missing.
"""

import argparse
import json
import math
import os
import sys

DEFAULT_WINDOW = 50  # steps either side of --around
_BLOCK = 1 << 20  # bytes read at a time from the end of a trace

# An incident is named by its first signal and its strongest action; the engine names the action
# (each trace line's "action").
_ACTION_COLOR = {"abort": "black", "rollback": "tab:red", "lower_lr": "tab:blue",
                 "drop_loss_scale": "tab:purple", "skip_batch": "tab:orange", "clip": "tab:olive",
                 "reset_moments": "tab:cyan", "alert": "tab:gray", "apply": "tab:gray"}
_SIGNAL_MARKER = {"nonfinite_grad": "v", "nonfinite_loss": "X", "loss_spike": "^",
                  "grad_norm_spike": "D", "loss_ratio": "s", "consecutive_limit": "P",
                  "skip_budget": "p", "rank_desync": "*"}
_NUMBERS = ("loss", "grad_norm", "loss_scale", "lr_factor")


class TraceError(ValueError):
    """A trace (or report) that cannot be drawn: the message names the file and, for a bad line,
    the line number (``FILE:LINE: ...``)."""


class MatplotlibMissing(RuntimeError):
    """matplotlib does not import: nothing can be drawn."""


class PackageMissing(RuntimeError):
    """The stepguard package (whose extension reads and writes the files) does not import."""


def _file_layer():
    """stepguard._files, imported on first use. Run by its path, this file is in no package: the
    package is the folder it sits in."""
    try:
        if __package__:
            from . import _files as files
        else:
            above = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
            if above not in sys.path:
                sys.path.insert(0, above)
            from stepguard import _files as files
    except ImportError as e:
        raise PackageMissing("the stepguard package does not import (%s): its extension reads "
                             "and writes the files" % e) from None
    return files


class _LineError(ValueError):
    """What is wrong with one line; read_trace adds where it is."""


def _number(obj, key):
    value = obj.get(key)
    if value is None:  # JSON has no NaN/Inf: the engine writes a non-finite number as null
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _LineError("'%s' is %s, not a number" % (key, json.dumps(value)))
    return float(value)


def _names(obj, key):
    value = obj.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _LineError("'%s' is %s, not a list of names" % (key, json.dumps(value)))
    return value


def _parse_line(raw):
    try:
        obj = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise _LineError("not UTF-8 text (%s)" % e.reason) from None
    except ValueError as e:
        raise _LineError("not JSON (%s)" % e) from None
    if not isinstance(obj, dict):
        raise _LineError("not a JSON object (a trace line is one object per step)")
    step = obj.get("step")
    if isinstance(step, bool) or not isinstance(step, int):
        raise _LineError("'step' is %s, not a step number (is this a stepguard trace?)"
                         % ("missing" if step is None else json.dumps(step)))
    row = {key: _number(obj, key) for key in _NUMBERS}
    row["step"] = step
    row["outcome"] = obj.get("outcome") if isinstance(obj.get("outcome"), str) else ""
    row["actions"] = _names(obj, "actions")
    row["signals"] = _names(obj, "signals")
    action = obj.get("action", "apply" if not row["signals"] else None)
    if not isinstance(action, str):
        raise _LineError("'action' is %s, not the name of the step's strongest action"
                         % ("missing" if action is None else json.dumps(action)))
    row["action"] = action
    target = obj.get("rolled_back_to")
    if target is not None and (isinstance(target, bool) or not isinstance(target, int)):
        raise _LineError("'rolled_back_to' is %s, not a step number" % json.dumps(target))
    row["rolled_back_to"] = target
    return row


def _step_of(raw):
    try:
        step = json.loads(raw).get("step")
    except (ValueError, AttributeError):
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def _tail(f, from_step):
    """(offset, bytes) of the end of the open file `f` from a line whose step is below
    `from_step` (or from the start): a picture of the last steps of a long run reads only them."""
    f.seek(0, os.SEEK_END)
    pos, data = f.tell(), b""
    while pos > 0:
        n = min(_BLOCK, pos)
        pos -= n
        f.seek(pos)
        data = f.read(n) + data
        cut = data.find(b"\n") if pos > 0 else -1  # before it: a line that may begin earlier
        first = data[cut + 1:].split(b"\n", 1)[0]
        step = _step_of(first)
        if step is not None and step < from_step:
            return pos + cut + 1, data[cut + 1:]
    return 0, data


def _line_number(f, offset):
    f.seek(0)
    count, left = 1, offset
    while left > 0:
        block = f.read(min(_BLOCK, left))
        if not block:
            break
        count += block.count(b"\n")
        left -= len(block)
    return count


def read_trace(path, from_step=None):
    """The steps of the trace at ``path``, in file order: dicts with step, loss, grad_norm,
    loss_scale, lr_factor (None where non-finite), outcome, actions, signals, rolled_back_to.
    With ``from_step``, only the steps from there on (read from the end of the file back).
    Raises TraceError naming the file and line of the first bad line."""
    rows = []
    files = _file_layer()
    try:
        with files.open_regular(path, files.MAX_TRACE_BYTES) as f:
            offset, data = _tail(f, from_step) if from_step is not None else (0, f.read())
            for index, raw in enumerate(data.split(b"\n")):
                if not raw.strip():
                    continue
                try:
                    row = _parse_line(raw)
                except _LineError as e:
                    raise TraceError("%s:%d: %s" % (path, _line_number(f, offset) + index, e)) \
                        from None
                if from_step is None or row["step"] >= from_step:
                    rows.append(row)
    except files.FileError as e:  # its message names the file
        raise TraceError(str(e)) from None
    except OSError as e:
        raise TraceError("%s: cannot read: %s" % (path, e.strerror or e)) from None
    if not rows and from_step is None:
        raise TraceError("%s: no steps (an empty trace)" % path)
    return rows


def incidents_of(rows):
    """The incident marks: every step that raised a signal, named as the engine names it."""
    return [{"step": r["step"], "signal": r["signals"][0], "action": r["action"],
             "signals": list(r["signals"]), "actions": list(r["actions"]),
             "outcome": r["outcome"]} for r in rows if r["signals"]]


def rollbacks_of(rows):
    """Every rollback: the step that rolled back and the step whose state it restored."""
    return [{"from": r["step"], "to": r["rolled_back_to"]} for r in rows
            if r["rolled_back_to"] is not None]


def _rows_to_draw(path, around, window):
    """All steps, or those within `window` of `around`, stretched back to the step a rollback
    among them restored."""
    if around is None:
        return read_trace(path)
    lo, hi = around - window, around + window
    rows = read_trace(path, from_step=lo)
    targets = [r["rolled_back_to"] for r in rows
               if r["step"] <= hi and r["rolled_back_to"] is not None]
    if targets and min(targets) < lo:
        lo = min(targets)
        rows = read_trace(path, from_step=lo)
    chosen = [r for r in rows if lo <= r["step"] <= hi]
    if not chosen:
        steps = [r["step"] for r in read_trace(path)]
        raise TraceError("%s: no steps within %d of step %d (the trace holds steps %d to %d)"
                         % (path, window, around, min(steps), max(steps)))
    return chosen


def _series(rows, key, positive=False):
    xs, ys = [], []
    for r in rows:
        v = r[key]
        if v is not None and math.isfinite(v) and (v > 0 or not positive):
            xs.append(r["step"])
            ys.append(v)
    return xs, ys


def _draw_incidents(ax, incidents, span):
    from matplotlib.lines import Line2D
    from matplotlib.transforms import blended_transform_factory

    top = blended_transform_factory(ax.transData, ax.transAxes)
    legend, last_label = {}, None
    for inc in incidents:
        color = _ACTION_COLOR.get(inc["action"], "tab:gray")
        marker = _SIGNAL_MARKER.get(inc["signal"], "o")
        ax.axvline(inc["step"], color=color, alpha=0.5, linewidth=1, linestyle="--")
        ax.plot([inc["step"]], [0.97], transform=top, marker=marker, color=color,
                markersize=7, linestyle="none", clip_on=False)
        # Labels only where they do not run into the previous one; the legend names them all.
        if last_label is None or inc["step"] - last_label >= span / 30.0:
            ax.text(inc["step"], 0.93, " %d %s -> %s" % (inc["step"], inc["signal"], inc["action"]),
                    transform=top, rotation=90, va="top", ha="right", fontsize=7, color=color)
            last_label = inc["step"]
        name = "%s -> %s" % (inc["signal"], inc["action"])
        legend.setdefault(name, Line2D([], [], color=color, marker=marker, linestyle="--",
                                       label=name))
    return list(legend.values())


def _draw_rollbacks(ax, rollbacks):
    from matplotlib.transforms import blended_transform_factory

    low = blended_transform_factory(ax.transData, ax.transAxes)
    for i, rb in enumerate(rollbacks):
        y = 0.08 + 0.08 * (i % 3)
        ax.annotate("", xy=(rb["to"], y), xytext=(rb["from"], y), xycoords=low, textcoords=low,
                    arrowprops={"arrowstyle": "->", "color": "tab:red", "lw": 1.6})
        ax.text((rb["from"] + rb["to"]) / 2.0, y + 0.015,
                "rollback %d -> %d" % (rb["from"], rb["to"]), transform=low, ha="center",
                va="bottom", fontsize=7, color="tab:red",
                bbox={"facecolor": "white", "alpha": 0.7, "edgecolor": "none", "pad": 1})


def _draw_losses(ax, rows, incidents, rollbacks, span):
    lines = []
    for key, color, label in (("loss", "tab:blue", "loss"),
                              ("grad_norm", "tab:green", "grad norm")):
        xs, ys = _series(rows, key, positive=True)
        lines += ax.plot(xs, ys, color=color, linewidth=1, label=label,
                         marker="." if len(xs) < 60 else None)
    ax.set_yscale("log")
    ax.set_ylabel("loss, grad norm")
    marks = _draw_incidents(ax, incidents, span)
    _draw_rollbacks(ax, rollbacks)
    # Outside, right of the panel: inside it would hide the marks at the top.
    ax.legend(handles=lines + marks, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7,
              borderaxespad=0.0)
    ax.grid(True, which="major", alpha=0.3)


def _scaled(rows):
    """Whether the run scaled its loss: a loss scale other than 1 on some step (an fp32 run's
    trace holds 1 throughout, which would draw a flat, empty-looking panel)."""
    return any(v != 1.0 for v in _series(rows, "loss_scale", positive=True)[1])


def _draw_scales(ax, rows):
    xs, ys = _series(rows, "lr_factor")
    if _scaled(rows):
        xs_scale, ys_scale = _series(rows, "loss_scale", positive=True)
        scale = ax.plot(xs_scale, ys_scale, color="tab:purple", drawstyle="steps-post",
                        label="loss scale")
        ax.set_yscale("log")
        ax.set_ylabel("loss scale")
        lr_ax = ax.twinx()
    else:  # the LR factor alone, on the panel's own axis
        scale, lr_ax = [], ax
    lr = lr_ax.plot(xs, ys, color="tab:orange", drawstyle="steps-post",
                    label="LR factor" if scale else "LR factor (no loss scaling)")
    lr_ax.set_ylim(0, max([1.0] + ys) * 1.15)
    lr_ax.set_ylabel("LR factor")
    ax.legend(handles=scale + lr, loc="upper left", bbox_to_anchor=(1.08, 1.0), fontsize=7,
              borderaxespad=0.0)
    ax.set_xlabel("step")
    ax.grid(True, alpha=0.3)


def _render(rows, incidents, rollbacks, around, title, out_png):
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise MatplotlibMissing("matplotlib does not import (%s); pip install matplotlib "
                                "(stepguard's requirements.txt pins it)" % e) \
            from None
    # A Figure with its own Agg canvas: no pyplot, so a training process's backend is untouched.
    fig = Figure(figsize=(12, 6), dpi=100)
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 1.3]})
    steps = [r["step"] for r in rows] + [rb["to"] for rb in rollbacks]
    first, last = min(steps), max(steps)
    span = max(1, last - first)
    if around is not None:
        for ax in (top, bottom):
            ax.axvspan(around - 0.5, around + 0.5, color="gold", alpha=0.35, linewidth=0)
    _draw_losses(top, rows, incidents, rollbacks, span)
    top.set_title(title, fontsize=10)
    _draw_scales(bottom, rows)
    bottom.set_xlim(first - 0.02 * span, last + 0.02 * span)
    fig.tight_layout()
    files = _file_layer()
    try:
        files.save_figure(fig, out_png, format="png")
    except files.FileError as e:  # names the file it failed on (the temporary file, maybe)
        raise TraceError("%s: cannot write the picture: %s" % (out_png, e)) from None


def _counts(steps, incidents, rollbacks):
    def n(count, word):
        return "%d %s%s" % (count, word, "" if count == 1 else "s")
    return "steps %d to %d, %s, %s" % (min(steps), max(steps), n(len(incidents), "incident"),
                                       n(len(rollbacks), "rollback"))


def plot_trace(trace_path, out_png, around=None, window=DEFAULT_WINDOW):
    """Draws the trace at ``trace_path`` into ``out_png`` (PNG); with ``around``, only the steps
    within ``window`` of that step (and back to the step a rollback among them restored).

    Returns what was drawn, as plain values: ``{"trace", "out", "around", "window", "steps"
    (the step numbers drawn), "incidents" ([{step, signal, action, signals, actions, outcome}]),
    "rollbacks" ([{from, to}]), "loss_scale" (whether a loss-scale line was drawn: not for a run
    whose loss scale is 1 throughout)}``. Raises TraceError (bad input; the message names the file and
    line), MatplotlibMissing or PackageMissing."""
    if window < 0:
        raise TraceError("--window %d: must be 0 or more" % window)
    rows = _rows_to_draw(trace_path, around, window)
    incidents, rollbacks = incidents_of(rows), rollbacks_of(rows)
    steps = [r["step"] for r in rows]
    title = "%s: %s" % (os.path.basename(trace_path), _counts(steps, incidents, rollbacks))
    if around is not None:
        title += " (around step %d)" % around
    _render(rows, incidents, rollbacks, around, title, out_png)
    return {"trace": trace_path, "out": out_png, "around": around, "window": window,
            "steps": steps, "incidents": incidents, "rollbacks": rollbacks,
            "loss_scale": _scaled(rows)}


def picture_path(report_path):
    """Where the picture of an incident report goes: beside it, ``<report stem>.png``."""
    return os.path.splitext(report_path)[0] + ".png"


def plot_incident(trace_path, report_path, window=DEFAULT_WINDOW):
    """Draws the steps around the incident of the report at ``report_path`` (the .json a guard
    wrote) into ``picture_path(report_path)``; returns what plot_trace returns."""
    files = _file_layer()
    try:
        report = json.loads(files.read_regular(report_path, files.MAX_REPORT_BYTES))
    except files.FileError as e:  # its message names the file
        raise TraceError(str(e)) from None
    except OSError as e:
        raise TraceError("%s: cannot read: %s" % (report_path, e.strerror or e)) from None
    except ValueError as e:
        raise TraceError("%s: not an incident report (%s)" % (report_path, e)) from None
    step = report.get("step") if isinstance(report, dict) else None
    if isinstance(step, bool) or not isinstance(step, int):
        raise TraceError("%s: not an incident report (no 'step')" % report_path)
    return plot_trace(trace_path, picture_path(report_path), around=step, window=window)


def _parser():
    p = argparse.ArgumentParser(
        prog="stepguard plot",
        description="Draws a stepguard trace: loss and grad norm with the incidents and "
                    "rollbacks marked, the loss scale and the LR factor beneath.")
    p.add_argument("trace", metavar="TRACE.jsonl", help="the trace a guard wrote (--trace)")
    p.add_argument("-o", "--output", metavar="OUT.png", help="the picture to write")
    p.add_argument("--around", type=int, metavar="STEP",
                   help="draw only the steps near STEP (an incident's step)")
    p.add_argument("--window", type=int, default=DEFAULT_WINDOW, metavar="N",
                   help="with --around or --incident: steps either side (default %(default)s)")
    p.add_argument("--incident", action="append", default=[], metavar="REPORT.json",
                   help="draw the steps around this incident report's step into REPORT.png "
                        "beside it (repeatable)")
    p.add_argument("--quiet", action="store_true", help="do not print the pictures written")
    return p


def main(argv=None):
    parser = _parser()
    args = parser.parse_args(argv)
    if not args.output and not args.incident:
        parser.error("-o OUT.png (or --incident REPORT.json) is required")
    if args.incident and (args.output or args.around is not None):
        parser.error("--incident writes REPORT.png beside each report: no -o or --around")
    try:
        if args.output:
            drawn = [plot_trace(args.trace, args.output, around=args.around, window=args.window)]
        else:
            drawn = [plot_incident(args.trace, r, window=args.window) for r in args.incident]
    except TraceError as e:
        print("stepguard plot: %s" % e, file=sys.stderr)
        return 2
    except (MatplotlibMissing, PackageMissing) as e:
        print("stepguard plot: %s" % e, file=sys.stderr)
        return 1
    if not args.quiet:
        for d in drawn:
            print("%s: %s" % (d["out"], _counts(d["steps"], d["incidents"], d["rollbacks"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
