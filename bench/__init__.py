"""``stoker bench``: a load generator and report for any KServe V2 server.

- ``payloads``: request bodies (V2 JSON, V2 binary, JPEG uploads), built before timing.
- ``loadgen``: client worker processes running closed-loop and open-loop (Poisson) steps
  against an HTTP server or against Stoker's batcher and runner pool in-process.
- ``scrape``: the server's ``/metrics`` before and after a step, turned into batch size,
  queue time and compute time.
- ``report``: the terminal table, JSON and PNG plots.
- ``naive``: a one-request-one-inference FastAPI server, the baseline batching must beat.
- ``cli``: ``stoker bench``.
"""
