"""Pictures of incidents for GuardedOptimizer: after a step that wrote an incident report, the
steps around it are drawn from the trace into ``<report stem>.png`` beside the report, and the
report (JSON and Markdown) links it. Only with a trace and an incident directory, and where
matplotlib is installed (the ``plots`` extra; without it the guard says so once). A picture that cannot be drawn never stops training: it is said once on
stderr and no more are drawn."""

import importlib.util
import sys

from . import _C

# A NaN storm reports every step; the first pictures tell its story, and each costs a fraction
# of a second of the training thread.
MAX_PICTURES = 20


class IncidentPictures:
    """Draws the pictures of one guard's incidents. Not thread-safe (the training thread)."""

    def __init__(self, trace_path):
        self.trace_path = trace_path
        self.drawn = 0
        self.failed = False

    @classmethod
    def for_options(cls, options):
        """The pictures of a guard with these GuardOptions keywords, or None when there are
        none to draw (no trace, no incident directory, or no matplotlib)."""
        if not options.get("trace_path") or not options.get("incident_dir"):
            return None
        if importlib.util.find_spec("matplotlib") is None:  # found, not imported: that waits
            print("stepguard: incident pictures need matplotlib, which is not installed (pip "
                  "install 'stepguard[plots]'); the incident reports are written without them",
                  file=sys.stderr)
            return None
        return cls(str(options["trace_path"]))

    def after_step(self, report):
        incident = report.incident
        if not incident or not incident.get("report") or self.failed:
            return
        if self.drawn >= MAX_PICTURES:
            return
        try:
            from . import plot  # matplotlib loads with the first picture, not at import

            drawn = plot.plot_incident(self.trace_path, incident["report"])
            _C.attach_incident_picture(incident["report"], drawn["out"])
        except Exception as e:  # noqa: BLE001  (a picture never stops training)
            self.failed = True
            print("stepguard: step %d: no picture of the incident (%s); no more will be drawn"
                  % (incident["step"], e), file=sys.stderr)
            return
        self.drawn += 1
