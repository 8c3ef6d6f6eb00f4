-- Journal a published message (self-contained: not prefixed with _common.lua); with KEYS[4],
-- publish it too, in the same step.
-- KEYS[1] = journaled messages of the queue       ({q}:j)
-- KEYS[2] = their recover times, ms               ({q}:jt)
-- KEYS[3] = their re-publish counts               ({q}:jn)
-- KEYS[4] = the Redis broker's list of the queue (kombu's), or absent: the message is then
--           published on its own
-- ARGV[1] = task id (the attempt's claim id)
-- ARGV[2] = the message: with KEYS[4], kombu's message as its Redis transport pushes it to
--           that list (pushed there, and journaled as it is); else its JSON envelope
-- ARGV[3] = ms after the publish (or the ETA) before recovery may act
-- ARGV[4] = the message's ETA in epoch ms, or '' for none
-- ARGV[5] = absent, or with 3 KEYS, 'keep': an entry already there keeps its message and
--           re-publish count (a worker journaling a message it acks at claim), its recover
--           time brought forward to ARGV[3] after now if that is sooner
-- returns: the recover time (epoch ms, the server's clock)
local t = redis.call('TIME')
local us = tonumber(t[2])
local now = tonumber(t[1]) * 1000 + (us - us % 1000) / 1000 -- (math.floor: a call, dearer)
-- Times are whole ms (journal.py sends whole ms): written with '%d', which costs half of
-- '%.0f' (a decimal conversion of a double)
if #KEYS == 3 and ARGV[5] == 'keep' then
  local kept = redis.call('ZSCORE', KEYS[2], ARGV[1])
  if kept and redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then
    local soon = now + tonumber(ARGV[3])
    if soon < tonumber(kept) then
      redis.call('ZADD', KEYS[2], string.format('%d', soon), ARGV[1])
      return soon
    end
    return tonumber(kept)
  end
end
if #KEYS == 4 then
  -- first: a push the server refuses journals nothing (the publish fails, as kombu's would)
  redis.call('LPUSH', KEYS[4], ARGV[2])
end
local from = now
-- an ETA task waits in a worker's memory until it is due: recovery counts from then
if ARGV[4] ~= '' and tonumber(ARGV[4]) > now then
  from = tonumber(ARGV[4])
end
local at = from + tonumber(ARGV[3])
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[2], string.format('%d', at), ARGV[1])
-- a message published again under the same attempt starts its count again
redis.call('HDEL', KEYS[3], ARGV[1])
return at
