-- A claim (claim.lua) and, once it is granted, its start counted against its rates (rate.lua)
-- in the same call: a rated copy's claim and first rate check cost one round trip. The loader
-- (claims/scripts.py) defines claim(KEYS, ARGV) from claim.lua ahead of this file.
-- KEYS[1..5] = claim.lua's (the queue's, {q})
-- KEYS[5 + i] = rate key of limit i (rate.lua's; under the {rates} tag: every key of this
--               script is in one slot only on a standalone or Sentinel store, never on a Cluster)
-- ARGV[1..7] = claim.lua's (ARGV[4], the time, is the claim's and the rates')
-- ARGV[8] = ms added to each rate key's TTL (0 with the server clock; see rates/redis.py)
-- ARGV[7 + 2i] = count of limit i;  ARGV[8 + 2i] = its period in ms
-- returns: claim.lua's reply; a granted one ({1 | 3, ...}, five items) followed by the start's
--          verdict (rate.lua's reply):
--          {..., 1 ALLOWED, now, next ms of limit 1, ..., next ms of limit n}
--          {..., 9 LIMITED, now, ms until every limit allows a start, index of that limit}
local now = now_ms(ARGV[4])
local n = #KEYS - 5
-- one time for the claim and its rates
local args = {unpack(ARGV, 1, 7)}
args[4] = fmt(now)
local reply = claim({KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]}, args)
if reply[1] ~= 1 and reply[1] ~= 3 then
  -- held, done or given up: no start, nothing counted
  return reply
end
-- a refused start keeps the claim: the copy waits claimed and asks again at its turn
local wait, index, states = rate_check(KEYS, 5, n, now)
if wait > 0 then
  reply[6], reply[7], reply[8], reply[9] = 9, now, wait, index
  return reply
end
local nexts = rate_commit(KEYS, 5, ARGV, 8, states, n, now, tonumber(ARGV[8]))
reply[6], reply[7] = 1, now
for i = 1, n do
  reply[7 + i] = nexts[i]
end
return reply
