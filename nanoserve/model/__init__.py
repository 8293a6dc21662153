"""The model side of the engine core: the runner, the sampler, paged attention, and every model family
behind a registry (registry.py, family.py, models/, layers/), loaded by loader.py."""
