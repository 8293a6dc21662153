from nanoserve.engine.core_client.base import EngineCoreClient

__all__ = ["EngineCoreClient"]
