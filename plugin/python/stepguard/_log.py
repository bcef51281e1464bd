"""The ``stepguard`` logger: what the Python guard tells the training loop's log.

One WARNING line per incident (step, signal, action, cause, tensors, ranks and the report's path),
INFO for a rollback's data skip and for resume, nothing for a clean step. Every rank's guard
takes the same decisions, so rank 0 logs them at those levels and the other ranks at DEBUG (a
torchrun job prints each incident once). Standard ``logging``: with no handler configured Python
prints WARNING and above to stderr; ``logging.getLogger("stepguard").setLevel(logging.ERROR)``
silences it, and a handler added to it (or to the root logger) routes it.
"""

import logging

logger = logging.getLogger("stepguard")


def _names(values, limit=4):
    values = [str(v) for v in values]
    if not values:
        return "-"
    more = len(values) - limit
    return ",".join(values[:limit]) + (" (+%d more)" % more if more > 0 else "")


def after_step(report, incident, rank):
    """Logs what the step did when it was not a clean apply (``incident``: ``report.incident``,
    read once by the caller)."""
    lead = rank == 0
    if incident is not None:
        where = (" report %s" % incident["report"]) if incident.get("report") else ""
        logger.log(logging.WARNING if lead else logging.DEBUG,
                   "step %d: %s -> %s (cause %s; tensors %s; ranks %s)%s", incident["step"],
                   incident["signal"], incident["action"], incident["cause"],
                   _names(incident["tensors"]),
                   "unknown" if incident.get("origin_unknown") else _names(incident["ranks"]),
                   where)
    if report.rolled_back:
        logger.log(logging.INFO if lead else logging.DEBUG,
                   "step %d: rolled back to step %d; the policy asks to drop the next %d batches",
                   report.step, report.rolled_back_to, report.batches_to_skip)


def after_resume(step, directory, rank):
    level = logging.INFO if rank == 0 else logging.DEBUG
    if step:
        logger.log(level, "resumed from the checkpoint of step %d in %s", step, directory)
    else:
        logger.log(level, "no valid checkpoint to resume in %s: starting fresh", directory)
