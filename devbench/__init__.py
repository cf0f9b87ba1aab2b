"""attnlab's developer benchmarks: the programs behind the committed tables in
``benchmarks/`` (``python -m devbench NAME`` from the repository's root), not part of the
installed package.

``attention``, ``mha``, ``gemv``, ``sampling``, ``variants`` and ``qwen2`` (the random-shape
tables) and ``llamacpp`` (attnlab against llama.cpp on the same GGUF files) live here;
``generate``, ``serve``, ``families`` and ``quantization`` are ``attnlab bench``'s, which a
user runs on their own model, run here with the same options.
Every run here writes into ``benchmarks/`` (``runs/bench-quick`` with ``--quick``) and keeps
the runs a table held below the new one (``devbench.history``).
"""
