"""Token streams for language-model training: Megatron ``.bin``/``.idx`` shards (:mod:`fastio.tokens.megatron`),
converting text into them (:mod:`fastio.tokens.convert`), indexing existing ones (:mod:`fastio.tokens.index`),
the pure order of packed sequences (:mod:`fastio.tokens.packing`) and a token dataset read as packed sequences
(:mod:`fastio.tokens.dataset`). See ``docs/tokens.md``. Imports nothing itself (``fastio convert`` stays light)."""
