"""Protocol-faithful fake peers, to run the proxy without vLLM; they stand on ``wire`` and ``net`` alone.

For others: ``engine.SimEngine``, ``frontend.SimFrontend``, ``api.serve_api`` (its
HTTP API), ``workload.run_workload``, and the ``drift`` knobs (``EngineDrift``,
``FrontendDrift``), each a break from vLLM's history.
"""
