"""The colour of each job and run state, one per state, the same on the jobs list and the run
page, so a glance tells running from failed from stopped. Quasar palette names."""

from __future__ import annotations

STATE_COLORS = {
    "queued": "grey-7",
    "running": "blue-8",
    "stopping": "orange-9",
    "succeeded": "green-8",
    "failed": "red-9",
    "died": "purple-9",
    "stopped": "amber-10",
    "cancelled": "blue-grey-5",
    "finished": "teal-8",  # a run opened by its folder whose final file is written
}
UNKNOWN_COLOR = "grey-5"  # a run opened by its folder that has not finished: no process known


def state_color(state: str) -> str:
    """The badge colour of `state` (a neutral grey for a state with no colour of its own)."""
    return STATE_COLORS.get(state, UNKNOWN_COLOR)
