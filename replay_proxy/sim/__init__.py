"""Protocol-faithful fake peers, to run the proxy without vLLM; they stand on ``wire`` and ``net`` alone.

For others: ``run`` (``run_frontend``, ``run_engine``: a sim peer in the
foreground) and the ``drift`` knobs (``EngineDrift``, ``FrontendDrift``), each a
break from vLLM's history. The peers themselves (``engine.SimEngine``,
``frontend.SimFrontend``, ``api.serve_api``, ``workload.run_workload``) are
sim's own in the package (pyproject.toml: [tool.importlinter]); the tests and
benchmarks drive them directly.
"""
