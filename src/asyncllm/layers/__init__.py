"""Building blocks of the models: norms, rotary embeddings, paged attention. Torch only."""
