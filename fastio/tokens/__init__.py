"""Token streams for language-model training: Megatron ``.bin``/``.idx`` shards (:mod:`fastio.tokens.megatron`),
converting text into them (:mod:`fastio.tokens.convert`), indexing existing ones (:mod:`fastio.tokens.index`),
and the pure order of packed sequences (:mod:`fastio.tokens.packing`). See ``docs/tokens.md``."""
