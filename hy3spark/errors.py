"""One exception base for everything the CLI reports as a clean message and a non-zero exit."""

from __future__ import annotations

# Exit codes are part of the CLI's contract (documented in the README).
EXIT_OK = 0
EXIT_FAILED = 1  # a task failed, a gate said no
EXIT_USAGE = 2  # argparse's own code for bad command-line usage
EXIT_SPEC = 3  # the cluster spec is invalid
EXIT_UNREACHABLE = 4  # a host could not be reached


class Hy3SparkError(Exception):
    """A problem the user can fix; its message says how."""

    exit_code = EXIT_FAILED


class SpecError(Hy3SparkError):
    """The cluster spec is invalid. Carries one line per problem: `file:line: field.path: message`."""

    exit_code = EXIT_SPEC

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = problems
        if len(problems) == 1:
            text = problems[0]
        else:
            text = f"{len(problems)} problems in {source}:\n" + "\n".join(f"  - {p}" for p in problems)
        super().__init__(text)


class UsageError(Hy3SparkError):
    """A command-line value that only the spec or the value itself shows to be wrong (argparse cannot see it)."""

    exit_code = EXIT_USAGE
