"""One delivered message, from the gate to its ending.

Reading order: :mod:`.state` (the states and the legal moves), :mod:`.gate` (the consumer's
side: a request is claimed before the pool sees it), :mod:`.lifecycle` (the only code that
acks, rejects, forgets a delivery or releases a claim), :mod:`.guard` (the pool's side: the
task body runs only under a verified claim), :mod:`.lanes` and :mod:`.keyed` (waiting for a
lane's slot or a key), :mod:`.verdict` (what a copy does when the store does not take its
token), :mod:`.keeper` (the lease keeper renewing every live claim).
"""
