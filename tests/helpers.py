"""Small helpers several test modules share: a stateful holder for checkpoint tests, and the CLI in-process."""

from fastio.cli import main


class StateHolder:
    """``state_dict()`` returns the state it holds; ``load_state_dict`` replaces it."""

    def __init__(self, state):
        self.state = state

    def state_dict(self):
        return self.state

    def load_state_dict(self, state):
        self.state = state


class Position:
    """Per-rank loader-like state (``consumed``) for the multi-rank checkpoint tests."""

    def __init__(self):
        self.consumed = 0

    def state_dict(self):
        return {"version": 1, "consumed": self.consumed}

    def load_state_dict(self, state):
        self.consumed = state["consumed"]


def run_cli(args: list[str], capsys) -> tuple[int, str, str]:
    """``fastio ARGS`` in this process: (exit code, stdout, stderr)."""
    try:
        code = main(args)
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err
