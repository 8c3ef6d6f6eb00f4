-- Remove up to a limit of expired claims of one queue (counted as expirations), and up to the
-- same limit of completion records past their retention (not counted: nothing expired).
-- KEYS[1] = claims hash of the queue        ({q}:c)
-- KEYS[2] = expiry sorted set of the queue  ({q}:e)
-- KEYS[3] = stats hash of the queue         ({q}:s)
-- KEYS[4] = completion records of the queue ({q}:d)
-- KEYS[5] = retention sorted set of records ({q}:x)
-- KEYS[6] = takeover counts of the queue    ({q}:t)  (a removed claim's count goes with it)
-- ARGV[1] = now in epoch ms, or '' for the server clock
-- ARGV[2] = the most entries of each kind to remove (a few thousand at most: unpack below)
-- returns: {claims removed, completion records removed}
local now = fmt(now_ms(ARGV[1]))
local limit = tonumber(ARGV[2])

local records = redis.call('ZRANGEBYSCORE', KEYS[5], '-inf', now, 'LIMIT', 0, limit)
if #records > 0 then
  redis.call('HDEL', KEYS[4], unpack(records))
  redis.call('ZREM', KEYS[5], unpack(records))
end

local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'LIMIT', 0, limit)
if #expired > 0 then
  redis.call('HDEL', KEYS[1], unpack(expired))
  redis.call('ZREM', KEYS[2], unpack(expired))
  redis.call('HDEL', KEYS[6], unpack(expired))
  redis.call('HINCRBY', KEYS[3], 'expirations', #expired)
end
return {#expired, #records}
