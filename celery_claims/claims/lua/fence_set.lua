-- Fenced compare-and-set: write a value only if it carries a larger fencing number.
-- KEYS[1] = the guarded key, a hash {fence, value}
-- ARGV[1] = fencing number (claim instance) of the writer, decimal digits
-- ARGV[2] = the value
-- returns: {1, fence} written | {0, stored fence} refused (the stored fence is >= ARGV[1])
local stored = redis.call('HGET', KEYS[1], 'fence')
if stored then
  -- compare as decimal strings (length, then bytes): Lua numbers are doubles and would round
  -- a fencing number above 2^53
  local mine = ARGV[1]
  if #stored > #mine or (#stored == #mine and stored >= mine) then
    return {0, stored}
  end
end
redis.call('HSET', KEYS[1], 'fence', ARGV[1], 'value', ARGV[2])
return {1, ARGV[1]}
