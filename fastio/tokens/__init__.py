"""Reading token streams for language-model training: the document-starts table (:mod:`fastio.tokens.starts`), the
pure order of packed sequences (:mod:`fastio.tokens.packing`) and the Loader's token units
(:mod:`fastio.tokens.loading`). The Megatron ``.bin``/``.idx`` format is :mod:`fastio.formats.megatron`; making token
datasets (tokenizing, indexing, merging parts) is :mod:`fastio.convert`'s. See ``docs/tokens.md``. Imports nothing
itself (``fastio convert`` stays light)."""
