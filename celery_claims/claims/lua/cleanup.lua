-- Remove up to a limit of expired claims of one queue; count them as expirations.
-- KEYS[1] = claims hash of the queue        ({q}:c)
-- KEYS[2] = expiry sorted set of the queue  ({q}:e)
-- KEYS[3] = stats hash of the queue         ({q}:s)
-- ARGV[1] = now in epoch ms, or '' for the server clock
-- ARGV[2] = the most claims to remove in this call (at most a few thousand: unpack below)
-- returns: the number removed
local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', fmt(now_ms(ARGV[1])),
  'LIMIT', 0, tonumber(ARGV[2]))
if #expired == 0 then
  return 0
end
redis.call('HDEL', KEYS[1], unpack(expired))
redis.call('ZREM', KEYS[2], unpack(expired))
redis.call('HINCRBY', KEYS[3], 'expirations', #expired)
return #expired
