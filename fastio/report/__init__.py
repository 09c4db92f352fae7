"""What ``fastio verify`` and ``fastio inspect`` report: read-only looks at a dataset or a mixture."""
