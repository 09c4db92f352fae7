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


def run_cli(args: list[str], capsys) -> tuple[int, str, str]:
    """``fastio ARGS`` in this process: (exit code, stdout, stderr)."""
    try:
        code = main(args)
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err
