"""How pytest-xdist hands the suite to its workers (`make test` runs several: most tests
wait on servers, not on the CPU; docs/testing.md).

Each test is a unit of its own, given to whichever worker is free next, except the groups
below, each kept on one worker because its tests share what is costly to make twice: the
real-vLLM tests share the session's vLLM replicas (tests/conformance/fleet.py; a second
worker would start a second fleet, a minute of CPU and gigabytes), and the
exception-watch tests share a module compiled with mypyc. xdist hands out the units with
the most tests first, so each group starts at once and the single tests fill the other
workers around it.

xdist's own `--dist loadgroup` cannot do this here: it carries the `xdist_group` mark to
the scheduler by rewriting the node id, which pytest 9.2 no longer lets a plugin do, so
it silently stops grouping (https://github.com/pytest-dev/pytest-xdist/issues/1386). The
groups are read off the node id's path instead.
"""

from __future__ import annotations

from xdist.scheduler import LoadScopeScheduling

SHARED_WORKER_GROUPS = (
    "tests/conformance/",
    "tests/support/test_exceptions.py",
)


def work_unit(nodeid: str) -> str:
    """The unit a test is scheduled in: its group's path, or the test alone."""
    for group in SHARED_WORKER_GROUPS:
        if nodeid.startswith(group):
            return group
    return nodeid


class GroupedScheduling(LoadScopeScheduling):  # type: ignore[misc]  # xdist ships no types
    """xdist's scope scheduler with `work_unit` as the scope."""

    def _split_scope(self, nodeid: str) -> str:
        return work_unit(nodeid)
