"""The tuning coordinator: workers' profiles in, per-worker scheduler knobs out.

The knobs it decides are declared in shared.knobs. policy (pure rules on one profile),
coordinator (hysteresis, trials, reverts, freeze; pure, time passed in), store (the strategy on
disk), report (the adaptive report), service (the asyncio glue to a worker pool: inside the
gateway, or inside the standalone coordinator), server and main (`reame-coordinator`, one
strategy for several gateways), remote (a gateway's link to it).
"""
