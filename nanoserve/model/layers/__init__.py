"""Layers every model family shares: matmuls, norms, rotary embeddings, attention over the paged KV
cache, gated MLPs, mixture-of-experts blocks and the causal-LM shell around them."""
