"""File formats and value rules: WebDataset member names, DALI's ``.idx``, Megatron's
``.bin``/``.idx``, image and media fields, labels.

No dataset layout: a module here knows one format, not where a dataset keeps its files."""
