"""One module per model family; each exports its FAMILY, which nanoserve.model.registry lists."""
