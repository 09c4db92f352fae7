"""A minimal stateful object holding arbitrary (nested) state, for checkpoint tests."""


class StateHolder:
    """``state_dict()`` returns the state it holds; ``load_state_dict`` replaces it."""

    def __init__(self, state):
        self.state = state

    def state_dict(self):
        return self.state

    def load_state_dict(self, state):
        self.state = state
