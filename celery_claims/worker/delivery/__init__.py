"""One delivered message, from the gate to its ending.

Reading order: :mod:`.state` (the states, the legal moves and the endings, as tables),
:mod:`.gate` (the consumer's side: a request is claimed before the pool sees it),
:mod:`.lifecycle` (every event of a copy, wired to its parts: :mod:`.registry`, the one place
a state changes; :mod:`.turns`, :mod:`.holds`, :mod:`.unrun`, :mod:`.completion`,
:mod:`.endings`, :mod:`.losses`, the only code that acks, rejects, forgets a delivery or
releases a claim), :mod:`.guard` (the pool's side: the body runs only under a verified
claim), :mod:`.rates` (waiting for a fleet-wide rate, with :mod:`.slots` and :mod:`.valve`:
the prefetch slots a waiting copy gives back, and a queue closed while too many wait),
:mod:`.lanes` (with :mod:`.lane_model` and :mod:`.lane_tickets`) and :mod:`.keyed` (waiting
for a lane's slot or a key), :mod:`.verdict` (what a copy does when the store does not take
its token),
:mod:`.keeper` (the lease keeper renewing every live claim).
"""
