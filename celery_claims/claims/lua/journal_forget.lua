-- Forget journaled messages (self-contained: not prefixed with _common.lua).
-- KEYS[1] = journaled messages of the queue       ({q}:j)
-- KEYS[2] = their recover times, ms               ({q}:jt)
-- KEYS[3] = their re-publish counts               ({q}:jn)
-- ARGV    = task ids (attempts' claim ids); absent ones are fine
-- returns: how many entries there were
local n = redis.call('HDEL', KEYS[1], unpack(ARGV))
redis.call('ZREM', KEYS[2], unpack(ARGV))
redis.call('HDEL', KEYS[3], unpack(ARGV))
return n
