-- Count one start against every limit, or against none (rates/memory.py is the specification).
-- KEYS[i] = rate key of limit i ({tag}:r:<name>), every one under the caller's hash tag
-- ARGV[1] = now in epoch ms, or '' for the server clock
-- ARGV[2] = ms added to each key's TTL (0 with the server clock; see rates/redis.py)
-- ARGV[1 + 2i] = count of limit i;  ARGV[2 + 2i] = its period in ms
-- returns: {1 ALLOWED, now, next ms of limit 1, ..., next ms of limit n}
--          {9 LIMITED, now, ms until every limit allows a start, index of the limit waiting it}
local now = now_ms(ARGV[1])
local n = #KEYS
-- every limit is checked before any counts the start: all of them or none
local wait, index, states = rate_check(KEYS, 0, n, now)
if wait > 0 then
  return {9, now, wait, index}
end
local nexts = rate_commit(KEYS, 0, ARGV, 2, states, n, now, tonumber(ARGV[2]))
return {1, now, unpack(nexts)}
