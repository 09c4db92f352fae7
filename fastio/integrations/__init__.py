"""Adapters to the trainers people run fastio inside. Each module imports its framework when it is imported
itself; ``import fastio`` imports none of them (``fastio.integrations.lightning`` needs ``fastio[lightning]``)."""
