"""How the worker's calls reach Redis and kombu; every kombu internal the package touches.

Reading order: :mod:`.store` (the one client factory), :mod:`.sender` (script calls on kept
connections), :mod:`.pipe` (the consumer's connection to a store apart), :mod:`.broker` (the
Redis broker's deliveries and the claim riding kombu's round trips), :mod:`.publish` (the
publish journal's write riding kombu's ``LPUSH``), :mod:`.loop` (kombu's hub), :mod:`.sweep`
(the broker's restore sweep), :mod:`.failover` (following a Sentinel failover).
"""
